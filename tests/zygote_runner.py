"""Stand-in task runners for the warm zygote's tests (tests/test_warm_executor.py): a forked
child runs one of these with the task's spec instead of Flower's ClientApp runner, so the
zygote's process model can be checked without a SuperNode. ``runtime_api_address`` carries
the folder a task writes its report into."""

from __future__ import annotations

import json
import os
import threading
import time


def report(spec: dict) -> None:
    """Write what this task's process saw; raise when the token asks for it."""
    from threadpoolctl import threadpool_info

    blas = [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]
    record = {"pid": os.getpid(), "ppid": os.getppid(), "token": spec["token"], "blas_threads": blas,
              "openblas_env": os.environ.get("OPENBLAS_NUM_THREADS"), "leaked": os.environ.get("PROMPTFCL_LEAKED")}
    path = os.path.join(spec["runtime_api_address"], f"task-{spec['task_id']}.json")
    with open(path + ".part", "w") as fh:
        json.dump(record, fh)
    os.replace(path + ".part", path)
    if spec["token"] == "raise":
        raise RuntimeError("this task fails on purpose")
    if spec["token"] == "leak":  # state a task leaves behind must not reach the next task
        os.environ["PROMPTFCL_LEAKED"] = "1"


# imported by the zygote as its runner module: a thread started at import time, which the
# zygote must refuse to fork with
_THREADED = os.environ.get("PROMPTFCL_TEST_THREADED_RUNNER") == "1"
if _THREADED:
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
