"""The grid runner every grid benchmark shares (``bench compare``, ``bench robustness``): its runs one
after another, ``parallel`` at once on this machine, or as Ray tasks on a running Ray cluster.

Each run is a ``promptfcl simulate`` child with its own results.json; a run whose results.json
holds the same configuration is skipped, an interrupted one resumes from its checkpoint
(:func:`.common.run_simulation_subprocess`). Running several at once changes only where a run
computes: the placement keys ``client-cpus`` and ``threads`` (result-neutral, left alone where
the user set them) give each run its share of the cores, ``CUDA_VISIBLE_DEVICES`` its share of
the GPUs. SIGTERM or Ctrl-C stops every run with its Ray processes and says what is done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .grid_parts import (
    GridInterrupted,
    GridRun,
    Outcome,
    Placement,
    attempt,
    gpu_slots,
    raise_on_sigterm,
    slot_settings,
    stopping,
)

log = logging.getLogger("promptfcl")


def run_grid(runs: Sequence[GridRun], placement: Placement,
             finished: Callable[[GridRun], dict[str, Any] | None],
             on_result: Callable[[dict[int, Outcome]], object] = lambda _: None) -> dict[int, Outcome]:
    """Run what ``finished`` (the results already there, else None) lacks; return each run's outcome
    by its index in ``runs``. ``on_result`` sees the outcomes so far after each run (in any order).

    Raises KeyboardInterrupt or :class:`GridInterrupted` after stopping every run and logging
    which runs are done and which not.
    """
    outcomes: dict[int, Outcome] = {}
    todo = []
    for i, run in enumerate(runs):
        results = finished(run)
        if results is not None:
            log.info("%s: reusing %s", run.name, run.run_dir)
            outcomes[i] = (results, None)
        else:
            todo.append(i)
    if outcomes:
        on_result(dict(outcomes))
    progress = _Progress(len(runs), len(outcomes))
    try:
        with _sigterm_raises():
            if placement.ray_address:
                from .grid_ray import run_on_cluster  # Ray is imported only for a cluster grid

                execute: Generator[tuple[int, Outcome], None, None] = run_on_cluster(runs, todo, placement)
            else:
                execute = _run_here(runs, todo, placement.parallel)
            try:
                for i, outcome in execute:
                    outcomes[i] = outcome
                    progress.done(runs[i].name, outcome[1] is None)
                    on_result(dict(outcomes))
            finally:
                execute.close()  # stops the runs still going when the grid is interrupted
    except BaseException as exc:
        if not _interruption(exc):
            raise
        done = [runs[i].name for i in sorted(outcomes) if outcomes[i][1] is None]
        missing = [runs[i].name for i in range(len(runs)) if i not in outcomes or outcomes[i][1] is not None]
        log.error("grid interrupted: %d of %d runs done, every run stopped; the same command again goes on "
                  "(unfinished runs resume from their checkpoints)\n  done: %s\n  not done: %s",
                  len(done), len(runs), "; ".join(done) or "-", "; ".join(missing) or "-")
        if isinstance(exc, (KeyboardInterrupt, GridInterrupted)):
            raise
        raise GridInterrupted(str(exc)) from exc  # Ray wraps a signal that reached its wait
    return outcomes


def _interruption(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was caused by, Ctrl-C or SIGTERM (Ray re-raises them wrapped)."""
    while exc is not None:
        if isinstance(exc, (KeyboardInterrupt, GridInterrupted)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _run_here(runs: Sequence[GridRun], todo: list[int], parallel: int) -> Generator[tuple[int, Outcome], None, None]:
    """The runs ``todo``, ``parallel`` at once on this machine, each in the slot it was given."""
    if not todo:
        return
    parallel = max(1, min(parallel, len(todo)))
    cores = len(os.sched_getaffinity(0))
    ray_cpus = os.cpu_count() or cores  # what a run's local Ray counts (server/simulation.py)
    slots: queue.Queue[int] = queue.Queue()
    for s in range(parallel):
        slots.put(s)
    gpus = gpu_slots(parallel) if parallel > 1 else [None]

    def one(i: int) -> Outcome:
        slot = slots.get()
        try:
            settings, env = runs[i].settings, None
            if parallel > 1:  # alone, a run sizes itself for the whole machine
                settings = slot_settings(settings, max(1, cores // parallel), ray_cpus)
                if gpus[slot] is not None:
                    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpus[slot])}
            log.info("%s: starting (slot %d)", runs[i].name, slot)
            return attempt(runs[i], settings, env)
        finally:
            slots.put(slot)

    pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="grid")
    stopping.clear()
    futures: dict[Future[Outcome], int] = {pool.submit(one, i): i for i in todo}
    pending = set(futures)
    try:
        while pending:
            # a short wait, so that the main thread sees Ctrl-C and SIGTERM between waits
            done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
            for future in done:
                yield futures[future], future.result()
    finally:
        for future in futures:
            future.cancel()
        if pending:  # interrupted: each worker thread is in run_simulation_subprocess's wait; stop the
            _stop_children()  # children from here (a thread cannot be interrupted), the threads then see them gone
        pool.shutdown(wait=True)


def _stop_children(grace: float = 30.0) -> None:
    """SIGINT every live run this process started (the simulation shuts its Ray down, then
    run_simulation_subprocess reaps what is left of it), SIGKILL to the process group of one still
    there after ``grace`` seconds. A second SIGTERM or
    Ctrl-C meanwhile is ignored: the stop must not be cut short."""
    from .common import RUN_MARK

    stopping.set()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        me, children = os.getpid(), []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if parent == me and RUN_MARK.encode() in (entry / "environ").read_bytes():
                    os.kill(int(entry.name), signal.SIGINT)
                    children.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
        deadline = time.monotonic() + grace
        while children and time.monotonic() < deadline:
            children = [pid for pid in children if _alive(pid)]
            time.sleep(0.2)
        for pid in children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # a run is the leader of its own session
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its thread, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`GridInterrupted` in the main thread for the duration (as Ctrl-C raises
    KeyboardInterrupt), so that the grid stops its runs instead of dying with them running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    raise_on_sigterm()
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Progress:
    """The grid's progress line: runs done of the total, failures, and an ETA from the runs so far."""

    def __init__(self, total: int, reused: int) -> None:
        self.total, self.finished, self.failed, self.ran = total, reused, 0, 0
        self.start = time.monotonic()

    def done(self, name: str, ok: bool) -> None:
        self.finished += 1
        self.ran += 1
        self.failed += not ok
        left = self.total - self.finished
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.ran * left  # the rate so far, at the grid's parallelism
        log.info("grid: %d/%d runs done%s (%s %s); elapsed %s, ETA %s", self.finished, self.total,
                 f", {self.failed} failed" if self.failed else "", name, "finished" if ok else "FAILED",
                 _clock(elapsed), _clock(eta))


def _clock(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"
