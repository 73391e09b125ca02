"""The warm forking executor (client/warm_executor.py, client/zygote.py): every task in a process
of its own, forked from one zygote; failures and restarts; the zygote's memory over many tasks.

These run a real zygote (a real ``python -m promptfcl.client.zygote`` importing torch, Flower
and promptfcl) whose children run stand-in tasks from tests/zygote_runner.py instead of
Flower's ClientApp runner; the deployed tests (tests/test_deploy.py) run Flower's runner itself
through it, and the last test here deploys one run twice, with and without it (a file of its
own for pytest's loadfile: it does not share test_deploy.py's federation).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from promptfcl.client.warm_executor import ForkingExecutor
from promptfcl.common.flower_internals import internal

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the warm executor forks (Linux only)")

ROOT = Path(__file__).resolve().parents[1]


def spec(folder: Path, task_id: int, token: str = "ok", task_type=None):
    """A real Flower ExecutionSpec for one task; its runtime address names the report folder."""
    return internal("execution_spec")(
        task_type=task_type or internal("task_type").CLIENT_APP, runtime_api_address=str(folder), token=token,
        insecure=True, root_certificates_path=None, runtime_dependency_install=False, parent_pid=os.getpid(),
        suppress_output=False, task_id=task_id)


def reports(folder: Path, count: int, timeout: float = 60) -> dict[int, dict]:
    """The reports of tasks 1..count, waiting for them to be written."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        done = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in folder.glob("task-*.json")}
        if len(done) >= count:
            return done
        time.sleep(0.1)
    raise AssertionError(f"only {len(done)} of {count} tasks reported")


class RecordingStock:
    """Flower's stock executor with its launch recorded instead of starting ``flwr-clientapp``
    (there is no SuperNode here to give that process a task)."""

    def __init__(self) -> None:
        self.real = internal("subprocess_executor")()
        self.launched: list[int] = []

    def launch(self, spec):
        self.launched.append(spec.task_id)
        return internal("launch_result").accepted()

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def executor(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT.parent) + os.pathsep + str(ROOT))
    made = []

    def make(runner="tests.zygote_runner:report"):
        ex = ForkingExecutor(runner=runner)
        ex.stock = RecordingStock()
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()


def test_every_task_runs_in_a_process_of_its_own_forked_from_one_zygote(executor, tmp_path):
    ex = executor()
    for i in range(1, 21):
        assert ex.launch(spec(tmp_path, i)).status == "accepted"
    done = reports(tmp_path, 20)
    zygote = ex.zygote.pid
    assert {r["ppid"] for r in done.values()} == {zygote}  # forked by the zygote ...
    assert len({r["pid"] for r in done.values()}) == 20  # ... one process per task
    assert zygote not in {r["pid"] for r in done.values()}
    assert ex.counts == {"forked": 20, "stock": 0, "restarts": 1}
    assert ex.stock.launched == []
    # a child gets the BLAS threads a fresh process would (the zygote holds one thread)
    cores = len(os.sched_getaffinity(0))
    assert all(r["blas_threads"] and set(r["blas_threads"]) == {cores} for r in done.values())
    assert all(r["openblas_env"] == os.environ.get("OPENBLAS_NUM_THREADS") for r in done.values())
    assert ex.zygote.ask({"ping": True})["threads"] == 1


def test_a_task_that_raises_or_leaks_state_leaves_the_next_task_unaffected(executor, tmp_path):
    ex = executor()
    ex.launch(spec(tmp_path, 1, token="raise"))  # fails after writing its report
    ex.launch(spec(tmp_path, 2, token="leak"))  # sets an environment variable in its process
    ex.launch(spec(tmp_path, 3))
    done = reports(tmp_path, 3)
    assert done[3]["leaked"] is None  # nothing of task 2's process reached task 3's
    assert {r["ppid"] for r in done.values()} == {ex.zygote.pid}  # the zygote outlived the failure
    assert ex.counts == {"forked": 3, "stock": 0, "restarts": 1}


def test_the_zygotes_memory_stays_flat_over_fifty_tasks(executor, tmp_path):
    ex = executor()
    for i in range(1, 6):  # warm-up: the first requests allocate the zygote's buffers
        ex.launch(spec(tmp_path, i))
    reports(tmp_path, 5)
    before = ex.zygote.ask({"ping": True})["rss_kb"]
    for i in range(6, 56):
        ex.launch(spec(tmp_path, i))
    reports(tmp_path, 55)
    after = ex.zygote.ask({"ping": True})["rss_kb"]
    print(f"zygote RSS {before / 1024:.1f} MiB before, {after / 1024:.1f} MiB after 50 tasks")
    assert after - before < 2048, f"the zygote grew by {after - before} KiB over 50 tasks"


def test_a_killed_zygote_is_restarted_and_no_task_is_lost(executor, tmp_path, caplog):
    ex = executor()
    ex.launch(spec(tmp_path, 1))
    reports(tmp_path, 1)
    dead = ex.zygote.pid
    os.kill(dead, signal.SIGKILL)
    ex.zygote.process.wait()
    ex.launch(spec(tmp_path, 2))  # the executor notices, logs, restarts, launches
    done = reports(tmp_path, 2)
    assert done[2]["ppid"] == ex.zygote.pid != dead
    assert ex.counts["restarts"] == 2 and ex.counts["forked"] == 2
    # between polls, reconcile replaces a dead zygote before the next task needs it
    os.kill(ex.zygote.pid, signal.SIGKILL)
    ex.zygote.process.wait()
    ex.reconcile()
    assert ex.zygote is not None and ex.zygote.alive() and ex.counts["restarts"] == 3


def test_without_a_usable_zygote_tasks_go_to_flowers_stock_executor(executor, tmp_path, monkeypatch):
    # a zygote whose runner starts a thread cannot fork safely: it refuses, twice, and the
    # executor hands this task and the later ones to Flower's subprocess executor
    monkeypatch.setenv("PROMPTFCL_TEST_THREADED_RUNNER", "1")
    ex = executor()
    assert ex.launch(spec(tmp_path, 1)).status == "accepted"
    assert ex.launch(spec(tmp_path, 2)).status == "accepted"
    assert ex.stock.launched == [1, 2] and ex.fallback and ex.counts["forked"] == 0
    assert not list(tmp_path.glob("task-*.json"))
    # a runner that cannot be imported: the zygote never comes up; same fallback
    broken = executor("tests.no_such_module:run")
    broken.launch(spec(tmp_path, 3))
    assert broken.stock.launched == [3] and broken.fallback


def test_other_task_types_go_to_the_stock_executor(executor, tmp_path):
    ex = executor()
    ex.launch(spec(tmp_path, 1, task_type=internal("task_type").SERVER_APP))
    assert ex.stock.launched == [1] and ex.zygote is None


def test_a_changed_installation_rebuilds_the_zygote(executor, tmp_path):
    ex = executor()
    ex.launch(spec(tmp_path, 1))
    reports(tmp_path, 1)
    first = ex.zygote.pid
    source = ROOT / "client" / "zygote.py"
    st = source.stat()
    try:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # as a reinstall would
        ex.launch(spec(tmp_path, 2))
    finally:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    done = reports(tmp_path, 2)
    assert ex.zygote.pid != first and done[2]["ppid"] == ex.zygote.pid and ex.counts["restarts"] == 2


def test_supernode_waits_are_shortened_only_where_flower_waits_idle(monkeypatch):
    """deploy/supernode.py: Flower's fixed 3 s idle wait becomes --idle-poll, its local waits at
    most --local-poll, and the module it patches is the SuperNode loop's own ``time``."""
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        import supernode
    finally:
        sys.path.remove(str(ROOT / "deploy"))
    slept = []
    monkeypatch.setattr(supernode.time, "sleep", slept.append)
    waits = supernode.ShorterWaits(idle=0.7, local=0.05)
    waits.sleep(3)
    waits.sleep(0.5)
    waits.sleep(0.01)
    assert slept == [0.7, 0.05, 0.01]
    assert waits.monotonic is supernode.time.monotonic  # everything else is the time module's
    loop_time = internal("supernode_loop_time")
    assert loop_time is supernode.time  # the name deploy/supernode.py rebinds exists in this Flower


# ----------------------------------------------------------------------------- deployed, against the stock executor
@pytest.mark.deploy
def test_warm_executor_trains_exactly_what_the_stock_executor_trains(tmp_path):
    """The same run deployed twice: nodes with the warm forking executor (deploy/start-client.sh's
    default) and with Flower's stock one (--no-warm) reach the same accuracy matrix; only the
    stock path's messages pay the imports (a fresh interpreter each), the warm one's never do."""
    from concurrent.futures import ThreadPoolExecutor

    from promptfcl.server.loopback import run_deployed
    from tests.deployment import RUN

    # one round (a train and an evaluate message per node: both kinds of message start a process);
    # the two federations side by side (their own ports, folders and processes): each spends
    # most of its time waiting on its processes' start-ups and polls
    run = {**RUN, "num-clients": 2, "clients-per-round": 2, "rounds-per-task": 1, "out-dir": "runs/warm-vs-stock"}
    with ThreadPoolExecutor(2) as pool:
        warm_run = pool.submit(run_deployed, tmp_path / "warm", run, 2)
        stock_run = pool.submit(run_deployed, tmp_path / "stock", run, 2, warm=False)
        warm, stock = warm_run.result(), stock_run.result()
    assert warm["accuracy_matrix"] == stock["accuracy_matrix"]
    assert warm["config_digest"] == stock["config_digest"]
    warm_imports = [r["client_startup"].get("imports", 0.0) for r in warm["rounds"]]
    stock_imports = [r["client_startup"].get("imports", 0.0) for r in stock["rounds"]]
    assert all(s > 0.5 for s in stock_imports), stock_imports
    assert all(w == 0.0 for w in warm_imports), warm_imports
    # ... yet each warm message is still a process of its own, whose start-up is measured
    assert all(r["client_overhead_seconds"] > 0.0 for r in warm["rounds"])
    node_log = (tmp_path / "warm" / "node1.log").read_text(errors="replace")
    assert "warm zygote" in node_log and "Start `flwr-clientapp` process" not in node_log
    print(f"\nper-message overhead (median over rounds): warm "
          f"{np.median([r['client_overhead_seconds'] for r in warm['rounds']]):.2f} s, stock "
          f"{np.median([r['client_overhead_seconds'] for r in stock['rounds']]):.2f} s")
