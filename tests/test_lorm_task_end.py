"""LoRM's task-end Gram pass (``lorm.task-grams = "task-end-pass"``, issue 58 item 9) through the
platform's task-end exchange (strategies/platform/exchange.py): the task merge uses exactly the
Grams the clients computed through the server's final set and head, the accuracy column reads the
merged model, a run resumed between a task's last round and its merge ends as the uninterrupted
one, and the default sends nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from promptfcl.common.data.partitions import client_indices
from promptfcl.common.model.runtime import get_runtime
from promptfcl.common.records import arrays_of, from_array_record, to_array_record, to_torch
from promptfcl.server import run as server_run
from promptfcl.server.evaluation import CentralEvaluator
from promptfcl.strategies.lorm.learner import TASK_END_STREAM, LoRMLearner
from promptfcl.strategies.lorm.prompt import LoRMAdapters
from promptfcl.strategies.lorm.records import GRAMS, SAMPLES, diagonal_name
from promptfcl.strategies.lorm.strategy import LoRMStrategy
from promptfcl.strategies.platform.checks import HeldSamples
from promptfcl.strategies.platform.run_checks import load_config
from tests.conftest import PLAIN_MEAN, TINY
from tests.helpers import simulate_in_process as simulate

#: 4 clients, 2 a round, 2 rounds a task: the task-end pass asks the clients some round of the task
#: accepted, which need not be all 4; augmented views, so the pass's own view stream matters
SETTINGS = {**PLAIN_MEAN, "lr": 0.01, "num-clients": 4, "clients-per-round": 2, "rounds-per-task": 2,
            "augment": "crop-flip"}
PASS = {"lorm.task-grams": "task-end-pass"}


@pytest.mark.simulation
def test_the_task_merge_uses_the_grams_of_the_task_end_pass_and_the_matrix_reads_the_merge(tmp_path, monkeypatch):
    events: list[tuple] = []
    use_exchange, on_task_end = LoRMStrategy.use_exchange, LoRMStrategy.on_task_end
    evaluate = CentralEvaluator.__call__

    def spy_use(self, server_round, answers):
        events.append(("pass", self.task, from_array_record(self.round_arrays),
                       [(a.client, a.weight, from_array_record(arrays_of(a.content, GRAMS))) for a in answers],
                       sorted(a.client for a in answers), {k: v.copy() for k, v in self.round_grams.items()}))
        use_exchange(self, server_round, answers)

    def spy_end(self, task, arrays):
        grams = {k: v.copy() for k, v in self.round_grams.items()}
        out = on_task_end(self, task, arrays)
        events.append(("merge", task, grams, out))
        return out

    def spy_evaluate(self, arrays, task):
        events.append(("evaluate", task, arrays))
        return evaluate(self, arrays, task)

    monkeypatch.setattr(LoRMStrategy, "use_exchange", spy_use)
    monkeypatch.setattr(LoRMStrategy, "on_task_end", spy_end)
    monkeypatch.setattr(CentralEvaluator, "__call__", spy_evaluate)
    results = simulate(tmp_path / "pass", strategy="lorm", **SETTINGS, **PASS)

    settings = {**TINY, **SETTINGS, **PASS}  # simulate_in_process's configuration
    cfg = load_config(None, [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in settings.items()],
                      "lorm", str(tmp_path / "x"))
    rt = get_runtime(cfg, LoRMAdapters)
    learner = LoRMLearner.of(cfg, rt, cfg.method_options("lorm"))
    rows = {layer: i for i, layer in enumerate(cfg.model.layers)}
    last_round = cfg.federation.rounds_per_task - 1
    for task in range(cfg.data.num_tasks):
        kinds = [e[0] for e in events if e[1] == task and e[0] != "evaluate"]
        assert kinds == ["pass", "merge"]
        _, _, sent, answers, clients, last_round_grams = next(e for e in events if e[0] == "pass" and e[1] == task)
        _, _, used, merged = next(e for e in events if e[0] == "merge" and e[1] == task)
        # the pass goes to every client a round of the task accepted, and each answers
        trained = {c for r in results["rounds"] if r["task"] == task for c in r["reply_clients"]}
        assert clients == sorted(trained)
        record = results["rounds"][task * cfg.federation.rounds_per_task + last_round]["task_end_exchange"]
        assert record["clients"] == record["answers"] == len(trained) and not record["rejected"]
        # an independent pass of each client's samples through the arrays the server sent (its final set)
        rt.model.load_trainable_state(to_torch(to_array_record(sent)))
        rt.model.prompt.set_task(task)
        expected: dict[str, np.ndarray] = {}
        for client, weight, grams in answers:
            index = client_indices(rt.data.train.labels, rt.layout, rt.partition, client, task, last_round)
            assert weight == len(index) == int(grams[SAMPLES][0])
            learner.seed = [cfg.run.seed, client, task, last_round]
            sums, _, _ = learner.gram_pass(index, stream=TASK_END_STREAM)
            for key, layer, target in LoRMStrategy.adapters(sent):
                mine = sums[(layer, target)].numpy()
                np.testing.assert_allclose(grams[diagonal_name(target)][rows[layer]] * len(index), mine, rtol=1e-5)
                expected[key] = expected.get(key, 0) + weight * grams[diagonal_name(target)][rows[layer]].astype(
                    np.float64)
        assert set(used) == set(expected)
        for key in expected:  # the merge used exactly these sums
            np.testing.assert_array_equal(used[key], expected[key])
        # and they are not the last round's (the clients' last local update, their own views)
        assert set(last_round_grams) == set(expected)
        assert not all(np.allclose(last_round_grams[k], expected[k], rtol=1e-3) for k in expected)
        # the task's accuracy column is read from the merged arrays, after the merge
        after = events[events.index(next(e for e in events if e[0] == "merge" and e[1] == task)) + 1]
        assert after[0] == "evaluate" and after[1] == task and after[2] is merged


@pytest.mark.simulation
def test_a_run_resumed_between_the_last_round_and_the_merge_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    """And the default (``last-round``) sends no task-end exchange: the same first task's rounds,
    another merge."""
    whole = simulate(tmp_path / "whole", strategy="lorm", **SETTINGS, **PASS)
    default = simulate(tmp_path / "default", strategy="lorm", **SETTINGS)
    assert not any("task_end_exchange" in r for r in default["rounds"])
    assert default["rounds"][0]["accuracy"] == whole["rounds"][0]["accuracy"]
    assert default["accuracy_matrix"] != whole["accuracy_matrix"]
    exchange = server_run.ExperimentRun.exchange_at_end

    def crash_once(self, task):  # the process dies after the task's last round was checkpointed
        monkeypatch.setattr(server_run.ExperimentRun, "exchange_at_end", exchange)
        raise KeyboardInterrupt("stopped before the task-end pass")

    monkeypatch.setattr(server_run.ExperimentRun, "exchange_at_end", crash_once)
    with pytest.raises(KeyboardInterrupt):
        simulate(tmp_path / "split", strategy="lorm", **SETTINGS, **PASS)
    resumed = simulate(tmp_path / "split", strategy="lorm", **SETTINGS, **PASS, resume=True)
    assert resumed["accuracy_matrix"] == whole["accuracy_matrix"]
    assert [r["accuracy"] for r in resumed["rounds"]] == [r["accuracy"] for r in whole["rounds"]]
    # the pass is made once, after the resume, with the same clients and bytes (a round's own bytes
    # may differ by a fresh process's start-up metrics, so the totals are not compared)
    def passes(results):
        return [{k: r["task_end_exchange"][k] for k in ("clients", "answers", "bytes_s2c", "bytes_c2s", "rejected")}
                for r in results["rounds"] if "task_end_exchange" in r]

    assert passes(resumed) == passes(whole) and len(passes(whole)) == 2


def test_task_end_answers_are_checked_as_replies_are_and_weighed_by_their_samples(flower_identity):
    """The platform's task-end exchange on its own: QUERY messages to the clients named, with the
    task's last round in their config; an answer claiming more samples than its client holds is
    excluded (as a train reply would be), the other's Grams become the task's, times its samples."""
    import uuid

    from flwr.app import Message

    from promptfcl.common.records import CONFIG, METRICS
    from tests.conftest import tiny_config
    from tests.helpers import NodeList

    cfg = tiny_config(strategy="lorm", **PASS)
    rt = get_runtime(cfg, LoRMAdapters)
    held = {c: client_indices(rt.data.train.labels, rt.layout, rt.partition, c, 0, 0) for c in (0, 2)}
    s = LoRMStrategy.of(cfg, rt.data.num_classes, cfg.method_options("lorm"), None,
                        HeldSamples(len(rt.data.train), lambda client, task, round_: len(held[client])))
    arrays = s.on_task_start(0, to_array_record(rt.model.trainable_state()))
    messages = s.configure_task_end_exchange(3, 0, arrays, [0, 2], NodeList(2))
    for m in messages:
        m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    assert [m.metadata.message_type for m in messages] == ["query", "query"]
    assert [(m.content[CONFIG]["client-id"], m.content[CONFIG]["exchange"], m.content[CONFIG]["round"])
            for m in messages] == [(0, "task-end", 0), (2, "task-end", 0)]
    learner = LoRMLearner.of(cfg, rt, cfg.method_options("lorm"))
    good = learner.answer(messages[0].content, 0, 0, 0)
    forged = learner.answer(messages[1].content, 0, 0, 2)
    forged[METRICS]["num-examples"] = len(held[2]) + 1
    s.aggregate_exchange(3, [Message(content=good, reply_to=messages[0]),
                             Message(content=forged, reply_to=messages[1])])
    accepted, rejected, _ = s.exchange_outcome
    assert accepted == 1 and len(rejected) == 1 and "num-examples" in rejected[0][1]
    grams = from_array_record(good[GRAMS])
    rows = {layer: i for i, layer in enumerate(cfg.model.layers)}
    for key, layer, target in LoRMStrategy.adapters(from_array_record(arrays)):
        np.testing.assert_array_equal(s.round_grams[key],
                                      len(held[0]) * grams[diagonal_name(target)][rows[layer]].astype(np.float64))
    default = LoRMStrategy.of(cfg, rt.data.num_classes, {})
    assert default.configure_task_end_exchange(3, 0, arrays, [0, 2], NodeList(2)) == []
