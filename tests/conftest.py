"""Shared test helpers: tiny configurations that run in seconds on 2 CPU cores."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from promptfcl.common.config import ExperimentConfig  # noqa: E402

#: the hostile-client defences off, as in any simulation without fault injection (common/trust.py),
#: said explicitly by tests of averaging itself, whose expected values are plain weighted means
PLAIN_MEAN: dict[str, Any] = {"defences": "off"}

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
    if "pool-size" not in {k.replace("_", "-") for k in overrides}:
        raw["pool-size"] = 2 * int(raw["num-tasks"])  # two components per task
    return ExperimentConfig.from_dict(raw)


@pytest.fixture
def tiny() -> ExperimentConfig:
    return tiny_config()


@contextlib.contextmanager
def flower_task_identity():
    """Flower's process identity, which building Message objects outside a run needs."""
    from promptfcl.common.flower_internals import internal

    TaskIdentity = internal("task_identity")

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


@pytest.fixture
def flower_identity():
    with flower_task_identity():
        yield


def reply_from(node_id: int, content=None, error: str | None = None):
    """A reply Message as a client on ``node_id`` would send it."""
    from flwr.app import Error, Message, RecordDict

    request = Message(content=RecordDict(), dst_node_id=node_id, message_type="train")
    if error is not None:
        return Message(Error(code=0, reason=error), reply_to=request)
    return Message(content=content, reply_to=request)
