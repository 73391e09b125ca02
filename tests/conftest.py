"""Shared test helpers: tiny configurations that run in seconds on 2 CPU cores."""

from __future__ import annotations

import os
from typing import Any

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from common.config import ExperimentConfig  # noqa: E402

TINY: dict[str, Any] = {
    "dataset": "digits",
    "num-tasks": 2,
    "rounds-per-task": 1,
    "num-clients": 3,
    "clients-per-round": 2,
    "local-epochs": 1,
    "batch-size": 32,
    "embed-dim": 48,
    "depth": 2,
    "num-heads": 2,
    "image-size": 16,
    "patch-size": 4,
    "pool-size": 4,
    "prompt-layers": "0,1",
    "prompt-length": 4,
    "threads": 1,
    "weights": "random",
}


def tiny_config(**overrides: Any) -> ExperimentConfig:
    """A configuration small enough for unit tests; keys in kebab-case or snake_case."""
    raw = dict(TINY)
    raw.update({k.replace("_", "-") if "." not in k else k: v for k, v in overrides.items()})
    return ExperimentConfig.from_dict(raw)


@pytest.fixture
def tiny() -> ExperimentConfig:
    return tiny_config()
