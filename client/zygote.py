"""The warm zygote: one process that has imported torch, Flower's ClientApp runner and promptfcl,
and forks a child for every ClientApp task.

Flower's SuperExec starts a fresh ``flwr-clientapp`` interpreter for every message, which pays
Python's and torch's imports again each time (seconds on a CPU machine). The zygote pays them
once; each task still runs in a process of its own (the forked child runs Flower's own
``run_clientapp`` for the task's token and exits), so a crash or leaked state cannot cross
messages, exactly as with the stock executor.

What makes the fork safe: the zygote never runs a tensor operation (so neither torch's
OpenMP pool nor CUDA exists in it) and has one thread when it forks, which it checks before
every fork. Children initialise CUDA themselves. The zygote holds nothing else: its imported
modules are shared with every child copy-on-write, the frozen backbone is memory-mapped from the
node's disk cache by each child (about 0.1 s on this machine, against 3-5 s of imports; the
weights are the page cache's pages, one copy for all children, never one per child), and the
node's decoded data are read from the same cache by row.

The executor (client/warm_executor.py) talks to the zygote over a socket pair, one JSON line
per request: ``{"spec": {...}}`` -> ``{"pid": N}`` or ``{"error": "..."}``. The task's token
travels over that socket, never on a command line.

Run as ``python -m promptfcl.client.zygote --fd N`` by the executor only. Its imports are inside
functions on purpose: what the zygote imports, and when (``preload``, before any fork; a child's
own after it), is the point of this module.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: a forked task's first wait for message objects its SuperNode does not hold yet (Flower: 1 s)
PULL_FIRST_RETRY_SECONDS = 0.05

#: what a child runs: Flower's ClientApp runner, given the task's spec (see ``run_flower_task``)
DEFAULT_RUNNER = "promptfcl.client.zygote:run_flower_task"


#: promptfcl's installed folders (common <- strategies <- client <- server)
LAYERS = ("common", "strategies", "client", "server")


def thread_count() -> int:
    """Threads of this process (Linux: /proc; elsewhere 1, where fork is not offered anyway)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def installed_fingerprint() -> str:
    """A digest of promptfcl's installed source files (path, size, mtime) and the versions of
    torch and Flower: when it changes, a zygote holds stale code and is rebuilt."""
    from importlib.metadata import PackageNotFoundError, version

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for layer in LAYERS for p in (root / layer).rglob("*.py")):
        try:
            st = path.stat()
        except OSError:
            continue
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    for dist in ("torch", "flwr", "promptfcl"):
        try:
            h.update(f"{dist}={version(dist)}\n".encode())
        except PackageNotFoundError:
            pass
    return h.hexdigest()[:16]


def preload() -> None:
    """Import what every ClientApp task imports; no tensor is created (see the module docstring)."""
    import httpcore  # noqa: F401  (Flower's Runtime API client imports it on its first request)
    import numpy.ma  # noqa: F401
    import threadpoolctl  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim imports it on a process's first optimiser: 2 s)

    from ..common.flower_internals import internal, set_internal_default
    from ..common.node import startup
    from ..strategies.registry import methods
    from . import app  # noqa: F401  (the ClientApp and, through it, the project)

    for name, method in methods().items():  # every installed method's code, ours and others'
        try:
            method.load("learner")
            method.load("strategy")
        except Exception as exc:  # noqa: BLE001 - a broken method fails in its own task, as it would cold
            print(f"promptfcl zygote: method {name!r} not preloaded ({type(exc).__name__}: {exc})", file=sys.stderr)

    internal("run_clientapp")
    internal("resolve_root_certificates")
    # A forked task asks its SuperNode for the message's objects within milliseconds of being
    # launched, often before the SuperNode holds them all; Flower's runner then waits 1 s
    # before asking again (made for processes that took seconds to start). Ask again sooner,
    # backing off as Flower does (doubling, capped at its 10 s).
    set_internal_default("pull_message_objects", "initial_backoff", PULL_FIRST_RETRY_SECONDS)
    del torch
    # the zygote's own import time is not any child's start-up cost: a child reports what it times
    startup.take()


#: the zygote imports numpy with OpenBLAS held to one thread (its worker pool would be a second
#: thread at fork); the executor passes the operator's own setting here for the children
BLAS_THREADS_ENV = "PROMPTFCL_CHILD_OPENBLAS_NUM_THREADS"


def restore_blas_threads() -> None:
    """Give a child the OpenBLAS threads a fresh process would have: the operator's
    OPENBLAS_NUM_THREADS, else one per core this process may use."""
    wanted = os.environ.pop(BLAS_THREADS_ENV, "")
    if wanted:
        os.environ["OPENBLAS_NUM_THREADS"] = wanted
    else:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)
    count = int(wanted) if wanted.isdigit() and int(wanted) > 0 else len(os.sched_getaffinity(0))
    from threadpoolctl import ThreadpoolController

    ThreadpoolController().limit(limits=count, user_api="blas")


def run_flower_task(spec: dict[str, Any]) -> None:
    """Flower's ``flwr-clientapp`` for one task, in this (forked) process: the same call its
    command line makes (flwr/supernode/cli/flwr_clientapp.py)."""
    from ..common.flower_internals import internal

    internal("run_clientapp")(
        runtime_api_address=spec["runtime_api_address"],
        token=spec["token"],
        insecure=bool(spec["insecure"]),
        certificates=internal("resolve_root_certificates")(spec.get("root_certificates_path"), bool(spec["insecure"])),
        parent_pid=spec.get("parent_pid"),
        runtime_dependency_install=bool(spec.get("runtime_dependency_install", False)),
    )


def load_runner(ref: str) -> Callable[[dict[str, Any]], None]:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


#: a folder: each forked task writes its cProfile there (where a message's time goes)
PROFILE_ENV = "PROMPTFCL_PROFILE_TASKS"


def _profiler() -> Any:
    if not os.environ.get(PROFILE_ENV):
        return None
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _child(runner: Callable[[dict[str, Any]], None], spec: dict[str, Any], channel: socket.socket) -> None:
    """The forked child: a process of its own for one task; never returns."""
    code = 1
    try:
        os.close(channel.detach())  # the zygote's channel is not this task's
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # a fresh interpreter's global generators start from OS entropy; so do the children's
        # (torch's default generator is untouched in the zygote, so it is a fresh process's)
        random.seed()
        import numpy as np

        np.random.seed()
        restore_blas_threads()
        from ..common.node import startup

        # this message's process imported nothing (the zygote did, once): its start-up is
        # Flower's task pull, the model build and the data, which the reply reports as usual
        startup.record("imports", 0.0)
        profiler = _profiler()
        try:
            runner(spec)
        finally:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(os.path.join(os.environ[PROFILE_ENV], f"task-{os.getpid()}.prof"))
        code = 0
    except SystemExit as exc:  # Flower's runner ends with flwr_exit (sys.exit)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever a task raises ends only its own process
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(channel: socket.socket, runner: Callable[[dict[str, Any]], None]) -> None:
    """Answer launch requests until the executor closes its end."""
    reader = channel.makefile("r", encoding="utf-8")
    for line in reader:
        try:
            request = json.loads(line)
            if request.get("ping"):
                reply: dict[str, Any] = {"pong": True, "threads": thread_count(), "rss_kb": rss_kb()}
            else:
                threads = thread_count()
                if threads != 1:  # forking a threaded process can deadlock the child: refuse, loudly
                    reply = {"error": f"the zygote has {threads} threads; it forks only with one"}
                else:
                    pid = os.fork()
                    if pid == 0:
                        _child(runner, request["spec"], channel)
                    reply = {"pid": pid}
        except (ValueError, KeyError, TypeError, OSError) as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        channel.sendall((json.dumps(reply) + "\n").encode())


def rss_kb() -> int:
    """Resident memory of this process in KiB (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="promptfcl's warm zygote (started by promptfcl-superexec)")
    parser.add_argument("--fd", type=int, required=True, help="the executor's socket")
    parser.add_argument("--runner", default=DEFAULT_RUNNER, help="module:function a child runs with the spec")
    args = parser.parse_args(argv)
    channel = socket.socket(fileno=args.fd)
    started = time.perf_counter()
    preload()
    runner = load_runner(args.runner)
    hello = {"ready": True, "pid": os.getpid(), "preload_seconds": time.perf_counter() - started,
             "threads": thread_count(), "fingerprint": installed_fingerprint()}
    channel.sendall((json.dumps(hello) + "\n").encode())
    # children are reaped by the kernel (no zombies); Flower's Runtime API tracks their tasks.
    # The executor's end closing is the zygote's signal to go.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    serve(channel, runner)


if __name__ == "__main__":
    main()
