"""Memory that holds: the ServerApp's own peak for a round, and a node's budget over a whole message.

Both run in fresh interpreters (``python -m tests.test_memory_bounds ...``), so a process's peak
resident memory (the kernel's VmHWM) is its own: the ServerApp's loop with its nodes in forked
worker processes whose messages cross as Flower's wire objects (tests/wire_grid.py), and a node's
message process handed a train message as its SuperNode would pull it. The prompts are large
(CODA-P pools of 510 components of 128 or 256 tokens at width 96, 75-150 MB) so that what the
code copies, not the interpreter, makes the figures.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from promptfcl.common.model.runtime import backbone_of, model_spec
from promptfcl.common.node.memory_plan import proc_status_kb

REPO = Path(__file__).resolve().parents[1]
#: a tiny backbone (96 wide, 3 blocks, 16 px) under large prompts: the pool is the run's memory
LARGE_PROMPTS: dict[str, Any] = {
    "dataset": "digits", "embed-dim": 96, "depth": 3, "num-heads": 2, "image-size": 16, "patch-size": 4,
    "prompt-layers": "0,1,2", "pool-size": 510, "prompt-length": 256, "num-tasks": 2, "rounds-per-task": 1,
    "num-clients": 3, "clients-per-round": 3, "batch-size": 32, "local-epochs": 1, "weights": "random",
    "max-train-per-class": 40,
    "query-cache-disk": "off",
    # a task's slice drawn at random, not Gram-Schmidt'ed row by row against the earlier slices
    # (a Python loop over 510 rows of 128 x 96: most of this file's minutes); what is measured is
    # the round's copies of the state, which the initialisation does not change
    "ortho-init": False,
}


def child(*args: str, timeout: int = 1500) -> dict[str, Any]:
    """Run this module's ``main`` in a fresh interpreter; its last stdout line, read as JSON."""
    done = subprocess.run([sys.executable, "-m", "tests.test_memory_bounds", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def mb(field: str) -> float:
    """A /proc/self/status figure in MB (10^6 bytes, as the plan's and the replies' figures)."""
    return proc_status_kb(field) * 1024 / 1e6


# ---------------------------------------------------------------------------- the ServerApp
@pytest.mark.simulation
@pytest.mark.slow
def test_the_serverapps_peak_for_a_round_stays_within_clients_plus_4_trainable_states(tmp_path):
    figures = child("server", str(tmp_path / "out"), json.dumps({"prompt-length": 128}))
    trainable, bound = figures["trainable_mb"], figures["clients_per_round"] + 4
    assert trainable > 70  # the prompts, not the interpreter, make the figure
    assert len(figures["rounds"]) == 2  # a task's first round, and the next task's (its slice initialised)
    for peak in figures["rounds"]:
        # before this change a round peaked at 26 x the trainable state above idle (a float64 copy of
        # every reply for the norms, their stack for the median cosine, Array.numpy() at every read)
        assert peak - figures["idle_mb"] <= bound * trainable, figures


def serve(out: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The child: a run's rounds with the ServerApp's loop in this process; each round's peak."""
    from promptfcl.server import run as server_run
    from promptfcl.strategies.platform.run_checks import load_config
    from tests.conftest import flower_task_identity
    from tests.wire_grid import WireGrid

    settings = {**LARGE_PROMPTS, **overrides}
    cfg = load_config(None, [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in settings.items()],
                      "fedavg", out)
    peaks: list[float] = []
    real = server_run.ExperimentRun.run_round

    def measured(self: Any, index: int) -> Any:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here: this round's peak
        record = real(self, index)
        peaks.append(mb("VmHWM"))
        return record

    with flower_task_identity():
        grid = WireGrid(cfg, cfg.federation.clients_per_round)
        try:
            run = server_run.ExperimentRun(grid, cfg)  # type: ignore[arg-type]
            trainable = sum(len(run.arrays[k].data) for k in run.arrays.keys()) / 1e6
            gc.collect()
            idle = mb("VmRSS")
            server_run.ExperimentRun.run_round = measured  # type: ignore[method-assign]
            run.run()
        finally:
            grid.close()
    return {"trainable_mb": trainable, "idle_mb": idle, "rounds": peaks, "clients_per_round": cfg.federation.clients_per_round}


# ---------------------------------------------------------------------------- a node's budget
@pytest.mark.simulation
@pytest.mark.slow
def test_a_node_with_a_budget_trains_the_150_mb_prompt_run_within_it_or_refuses_it(tmp_path, monkeypatch):
    from promptfcl.common.config.experiment import ExperimentConfig
    from promptfcl.common.model.backbone import build_backbone

    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path / "cache"))  # the node's cache: its backbone built once
    build_backbone(backbone_of(ExperimentConfig.from_dict(LARGE_PROMPTS)))
    message = tmp_path / "message.pkl"
    message.write_bytes(pickle.dumps(train_message()))
    replies = {budget: child("node", str(message), str(budget)) for budget in (1400, 1900)}
    for budget, reply in replies.items():
        if reply["error"]:  # refused before training: the reason names the setting and what is needed
            assert f"memory-budget-mb = {budget} is too small" in reply["error"], reply
            assert "the round adds" in reply["error"]
            assert reply["peak_mb"] <= budget  # refused before anything outgrew it
            continue
        metrics = reply["metrics"]
        assert metrics["memory-budget-mb"] == budget
        assert "over-budget-mb" not in metrics and metrics["peak-rss-mb"] <= budget, reply
        assert reply["peak_mb"] <= budget  # the process's whole peak, the reply's encoding included
    # the tight budget cannot hold the trainable state four times over beside the process: refused
    # (the loop's own 1400 MB reply; a second child for the same budget repeated it)
    assert replies[1400]["error"]


def train_message() -> tuple[str, dict[str, bytes], dict[str, Any]]:
    """Round 1's train message of the 150 MB-prompt run as a SuperNode pulls it (its objects' bytes),
    and the run config."""
    from flwr.app import ConfigRecord

    from promptfcl.common.config.experiment import ExperimentConfig
    from promptfcl.common.model.prompted import initial_trainable_state
    from promptfcl.common.records import to_array_record
    from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
    from tests.conftest import flower_task_identity
    from tests.helpers import NodeList
    from tests.wire_grid import to_wire

    cfg = ExperimentConfig.from_dict({**LARGE_PROMPTS, "num-clients": 1, "clients-per-round": 1})
    strategy = FedAvgStrategy.of(cfg, 10)
    with flower_task_identity():
        arrays = strategy.on_task_start(0, to_array_record(initial_trainable_state(model_spec(cfg, 10),
                                                                                  strategy.prompt_class)))
        (msg,) = strategy.configure_train(1, arrays, ConfigRecord({"task": 0, "round": 0, "attempt": 0}),
                                          NodeList(1))  # type: ignore[arg-type]
        object_id, contents = to_wire(msg)
    return object_id, contents, cfg.to_dict()


def node(message: str, budget: float) -> dict[str, Any]:
    """The child: one node's message process given the pulled train message; its reply and peak."""
    from flwr.app import Context, RecordDict

    from promptfcl.common.records import METRICS
    from tests.helpers import client_app
    from tests.wire_grid import from_wire

    with open(message, "rb") as fh:  # read object by object, as a SuperNode's pull gets them
        object_id, contents, run_config = pickle.load(fh)
    msg = from_wire(object_id, contents)
    del contents
    context = Context(run_id=1, node_id=msg.metadata.dst_node_id, node_config={"memory-budget-mb": budget},
                      state=RecordDict(), run_config=run_config)
    try:
        reply = client_app()(msg, context)
    except Exception as exc:  # what Flower turns into an error reply
        return {"error": f"{type(exc).__name__}: {exc}", "peak_mb": mb("VmHWM")}
    if reply.has_error():
        return {"error": reply.error.reason, "peak_mb": mb("VmHWM")}
    return {"error": None, "metrics": dict(reply.content.metric_records[METRICS]), "peak_mb": mb("VmHWM")}


if __name__ == "__main__":
    what, *rest = sys.argv[1:]
    if what == "server":
        print(json.dumps(serve(rest[0], json.loads(rest[1]) if len(rest) > 1 else {})))
    else:
        from tests.conftest import flower_task_identity

        with flower_task_identity():
            print(json.dumps(node(rest[0], float(rest[1]))))
