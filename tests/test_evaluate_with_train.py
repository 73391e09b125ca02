"""evaluate-with-train: a round's federated evaluation carried by the next round's train
messages (server/evaluation.py ``CarriedEvaluation``). The accuracies must be exactly those of
evaluate messages, training must not notice, and a node that drops or forges the carried
counts costs only its own counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from promptfcl.common.records import EVALUATION
from tests.conftest import tiny_config
from tests.helpers import InProcessGrid, client_app

NODES = (1001, 1002, 1003)


def run_nodes(out: Path, apps: dict[int, ClientApp] | None = None, **overrides: Any) -> tuple[dict, InProcessGrid]:
    """A deployment-shaped run in this process: 3 nodes, each its own partition, federated evaluation."""
    from promptfcl.server.run import run_experiment

    cfg = tiny_config(**{"population": "nodes", "evaluation": "federated", "num-classes": 10, "num-clients": 3,
                         "rounds-per-task": 3, "out-dir": str(out), **overrides})
    grid = InProcessGrid(cfg, len(NODES), apps,
                         node_configs={n: {"partition-id": i, "num-partitions": 3} for i, n in enumerate(NODES)})
    return run_experiment(grid, cfg), grid  # type: ignore[arg-type]


def evaluate_messages(grid: InProcessGrid) -> int:
    return sum(m.metadata.message_type == "evaluate" for m in grid.sent)


def test_carried_evaluation_equals_evaluate_messages(tmp_path, flower_identity):
    """2 of 3 nodes per round: within a task, the sampled nodes' counts come with training and
    only the third node gets a message; every round's accuracies, losses and the matrix are
    those of the run with a message per node, with a third of its evaluate messages."""
    carried, carried_grid = run_nodes(tmp_path / "carried", **{"clients-per-round": 2})
    messages, messages_grid = run_nodes(tmp_path / "messages", **{"clients-per-round": 2,
                                                                  "evaluate-with-train": False})
    assert carried["accuracy_matrix"] == messages["accuracy_matrix"]
    for with_train, alone in zip(carried["rounds"], messages["rounds"], strict=True):
        assert with_train["task_accuracies"] == alone["task_accuracies"]
        assert with_train["train_loss"] == alone["train_loss"]  # evaluating first leaves training as it was
        assert with_train["eval_nodes"] == alone["eval_nodes"] == 3
        assert "eval_pending" not in with_train
    # rounds 1, 2 of each task: carried by 2 nodes; task ends (3, 6) by messages to all 3
    assert [r["eval_carried"] for r in carried["rounds"]] == [2, 2, 0, 2, 2, 0]
    assert evaluate_messages(messages_grid) == 6 * 3
    assert evaluate_messages(carried_grid) == 4 * 1 + 2 * 3
    asked = [m for m in carried_grid.sent if m.metadata.message_type == "train" and "evaluate-task" in m.content["config"]]
    assert len(asked) == 4 * 2 and all(m.content["config"]["evaluate-task"] == m.content["config"]["task"] for m in asked)


def tamper(how: str) -> ClientApp:
    """The project's ClientApp on a node that drops or forges the counts its train reply carries."""

    def mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        if reply.has_error() or EVALUATION not in reply.content.metric_records:
            return reply
        if how == "drop":
            del reply.content[EVALUATION]
        else:
            reply.content[EVALUATION]["correct"] = [10**6 for _ in reply.content[EVALUATION]["correct"]]
        return reply

    return client_app([mod])


def test_dropped_or_forged_carried_counts_cost_only_that_node(tmp_path, flower_identity, caplog):
    """Node 1001 forges its carried counts: left out of the round's evaluation, logged, the run
    goes on. Node 1002 drops them: it gets an evaluate message, so its counts still count."""
    results, grid = run_nodes(tmp_path / "hostile", apps={1001: tamper("forge"), 1002: tamper("drop")},
                              **{"clients-per-round": 3, "num-tasks": 2})
    carried_rounds = [r for r in results["rounds"] if r["round"] < 2]
    for r in carried_rounds:
        assert r["eval_carried"] == 1 and r["eval_nodes"] == 2  # 1003 carried, 1002 by message
        assert [f["node"] for f in r["eval_failed"]] == [1001]
        assert "correct > total" in r["eval_failed"][0]["reason"]
    dropped = [m for m in grid.sent if m.metadata.message_type == "evaluate" and m.metadata.dst_node_id == 1002]
    assert len(dropped) == len(results["rounds"])  # every round: carried rounds by message, task ends too
    assert "evaluation on node 1001 left out" in caplog.text
    assert results["final_average_accuracy"] is not None


def test_an_evaluation_the_node_cannot_do_never_costs_its_update(flower_identity, caplog):
    """A bad ``evaluate-task`` (or any failure while evaluating): logged, no counts, and the
    train reply goes back as it would without the request."""
    import numpy as np
    from flwr.app import ConfigRecord, RecordDict

    from promptfcl.client.app import evaluate_received
    from promptfcl.common.records import to_array_record

    cfg = tiny_config()
    content = RecordDict({"arrays": to_array_record({"x": np.zeros(1)}), "config": ConfigRecord({"evaluate-task": 7})})
    assert evaluate_received(None, content, cfg.data.num_tasks, False) is None  # type: ignore[arg-type]  (refused before the runtime)
    assert "evaluate-task 7 names no task" in caplog.text


def unasked_counts() -> ClientApp:
    """A node that sends an ``evaluation`` record with every train reply, asked or not."""
    from flwr.app import MetricRecord

    def mod(msg: Message, context: Context, call_next) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type == "train" and not reply.has_error():
            reply.content[EVALUATION] = MetricRecord({"correct": [1], "total": [1], "num-examples": 1})
        return reply

    return client_app([mod])


def test_counts_a_message_did_not_ask_for_reject_the_reply(tmp_path, flower_identity):
    results, _ = run_nodes(tmp_path / "unasked", apps={1001: unasked_counts()}, **{"clients-per-round": 3})
    first = results["rounds"][0]  # nothing to carry yet: node 1001's record was not asked for
    assert [(r["node"], "did not ask for" in r["reason"]) for r in first["rejected"]] == [(1001, True)]
    assert first["clients_aggregated"] == 2


class StopsAtTrainMessage(InProcessGrid):
    """A server machine that goes down as it sends its ``n``-th train message."""

    def __init__(self, *args: Any, n: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.left = n

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == "train":
                self.left -= 1
                if self.left == 0:
                    raise KeyboardInterrupt("the server stopped")
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.e2e
def test_a_round_awaiting_its_carried_evaluation_survives_a_restart(tmp_path, flower_identity):
    """The server stops while sending round 2: round 1's checkpoint still waits for its counts.
    Resumed, round 2's train messages carry them and every accuracy equals the unbroken run's."""
    from promptfcl.server.run import run_experiment

    whole, _ = run_nodes(tmp_path / "whole", **{"clients-per-round": 3})
    out = tmp_path / "stopped"
    cfg = tiny_config(**{"population": "nodes", "evaluation": "federated", "num-classes": 10, "num-clients": 3,
                         "clients-per-round": 3, "rounds-per-task": 3, "out-dir": str(out)})
    node_configs = {n: {"partition-id": i, "num-partitions": 3} for i, n in enumerate(NODES)}
    with pytest.raises(KeyboardInterrupt):
        run_experiment(StopsAtTrainMessage(cfg, 3, node_configs=node_configs, n=4), cfg)  # type: ignore[arg-type]
    from promptfcl.server import checkpoint

    saved = checkpoint.load(str(out))
    assert saved.server_round == 1 and saved.rounds[0]["eval_pending"] and saved.rounds[0]["accuracy"] is None
    # a copy resumed with max-rounds = 1: no round left to carry it, so evaluate messages complete it
    import shutil

    shutil.copytree(out, tmp_path / "copy")
    at_one = cfg.replace(resume=True, max_rounds=1, out_dir=str(tmp_path / "copy"))
    stopped = run_experiment(InProcessGrid(at_one, 3, node_configs=node_configs), at_one)  # type: ignore[arg-type]
    assert stopped["rounds"][0]["task_accuracies"] == whole["rounds"][0]["task_accuracies"]
    assert "eval_pending" not in stopped["rounds"][0] and stopped["rounds"][0]["eval_carried"] == 0
    assert "eval_pending" not in checkpoint.load(str(tmp_path / "copy")).rounds[0]
    resumed_cfg = cfg.replace(resume=True)
    grid = InProcessGrid(resumed_cfg, 3, node_configs=node_configs)
    resumed = run_experiment(grid, resumed_cfg)  # type: ignore[arg-type]
    assert [r["task_accuracies"] for r in resumed["rounds"]] == [r["task_accuracies"] for r in whole["rounds"]]
    assert resumed["rounds"][0]["eval_carried"] == 3  # carried by the resumed round 2's training
    assert resumed["accuracy_matrix"] == whole["accuracy_matrix"]
