"""Where a process spends its time before its first training step (deployment overhead).

Flower's deployment engine runs every message in a fresh ClientApp process, so each one
pays its imports, model build, weight load and data load again; these timers say how
much of each (``promptfcl bench deploy``). A phase is timed where it happens, once per
process, and the first reply of the process reports (and clears) what was timed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: the phases a fresh process goes through, in order (``other`` is what none of them covers):
#: ``imports`` (process start to the ClientApp's module imported), ``flower_receive`` (from there to
#: the message reaching the app: Flower's runner pulling and decoding it), ``context`` (the
#: message's run config, options and node policy parsed, the run checked against the node's
#: limits, the memory plan, the learner), ``model_build``, ``weights``, ``data``, ``query_cache``,
#: ``reply`` (after training: the reply privatised, its metrics; Flower's encoding follows the reply)
PHASES = ("imports", "flower_receive", "context", "model_build", "weights", "data", "query_cache", "reply")

_timed: dict[str, float] = {}  # phase -> seconds in this process, not yet reported


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the enclosed block as ``name`` (one of ``PHASES``)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        record(name, time.perf_counter() - started)


def record(name: str, seconds: float) -> None:
    """Add ``seconds`` to phase ``name``."""
    if name not in PHASES:
        raise ValueError(f"unknown start-up phase {name!r}; one of {PHASES}")
    _timed[name] = _timed.get(name, 0.0) + seconds


def since_imports() -> None:
    """In a fresh process's first message, as the message reaches the app: the time since the
    imports ended (Flower's runner pulling and decoding the message) as ``flower_receive``."""
    imported = pending("imports")
    if imported is not None and "flower_receive" not in _timed:
        record("flower_receive", max(0.0, process_age() - imported))


def pending(name: str) -> float | None:
    """Phase ``name``'s seconds timed and not yet reported (None: none), e.g. whether this
    process's ``imports`` still wait for its first reply."""
    return _timed.get(name)


def take() -> dict[str, float]:
    """The phases timed since the last call (empty once the process is warm)."""
    out = dict(_timed)
    _timed.clear()
    return out


def metric_name(name: str) -> str:
    """The reply metric that carries phase ``name`` (``query_cache`` -> ``startup-query-cache-seconds``)."""
    return f"startup-{name.replace('_', '-')}-seconds"


def process_age() -> float:
    """Seconds since this process started (Linux; 0.0 elsewhere): with a fresh process per
    message, this is the message's whole cost on the node, imports included."""
    try:
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
