"""One context per message on a node (client/message_context.py): the run config, the method's
options, the ``dp.*`` options and the node's policy are each parsed once per message, on the
ClientApp's own path (its mods, fault injection, the node's limits and memory budget, its data,
the learner, differential privacy), and the memory plan and label flipping reach the fit as its
arguments."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from promptfcl.client.node_data import export_digits
from promptfcl.client.node_policy import NodePolicy
from promptfcl.common.config.experiment import ExperimentConfig
from promptfcl.common.model.prompted import initial_trainable_state
from promptfcl.common.model.runtime import model_spec
from promptfcl.common.node.memory_plan import resident_mb
from promptfcl.common.privacy import PrivacyOptions
from promptfcl.common.records import to_array_record
from promptfcl.strategies.fppl.options import FPPLOptions
from promptfcl.strategies.registry import prompt_class
from tests.conftest import tiny_config
from tests.helpers import client_app

CLASS_NAMES = ",".join(map(str, range(10)))


@pytest.fixture
def parses(monkeypatch) -> Counter:
    """How often each parse ran: the real parsers, counted (each still does its work)."""
    counted: Counter = Counter()

    def count(owner: type, name: str, label: str) -> None:
        real = getattr(owner, name)  # bound to ``owner``

        def counting(*args: Any, **kwargs: Any) -> Any:
            counted[label] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, staticmethod(counting))

    count(ExperimentConfig, "from_run_config", "run config")
    count(NodePolicy, "from_node_config", "node policy")
    count(FPPLOptions, "from_options", "method options")
    count(PrivacyOptions, "from_options", "dp options")
    return counted


def message(cfg: ExperimentConfig, kind: str, **config: Any) -> Message:
    """A message of ``cfg``'s first task for client 0 with the method's initial arrays."""
    arrays = initial_trainable_state(model_spec(cfg, cfg.data.num_classes), prompt_class(cfg.run.strategy))
    return Message(content=RecordDict({
        "arrays": to_array_record(arrays),
        "config": ConfigRecord({"task": 0, "round": 0, "client-id": 0, "config-digest": cfg.digest(), **config})}),
        dst_node_id=1, message_type=kind)


def test_a_message_parses_its_run_config_options_and_node_policy_once(tmp_path, monkeypatch, flower_identity,
                                                                         parses):
    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path / "cache"))
    (node,) = export_digits(tmp_path / "site", 1)
    # every part that reads one of them: a fault the mod decides on (client 2's, not this one's),
    # differential privacy (the client's run check, the upload), a memory budget (the node's check
    # and its plan), the node's own data, evaluation with training
    cfg = tiny_config(strategy="fppl", population="nodes", fault="nan",
                      **{"num-clients": 3, "clients-per-round": 3, "num-classes": 10, "class-names": CLASS_NAMES,
                         "fault-clients": "2", "dp.clip": 1.0, "dp.noise-multiplier": 0.5})
    node_config = {"data-dir": str(node), "fault-injection": True, "memory-budget-mb": resident_mb() + 6000}
    app = client_app(operated=False)
    for kind, config in ((MessageType.TRAIN, {"num-classes": 10, "evaluate-task": 0}),
                         (MessageType.EVALUATE, {"num-classes": 10})):
        parses.clear()
        ctx = Context(run_id=1, node_id=1, node_config=dict(node_config), state=RecordDict(),
                      run_config=cfg.to_dict())
        reply = app(message(cfg, kind, **config), ctx)
        assert not reply.has_error(), reply.error
        assert reply.content["metrics"]["num-examples"] > 0
        if kind == MessageType.TRAIN:  # the parts above did run: DP's, the budget's, the evaluation's
            assert "evaluation" in reply.content and reply.content["metrics"]["memory-budget-mb"] > 0
            assert reply.content["metrics"]["startup-context-seconds"] >= 0
        assert dict(parses) == {"run config": 1, "node policy": 1, "method options": 1, "dp options": 1}, kind
