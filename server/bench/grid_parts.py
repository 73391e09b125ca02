"""What the grid runner (grid.py) and its Ray-cluster form (grid_ray.py) share: a grid's runs, where
they compute, one run's attempt, a run's share of a machine, SIGTERM as an exception."""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...common.config.experiment import ExperimentConfig
from .common import run_simulation_subprocess

log = logging.getLogger("promptfcl")


@dataclass(frozen=True)
class GridRun:
    """One run of a grid: what it is called in logs, its method and settings, where its files go."""

    name: str
    strategy: str
    settings: dict[str, Any]
    run_dir: Path


@dataclass(frozen=True)
class Placement:
    """Where a grid's runs compute: ``parallel`` at once here, or on the Ray cluster at ``ray_address``."""

    parallel: int = 1
    ray_address: str = ""


#: one run after another, on this machine
SEQUENTIAL = Placement()


class GridInterrupted(Exception):
    """SIGTERM reached the grid (Ctrl-C is KeyboardInterrupt)."""


#: set while an interrupted grid stops its runs: their ends are not failures
stopping = threading.Event()

#: a finished run's results, or None with the error of a failed one
Outcome = tuple[dict[str, Any] | None, str | None]


def slot_settings(settings: dict[str, Any], cores: int, ray_cpus: int) -> dict[str, Any]:
    """``settings`` for a run given ``cores`` of a machine whose Ray sees ``ray_cpus``: client actors
    sized so that at most ``cores`` train at once (``client-cpus``), each with its share of torch
    threads (``threads``); a value the user chose is kept."""
    cfg = ExperimentConfig.from_dict(settings)
    actors = max(1, min(cores, cfg.federation.sampled_per_round))
    extra: dict[str, Any] = {}
    if cfg.placement.client_cpus == "auto":
        extra["client-cpus"] = str(int(ray_cpus / actors * 1e4) / 1e4)
    if cfg.placement.threads == 0:
        extra["threads"] = max(1, cores // actors)
    return {**settings, **extra}


def gpu_slots(parallel: int) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` of each of ``parallel`` slots: the visible GPUs split between them
    (a GPU shared where there are fewer GPUs than slots); None: no GPU, nothing to set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g for g in visible.split(",") if g.strip()]
    else:
        import torch  # only to count the GPUs

        gpus = [str(i) for i in range(torch.cuda.device_count())]
    if not gpus:
        return [None] * parallel
    if len(gpus) < parallel:
        return [gpus[s % len(gpus)] for s in range(parallel)]
    each = len(gpus) // parallel
    return [",".join(gpus[s * each:(s + 1) * each]) for s in range(parallel)]


def attempt(run: GridRun, settings: dict[str, Any], env: dict[str, str] | None = None,
            out: Path | None = None) -> Outcome:
    """One run in a child process (in ``out``, default its run_dir): its results, or its error."""
    try:
        return run_simulation_subprocess(settings, out or run.run_dir, strategy=run.strategy, env=env), None
    except Exception as exc:  # noqa: BLE001 (one broken run must not cost the others)
        if stopping.is_set():  # stopped by the grid's interruption, not broken
            log.info("%s stopped", run.name)
        else:
            log.error("%s FAILED; going on with the rest:\n%s", run.name, str(exc)[-1500:])
        return None, f"{type(exc).__name__}: {str(exc)[-300:]}"


def raise_on_sigterm() -> None:
    """(Again) make SIGTERM raise :class:`GridInterrupted` in the main thread: ``ray.init`` replaces
    the handler with one that exits at once, which would leave a cluster grid's tasks running."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupted)


def _interrupted(signum: int, frame: object) -> None:
    raise GridInterrupted(f"signal {signum}")
