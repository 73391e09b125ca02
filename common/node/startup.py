"""Where a process spends its time before its first training step (deployment overhead).

Flower's deployment engine runs every message in a fresh ClientApp process, so each one
pays its imports, model build, weight load and data load again; these timers say how
much of each (``promptfcl bench deploy``). A phase is timed where it happens, once per
process, and the first reply of the process reports (and clears) what was timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

#: the phases a fresh process goes through, in order (``other`` is what none of them covers)
PHASES = ("imports", "model_build", "weights", "data", "query_cache")

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


def take() -> dict[str, float]:
    """The phases timed since the last call (empty once the process is warm)."""
    out = dict(_timed)
    _timed.clear()
    return out


def metric_name(name: str) -> str:
    """The reply metric that carries phase ``name`` (``query_cache`` -> ``startup-query-cache-seconds``)."""
    return f"startup-{name.replace('_', '-')}-seconds"
