"""Checkpoints: the whole server state after every round, written atomically.

A checkpoint holds the global parameters, the schedule position (task, round,
server round), the strategy's state, the results so far and the random states.
Clients are stateless given (seed, client id, task, round) and the global
parameters, so a resumed run replays exactly what the uninterrupted run would.

Files are written to a temporary name, flushed, fsynced and renamed, so a crash
while writing leaves the previous checkpoint intact.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.files import write_atomic

import numpy as np
import torch

from common.config import RESULT_NEUTRAL_KEYS, ConfigError, ExperimentConfig

FILENAME = "checkpoint.pkl"
FORMAT_VERSION = 1


@dataclass
class Checkpoint:
    config: dict[str, Any]
    task: int  # task of the last completed round
    round: int  # round (within the task) of the last completed round
    server_round: int
    task_finished: bool  # on_task_end has run for ``task``
    arrays: dict[str, np.ndarray]
    strategy_state: dict[str, Any]
    accuracy_matrix: np.ndarray
    rounds: list[dict[str, Any]]
    rng: dict[str, Any]
    elapsed_seconds: float
    platform_state: dict[str, Any] = field(default_factory=dict)  # e.g. the nodes' declared data sizes


def capture_rng() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.random.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["torch"])


def save(ckpt: Checkpoint, out_dir: str | Path) -> Path:
    """Atomically replace ``out_dir/checkpoint.pkl``."""
    path = Path(out_dir) / FILENAME
    write_atomic(path, lambda fh: pickle.dump({"version": FORMAT_VERSION, "checkpoint": ckpt}, fh,
                                              protocol=pickle.HIGHEST_PROTOCOL))
    return path



def load(out_dir: str | Path) -> Checkpoint | None:
    """The checkpoint in ``out_dir``, None if there is none; a clear error if it is unreadable."""
    path = Path(out_dir) / FILENAME
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as fh:
            doc = pickle.load(fh)
        if doc.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {doc.get('version')} (expected {FORMAT_VERSION})")
        ckpt = doc["checkpoint"]
        if not isinstance(ckpt, Checkpoint):
            raise ValueError("not a promptfcl checkpoint")
        return ckpt
    except Exception as exc:
        raise ConfigError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {exc}); "
                          "move it away to start afresh") from exc


def check_compatible(ckpt: Checkpoint, cfg: ExperimentConfig) -> None:
    """Refuse to resume under a configuration that would change the results."""
    try:  # keys added since the checkpoint was written take their defaults, as then
        filled = ExperimentConfig.from_dict(ckpt.config).to_dict()
    except ConfigError:
        filled = ckpt.config
    saved = {k: v for k, v in filled.items() if k not in RESULT_NEUTRAL_KEYS}
    now = {k: v for k, v in cfg.to_dict().items() if k not in RESULT_NEUTRAL_KEYS}
    if saved != now:
        diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        details = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in diff[:6])
        raise ConfigError(f"cannot resume: the checkpoint was made with a different configuration ({details})")
