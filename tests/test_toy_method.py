"""A method is one folder: a seventh, toy method written from hooks alone, outside the repository.

The toy method lives in a temporary folder as its own package (``__init__.py`` with ``METHOD``,
``options.py``, ``prompt.py``, ``strategy.py``, ``learner.py``), registered the way another
distribution would register it (an entry point in the ``promptfcl.methods`` group), and runs a
whole federation through the real server loop, platform and ClientApp. Nothing of the project
changes for it: the registry finds it, the platform checks its replies and weighs them, its
options reach both sides parsed, its records travel and its state is checkpointed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

FILES = {
    "__init__.py": '''
        """Toy: FedAvg-Prompt plus a proximal pull of the head, and a record of what each client trained on."""
        from promptfcl.strategies.registry import Method

        METHOD = Method("toy", strategy=".strategy:ToyStrategy", learner=".learner:ToyLearner", prompt=".prompt:ToyPrompt",
                        options=".options:ToyOptions", statistics=".records:STATISTICS")
    ''',
    "records.py": '''
        from promptfcl.strategies.platform.statistics import Statistics

        #: what the toy's replies carry besides the model: bounded by the platform where the run is defended
        STATISTICS = {"toy-stats": Statistics(vectors=("mu",))}
    ''',
    "options.py": '''
        from dataclasses import dataclass
        from typing import ClassVar

        from promptfcl.common.config.experiment import ConfigError
        from promptfcl.common.config.options import MethodOptions


        @dataclass(frozen=True)
        class ToyOptions(MethodOptions):
            prefix: ClassVar[str] = "toy"
            mu: float = 0.5
            shrink: float = 1.0  # the server scales the averaged head by this

            def validate(self) -> None:
                if self.mu < 0:
                    raise ConfigError("toy.mu must be >= 0")
    ''',
    "prompt.py": '''
        from promptfcl.common.model.prompted import CodaPrompt


        class ToyPrompt(CodaPrompt):
            """CODA-P as is."""
    ''',
    "learner.py": '''
        import numpy as np
        import torch

        from promptfcl.strategies.platform.learner import LocalLearner
        from promptfcl.common.records import to_array_record


        class ToyLearner(LocalLearner):
            def round_start(self, content, task):
                self.anchor = self.rt.model.head.weight.detach().clone()

            def extra_loss(self, batch, task):
                return 0.5 * self.opts.mu * ((self.rt.model.head.weight - self.anchor) ** 2).sum()

            def round_end(self, index, task):
                labels = self.rt.data.train.labels[index]
                return {"toy-stats": to_array_record({"mu": np.array([self.opts.mu], np.float32),
                                                      "classes": np.unique(labels).astype(np.int64)})}
    ''',
    "strategy.py": '''
        import numpy as np

        from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
        from promptfcl.strategies.platform.strategy import PromptStrategy


        class ToyStrategy(PromptStrategy):  # its name, module, options and statistics: METHOD's
            reply_records = frozenset({ARRAYS, METRICS, "toy-stats"})

            def setup(self):
                self.rounds = 0
                self.mus = []

            def check_records(self, reply, sent):
                stats = reply.content["toy-stats"]
                if set(stats.keys()) != {"mu", "classes"}:
                    return "toy-stats must hold mu and classes"
                classes = stats["classes"].numpy()
                if classes.size and (classes.min() < 0 or classes.max() >= self.num_classes):
                    return "toy-stats classes out of range"
                return None

            def consolidate(self, server_round, arrays, accepted):
                self.rounds += 1
                self.mus = [float(a.content["toy-stats"]["mu"].numpy()[0]) for a in accepted]
                state = from_array_record(arrays)
                state["head.weight"] = state["head.weight"] * np.float32(self.opts.shrink)
                return to_array_record(state)

            def round_metrics(self, accepted):
                return {"toy-rounds": self.rounds, "toy-mu": float(np.mean(self.mus)),
                        "toy-weight-of-first": accepted[0].weight}

            def state_dict(self):
                return {"rounds": self.rounds}

            def load_state_dict(self, state):
                self.rounds = int(state.get("rounds", 0))
    ''',
}


@pytest.fixture
def toy_method(tmp_path, monkeypatch):
    """The toy package and a distribution's entry point for it, importable from ``tmp_path``."""
    package = tmp_path / "toymethod"
    package.mkdir()
    for name, text in FILES.items():
        (package / name).write_text(textwrap.dedent(text).lstrip())
    info = tmp_path / "toymethod-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toymethod\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[promptfcl.methods]\ntoy = toymethod\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from promptfcl.strategies import registry

    registry.methods.cache_clear()
    yield tmp_path
    registry.methods.cache_clear()


@pytest.mark.e2e
def test_a_seventh_method_from_hooks_alone_runs_end_to_end(toy_method, tmp_path):
    from promptfcl.strategies.registry import learner_class, methods, strategy_class
    from tests.conftest import PLAIN_MEAN
    from tests.helpers import simulate_in_process

    assert "toy" in methods() and methods()["toy"].package == "toymethod"
    assert strategy_class("toy").__module__ == "toymethod.strategy"
    assert learner_class("toy").__module__ == "toymethod.learner"
    results = simulate_in_process(tmp_path / "run", "toy", **PLAIN_MEAN, **{"toy.mu": 0.25, "toy.shrink": 0.5,
                                                               "rounds-per-task": 2})
    rounds = results["rounds"]
    assert len(rounds) == 4 and all(r["clients_aggregated"] == 3 for r in rounds)
    # the option reached every client (its record) and the server (the round's figures)
    assert [r["strategy_metrics"]["toy-rounds"] for r in rounds] == [1, 2, 3, 4]
    assert all(r["strategy_metrics"]["toy-mu"] == 0.25 for r in rounds)
    assert results["config"]["toy.mu"] == 0.25
    # the platform weighed the replies (sample counts) and kept the round's shares
    assert all(abs(sum(r["reply_shares"]) - 1.0) < 1e-9 for r in rounds)
    assert results["defences"] == {"resolved": "off", "why": results["defences"]["why"]}  # as set: trusted
    matrix = results["accuracy_matrix"]
    assert matrix[0][0] is not None and matrix[1][1] is not None


@pytest.mark.e2e
def test_the_platform_checks_a_new_methods_records(toy_method, tmp_path, flower_identity):
    """A client whose toy record is malformed is left out by the toy's own check, under its node."""
    from flwr.app import MessageType

    from promptfcl.common.records import to_array_record
    from promptfcl.strategies.platform.run_checks import load_config
    from tests.helpers import client_app, run_in_process

    def forge(msg, context, call_next):
        reply = call_next(msg, context)
        if msg.metadata.message_type == MessageType.TRAIN and not reply.has_error():
            reply.content["toy-stats"] = to_array_record({"mu": [1.0], "classes": [10**6]})
        return reply

    cfg = load_config(None, ["num-clients=3", "clients-per-round=3", "num-tasks=1", "local-epochs=1", "batch-size=32",
                             "embed-dim=48", "depth=2", "num-heads=2", "image-size=16", "patch-size=4", "pool-size=2",
                             'prompt-layers="0,1"', "prompt-length=4", "threads=1", 'weights="random"',
                             f'out-dir="{tmp_path / "forged"}"'], "toy", None)
    results = run_in_process(cfg, nodes=3, apps={1003: client_app([forge])})
    record = results["rounds"][0]
    assert [(x["node"], x["reason"]) for x in record["rejected"]] == [(1003, "toy-stats classes out of range")]
    assert record["clients_aggregated"] == 2


def test_a_method_found_by_entry_point_is_listed_in_a_fresh_process(toy_method):
    """``promptfcl strategies`` in a new interpreter finds the toy through the installed metadata."""
    import os

    env = {**os.environ, "PYTHONPATH": f"{toy_method}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "promptfcl.server.cli", "strategies"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["c2prompt", "fedavg", "fedcprompt", "fppl", "hepco", "hgp", "lorm", "pilora", "powder",
                                   "toy"]


def test_a_new_methods_statistics_are_bounded_by_the_platform(toy_method, flower_identity):
    """The toy method declares its record and does nothing else: in a defended run a forged value
    (x20) reaches its server step cut to stats-bound x the round's lower median; undefended, as sent."""
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from promptfcl.common.records import ARRAYS, METRICS, to_array_record
    from promptfcl.strategies.registry import strategy_class
    from tests.conftest import tiny_config
    from tests.helpers import NodeList

    seen = {}
    for defences in ("on", "off"):
        cfg = tiny_config(num_clients=4, clients_per_round=4, defences=defences, strategy="toy")
        strategy = strategy_class("toy").of(cfg, 10)
        head = to_array_record({"head.weight": np.zeros((10, 48), np.float32)})
        msgs = list(strategy.configure_train(1, head, ConfigRecord({"task": 0, "round": 0}), NodeList(4)))
        replies = [Message(RecordDict({ARRAYS: head, "toy-stats": to_array_record(
            {"mu": np.array([mu], np.float32), "classes": np.zeros(0, np.int64)}),
            METRICS: MetricRecord({"num-examples": 10, "train-loss": 1.0, "train-seconds": 0.1})}), reply_to=m)
            for mu, m in zip([0.25, 0.25, 0.3, 5.0], msgs)]
        strategy.aggregate_train(1, replies)
        seen[defences] = strategy.mus
    assert seen["off"] == pytest.approx([0.25, 0.25, 0.3, 5.0])
    assert seen["on"] == pytest.approx([0.25, 0.25, 0.3, 1.0])  # stats-bound 4 x the lower median 0.25
