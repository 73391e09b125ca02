"""Shared test helpers: tiny configurations that run in seconds on 2 CPU cores."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from promptfcl.common.config.experiment import ExperimentConfig  # noqa: E402

#: the hostile-client defences off, as in any simulation without fault injection (common/config/trust.py),
#: said explicitly by tests of averaging itself, whose expected values are plain weighted means
PLAIN_MEAN: dict[str, Any] = {"defences": "off"}

#: the files that take longest (per-file totals of ``pytest --durations``, issue 56), longest
#: first: with ``--dist loadfile --no-loadscope-reorder`` (Makefile) the two workers take them
#: first and the many short files fill in after, instead of a long file starting last
#: (pytest-xdist's own order is by number of tests, which put the few-test long ones at the end)
LONGEST_FILES = (
    "test_deploy_methods.py", "test_deploy.py", "test_async_resume.py", "test_bench.py", "test_reliability.py", "test_warm_executor.py",
    "test_powder.py", "test_ray_cluster.py", "test_edge_deploy.py", "test_memory_bounds.py",
    "test_node_replies.py", "test_simulation_e2e.py", "test_hostile.py", "test_layers.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first (stable: every file keeps its own order of tests)."""
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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


@pytest.fixture(scope="session")
def fedavg_run(tmp_path_factory) -> tuple[dict[str, Any], Path]:
    """The tiny FedAvg run on a local single-node Ray (``promptfcl simulate``, 2 tasks x 2 rounds,
    3 clients), once per suite: test_simulation_e2e checks it, test_ray_cluster compares its
    cluster runs with it. Under pytest-xdist the workers share it through their common temp
    folder; the first to ask runs it while the other waits on the lock."""
    import json
    import shutil

    from filelock import FileLock

    from tests.helpers import simulate

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's folder, above each worker's own
    out = shared / "fedavg-ray-run"
    with FileLock(str(shared / "fedavg-ray-run.lock")):
        if (out / "results.json").is_file():
            return json.loads((out / "results.json").read_text()), out
        if out.exists():  # a run that failed in another worker: start afresh
            shutil.rmtree(out)
        return simulate(out, lr=0.01), out
