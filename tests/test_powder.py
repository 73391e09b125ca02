"""Powder: correlation, two-step aggregation, per-client payloads, dual distillation, ablations, end to end."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.config.options import ASYNCHRONOUS_TASKS
from promptfcl.common.model.runtime import get_runtime
from promptfcl.common.records import (
    ARRAYS,
    CONFIG,
    METRICS,
    from_array_record,
    payload_bytes,
    to_array_record,
    to_torch,
)
from promptfcl.strategies.platform.distillation import classic_distillation, dual_distillation
from promptfcl.strategies.platform.learner import LocalLearner
from promptfcl.strategies.powder.correlation import (
    correlation_matrix,
    first_step_aggregation,
    select_tasks,
    sparsify_rows,
)
from promptfcl.strategies.powder.learner import PowderLearner, sample_weights
from promptfcl.strategies.powder.options import PowderOptions
from promptfcl.strategies.powder.prompt import PowderPrompt
from promptfcl.strategies.powder.records import ALPHA, CLASS_CORR, LOCAL_TASKS, MEASURE
from promptfcl.strategies.powder.strategy import PowderStrategy
from promptfcl.strategies.registry import learner_class, prompt_class, strategy_class
from tests.conftest import PLAIN_MEAN, reply_from, tiny_config


class NodeList:
    def __init__(self, n: int) -> None:
        self.ids = list(range(100, 100 + n))

    def get_node_ids(self):
        return self.ids


# ---------------------------------------------------------------------------- options
def test_options_defaults_validation_and_registry():
    o = PowderOptions.from_options({})
    assert (o.k, o.p, o.lambda_, o.first_step, o.selection, o.dual, o.distillation, o.temperature, o.row_top) == \
        (3, 30.0, 1.0, True, "top-k", True, "dual", 3.0, 0)  # temperature: the authors' code (eq. 5 gives none)
    o = PowderOptions.from_options({"k": "2", "lambda": 0.5, "first-step": "false", "selection": "random",
                                    "distillation": "classic", "row_top": 2, "temperature": 1})
    assert (o.k, o.lambda_, o.first_step, o.selection, o.distillation, o.row_top, o.temperature) == \
        (2, 0.5, False, "random", "classic", 2, 1.0)
    for bad in ({"k": 0}, {"p": 0}, {"lambda": -1}, {"selection": "all"}, {"distillation": "x"},
                {"temperature": 0}, {"row-top": -1}, {"k": 1.5}, {"gamma": 1}):
        with pytest.raises(ConfigError, match="powder"):
            PowderOptions.from_options(bad)
    PowderStrategy.parse_options({"k": 2})
    assert strategy_class("powder") is PowderStrategy
    assert learner_class("powder") is PowderLearner
    assert prompt_class("powder") is PowderPrompt
    assert ASYNCHRONOUS_TASKS in PowderOptions.COMPATIBILITY


# ---------------------------------------------------------------------------- correlation (eq. 7)
def test_correlation_is_symmetric_unit_diagonal_and_sharpened_by_p():
    rng = np.random.default_rng(0)
    alphas = np.abs(rng.normal(size=(5, 12)))
    alphas[3] = -alphas[0]  # anti-correlated with task 0: clamped to 0, not raised to a positive power
    measured = np.array([True, True, True, True, False])
    g1 = correlation_matrix(alphas, measured, 1.0)
    g30 = correlation_matrix(alphas, measured, 30.0)
    for g in (g1, g30):
        np.testing.assert_allclose(g, g.T)
        np.testing.assert_allclose(np.diag(g), 1.0)
        assert (g >= 0).all() and (g <= 1 + 1e-12).all()
    np.testing.assert_array_equal(g30[4], np.eye(5)[4])  # not measured: correlated with itself only
    assert g30[0, 3] == 0.0 and g1[0, 3] == 0.0
    unit = alphas / np.linalg.norm(alphas, axis=1, keepdims=True)
    assert g1[0, 1] == pytest.approx(unit[0] @ unit[1])
    np.testing.assert_allclose(g30[:3, :3], g1[:3, :3] ** 30)  # eq. 7
    off = ~np.eye(5, dtype=bool) & (g1 > 0) & (g1 < 1)
    assert off.any() and (g30[off] < g1[off]).all()  # p > 1 separates weak from strong correlation
    # a zero alpha (no rows selected) is still correlated with itself only
    z = correlation_matrix(np.zeros((2, 3)), np.array([True, True]), 30.0)
    np.testing.assert_array_equal(z, np.eye(2))


def test_sparsified_rows_keep_top_entries_and_sum_to_one():
    g = np.array([[1.0, 0.5, 0.2, 0.1], [0.5, 1.0, 0.3, 0.0], [0.2, 0.3, 1.0, 0.9], [0.1, 0.0, 0.9, 1.0]])
    s = sparsify_rows(g, 2)
    np.testing.assert_allclose(s.sum(axis=1), 1.0)
    assert ((s > 0).sum(axis=1) == 2).all()
    np.testing.assert_allclose(s[0], [1 / 1.5, 0.5 / 1.5, 0, 0])
    assert sparsify_rows(g, 0) is g


def test_first_step_aggregation_is_g_times_p_per_task_slice():
    pool, tasks, per = 8, 4, 2
    rng = np.random.default_rng(1)
    state = {"prompt.p0": rng.normal(size=(pool, 3, 2)).astype(np.float32),
             "prompt.k0": rng.normal(size=(pool, 2)).astype(np.float32),
             "head.weight": rng.normal(size=(6, 2)).astype(np.float32)}
    g = np.array([[1.0, 0.5, 0.0, 9.0], [0.5, 1.0, 0.25, 9.0], [0.0, 0.25, 1.0, 9.0], [9.0] * 4])
    out = first_step_aggregation(state, g, known=3, pool_size=pool, num_tasks=tasks)
    for name in ("prompt.p0", "prompt.k0"):
        p = state[name].astype(np.float64)
        sl = [p[t * per:(t + 1) * per] for t in range(tasks)]
        np.testing.assert_allclose(out[name][0:2], sl[0] + 0.5 * sl[1], rtol=1e-5)
        np.testing.assert_allclose(out[name][2:4], 0.5 * sl[0] + sl[1] + 0.25 * sl[2], rtol=1e-5)
        np.testing.assert_allclose(out[name][4:6], 0.25 * sl[1] + sl[2], rtol=1e-5)
        np.testing.assert_array_equal(out[name][6:8], state[name][6:8])  # task 3 not known: untouched
        assert out[name].dtype == np.float32
    np.testing.assert_array_equal(out["head.weight"], state["head.weight"])
    same = first_step_aggregation(state, np.eye(4), known=4, pool_size=pool, num_tasks=tasks)
    np.testing.assert_allclose(same["prompt.p0"], state["prompt.p0"])


def test_top_k_selection_returns_the_most_correlated_tasks():
    row = np.array([0.1, 0.9, 1.0, 0.3, 0.95, 0.0])
    assert select_tasks(row, own=2, known=6, k=3) == [1, 2, 4]
    assert select_tasks(row, own=2, known=4, k=3) == [1, 2, 3]  # only known tasks compete
    assert select_tasks(row, own=2, known=6, k=1) == [2]
    assert select_tasks(np.zeros(6), own=5, known=6, k=3) == [0, 1, 5]  # itself always, ties to lower index
    assert select_tasks(row, own=0, known=2, k=3) == [0, 1]  # fewer known tasks than k: all of them
    picks = {tuple(select_tasks(row, 2, 6, 3, "random", np.random.default_rng(s))) for s in range(30)}
    assert all(2 in p and len(p) == 3 for p in picks) and len(picks) > 3  # random: own + 2 others, varying


# ---------------------------------------------------------------------------- server: payloads and replies
def strategy_with_pool(num_tasks=4, known=4, **options):
    """A strategy with ``known`` task slices initialised and task alphas giving a known G_task."""
    cfg = tiny_config(num_tasks=num_tasks, num_clients=4, clients_per_round=4, pool_size=2 * num_tasks, **PLAIN_MEAN)
    num_classes = 2 * num_tasks
    s = PowderStrategy.of(cfg, num_classes, options)
    rng = np.random.default_rng(0)
    state = {"prompt.p0": rng.normal(size=(cfg.model.pool_size, 4, 6)).astype(np.float32),
             "prompt.k0": rng.normal(size=(cfg.model.pool_size, 6)).astype(np.float32),
             "prompt.a0": rng.normal(size=(cfg.model.pool_size, 6)).astype(np.float32),
             "head.weight": rng.normal(size=(num_classes, 6)).astype(np.float32),
             "head.bias": rng.normal(size=(num_classes,)).astype(np.float32)}
    s.known_tasks = known
    s.width = 8  # alphas of this hand-made pool
    base = np.eye(8)
    # task 0 ~ task 2 (strongly), task 0 ~ task 1 (weakly), task 3 alone
    alphas = np.array([base[0] + base[1], base[0] + 0.2 * base[2], base[1] + 0.9 * base[0], base[7]])
    s.task_alpha = np.zeros((num_tasks, 8))
    s.task_alpha[: len(alphas)] = alphas[:num_tasks]
    s.task_measured = np.zeros(num_tasks, bool)
    s.task_measured[:known] = True
    s.class_alpha = np.zeros((num_classes, 8))
    s.class_measured = np.zeros(num_classes, bool)
    return cfg, s, state


def test_payload_holds_only_the_top_k_tasks_aggregated_and_is_smaller(flower_identity):
    cfg, s, state = strategy_with_pool(k=2)
    arrays = to_array_record(state)
    msgs = list(s.configure_train(7, arrays, ConfigRecord({"task": 0, "round": 2}), NodeList(4)))
    g = s.task_correlation()
    assert select_tasks(g[0], 0, 4, 2) == [0, 2] and g[0, 2] > g[0, 1] > g[0, 3] == 0
    hat = first_step_aggregation(state, g, 4, cfg.model.pool_size, cfg.data.num_tasks)
    full_bytes = payload_bytes(RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({"task": 0})}))
    for m in msgs:
        config, sent = m.content[CONFIG], from_array_record(m.content[ARRAYS])
        assert list(config[LOCAL_TASKS]) == [0, 2] and config[MEASURE] is False
        for name in ("prompt.p0", "prompt.k0", "prompt.a0"):
            assert sent[name].shape[0] == 4  # two tasks' slices of two rows
            np.testing.assert_allclose(sent[name], np.concatenate([hat[name][0:2], hat[name][4:6]]), rtol=1e-6)
            assert not np.allclose(sent[name][0:2], state[name][0:2])  # aggregated, not the raw slice
        np.testing.assert_array_equal(sent["head.weight"], state["head.weight"][0:2])  # its task's classes only
        assert payload_bytes(m.content) < full_bytes  # tiny arrays here: framing is much of both
        assert sum(v.nbytes for v in sent.values()) < 0.5 * sum(v.nbytes for v in state.values())
        assert list(config[CLASS_CORR]) == [1.0, 1.0]  # no class measured yet: identity rows
    assert [x.data.local_tasks for x in s._sent_round.sent] == [[0, 2]] * 4


def send_tasks(strategy: PowderStrategy, task_of_client: dict[int, int]) -> None:
    """Make ``strategy`` send each client the task given here (clients on different tasks at once)."""

    class Scheduled(type(strategy)):
        def _client_config(self, config, client_id, slot, server_round):
            out = super()._client_config(config, client_id, slot, server_round)
            out["task"] = task_of_client[client_id]
            return out

    strategy.__class__ = Scheduled


def test_payload_differs_per_client_on_different_tasks(flower_identity):
    cfg, s, state = strategy_with_pool(k=2)
    send_tasks(s, {0: 0, 1: 3, 2: 1, 3: 0})
    msgs = list(s.configure_train(7, to_array_record(state), ConfigRecord({"task": 0, "round": 2}), NodeList(4)))
    assert [list(m.content[CONFIG][LOCAL_TASKS]) for m in msgs] == [[0, 2], [0, 3], [0, 1], [0, 2]]


def test_measuring_in_the_training_round_sends_the_whole_aggregated_pool(flower_identity):
    cfg, s, state = strategy_with_pool(k=2, measuring="in-training")
    arrays = to_array_record(state)
    s.new_tasks_pending = True  # a task has just started
    m = list(s.configure_train(1, arrays, ConfigRecord({"task": 1, "round": 0}), NodeList(1)))[0]
    assert m.content[CONFIG][MEASURE] is True and list(m.content[CONFIG][LOCAL_TASKS]) == [0, 1, 2, 3]
    assert s._sent_round.sent[0].data.measure == (1, 0)  # it has just switched from task 0: both are measured
    s.new_tasks_pending = False
    m = list(s.configure_train(2, arrays, ConfigRecord({"task": 1, "round": 1}), NodeList(1)))[0]
    assert m.content[CONFIG][MEASURE] is False and s._sent_round.sent[0].data.measure == ()
    s.task_measured[1] = False  # never measured: measured when next trained
    m = list(s.configure_train(3, arrays, ConfigRecord({"task": 1, "round": 1}), NodeList(1)))[0]
    assert m.content[CONFIG][MEASURE] is True and s._sent_round.sent[0].data.measure == (1,)
    assert s.configure_exchange(3, arrays, ConfigRecord({"task": 1, "round": 1}), NodeList(1)) == []


def query_reply(msg: Message, alpha: ArrayRecord, n: int = 5) -> Message:
    content = RecordDict({ALPHA: alpha, METRICS: MetricRecord({"num-examples": n})})
    return Message(content=content, reply_to=msg)


def test_measuring_exchange_updates_g_before_the_round_trains_with_top_k(flower_identity):
    """Algorithm 1, lines 4-14: a new task appears; the sampled clients get the whole P_hat and
    reply alphas first; the round's training payloads are chosen with the updated G_task."""
    cfg, s, state = strategy_with_pool(k=2)
    send_tasks(s, {0: 0, 1: 3, 2: 1, 3: 0})
    s.new_tasks_pending = True
    arrays = to_array_record(state)
    assert select_tasks(s.task_correlation()[3], 3, 4, 2) == [0, 3]  # task 3 correlated with nothing yet
    ex = s.configure_exchange(4, arrays, ConfigRecord({"task": 0, "round": 2}), NodeList(2))
    for m in ex:
        m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    assert len(ex) == 4 and all(m.metadata.message_type == "query" for m in ex)
    hat = first_step_aggregation(state, s.mixing_matrix(), 4, cfg.model.pool_size, cfg.data.num_tasks)
    for m, x in zip(ex, s._exchange_round.sent):
        assert m.content[CONFIG][MEASURE] is True and list(m.content[CONFIG][LOCAL_TASKS]) == [0, 1, 2, 3]
        sent = from_array_record(m.content[ARRAYS])
        assert set(sent) == {"prompt.p0", "prompt.k0", "prompt.a0"}  # the pool only: no head rows
        np.testing.assert_allclose(sent["prompt.p0"], hat["prompt.p0"], rtol=1e-6)
        assert x.data.measure == (int(m.content[CONFIG]["task"]),)
    # task 3 now measures like task 1; a reply for a task nobody asked about is excluded
    e = np.eye(8)
    alphas = {0: e[0] + e[1], 3: e[0] + 0.2 * e[2], 1: e[0] + 0.2 * e[2]}
    replies = [query_reply(m, to_array_record({
        "tasks": np.array([t]), "task-alpha": alphas[t][None], "task-count": np.array([5]),
        "classes": np.array([2 * t]), "class-alpha": alphas[t][None], "class-count": np.array([5])}))
        for m in ex for t in [int(m.content[CONFIG]["task"])]]
    replies[3] = query_reply(ex[3], alpha_record([2], [4]))
    s.aggregate_exchange(4, replies)
    assert not s.new_tasks_pending and s.measured_before == 3 and len(s._exchange_rejected) == 1
    assert s.task_correlation()[3, 1] == pytest.approx(1.0)
    msgs = configure(s, 4, arrays, 0, 2, 2)
    assert [list(m.content[CONFIG][LOCAL_TASKS]) for m in msgs] == [[0, 2], [1, 3], [1, 3], [0, 2]]
    assert all(m.content[CONFIG][MEASURE] is False and x.data.measure == () for m, x in zip(msgs, s._sent_round.sent))
    outcome = s.aggregate_round(4, [echo(m) for m in msgs])
    metrics = outcome.metrics
    assert metrics["tasks-measured"] == 3 and metrics["local-pool-tasks"] == 2
    assert len(outcome.rejected) == 1 and outcome.rejected[0][1].startswith("exchange: ")
    # nothing new and every task measured: no exchange
    assert s.configure_exchange(5, arrays, ConfigRecord({"task": 0, "round": 2}), NodeList(2)) == []


def test_ablations_change_the_payload(flower_identity):
    _, s, state = strategy_with_pool(k=2, **{"first-step": False})
    m = list(s.configure_train(1, to_array_record(state), ConfigRecord({"task": 0, "round": 2}), NodeList(1)))[0]
    sent = from_array_record(m.content[ARRAYS])
    np.testing.assert_array_equal(sent["prompt.p0"], np.concatenate([state["prompt.p0"][0:2], state["prompt.p0"][4:6]]))
    _, s, state = strategy_with_pool(k=2, selection="random")
    chosen = set()
    for r in range(12):
        m = list(s.configure_train(r, to_array_record(state), ConfigRecord({"task": 0, "round": 2}), NodeList(1)))[0]
        chosen.add(tuple(m.content[CONFIG][LOCAL_TASKS]))
    assert len(chosen) > 1 and all(0 in c and len(c) == 2 for c in chosen)
    _, s, state = strategy_with_pool(k=2, **{"row-top": 1})  # each row keeps only itself: no mixing
    m = list(s.configure_train(1, to_array_record(state), ConfigRecord({"task": 0, "round": 2}), NodeList(1)))[0]
    np.testing.assert_allclose(from_array_record(m.content[ARRAYS])["prompt.p0"][0:2], state["prompt.p0"][0:2])


def configure(s, server_round, arrays, task, round_, nodes):
    """The round's messages, each with the id the grid would give it (replies are matched by it)."""
    msgs = list(s.configure_train(server_round, arrays, ConfigRecord({"task": task, "round": round_}), NodeList(nodes)))
    for m in msgs:
        m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return msgs


def reply_for(msg: Message, sent, value: float, n: int, alpha: ArrayRecord | None = None) -> Message:
    arrays = {k: np.full(v.shape, value, v.numpy().dtype) for k, v in sent.expected.items()}
    content = RecordDict({ARRAYS: to_array_record(arrays), ALPHA: alpha or ArrayRecord(),
                          METRICS: MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1})})
    return Message(content=content, reply_to=msg)


def alpha_record(tasks, classes, width=8, value=1.0):
    return to_array_record({
        "tasks": np.array(tasks, np.int64), "task-alpha": np.full((len(tasks), width), value),
        "task-count": np.full(len(tasks), 5, np.int64), "classes": np.array(classes, np.int64),
        "class-alpha": np.full((len(classes), width), value), "class-count": np.full(len(classes), 3, np.int64)})


def test_replies_merge_per_task_slice_and_are_checked_against_their_own_message(flower_identity):
    _, s, state = strategy_with_pool(k=2)
    send_tasks(s, {0: 0, 1: 3, 2: 0, 3: 1})
    msgs = configure(s, 5, to_array_record(state), 0, 2, 2)  # two nodes, each playing two clients
    good = [reply_for(msgs[0], s._sent_round.sent[0], 1.0, 10), reply_for(msgs[1], s._sent_round.sent[1], 7.0, 10),
            reply_for(msgs[2], s._sent_round.sent[2], 3.0, 30)]
    bad_shape = RecordDict({ARRAYS: to_array_record({k: np.zeros((1,), np.float32) for k in s._sent_round.sent[3].expected.keys()}),
                            ALPHA: ArrayRecord(), METRICS: MetricRecord({"num-examples": 5, "train-loss": 1.0, "train-seconds": 0.1})})
    stray = reply_from(101, bad_shape)  # answers no message of this round
    outcome = s.aggregate_round(5, good + [Message(content=bad_shape, reply_to=msgs[3]), stray])
    arrays, metrics = outcome.arrays, outcome.metrics
    out = from_array_record(arrays)
    hat = first_step_aggregation(state, s.mixing_matrix(), 4, 8, 4)  # what the clients were sent
    for name in ("prompt.p0", "prompt.k0", "prompt.a0"):
        # a raw slice moves by the sample-weighted mean of its clients' changes (trained - P_hat slice sent)
        change0 = (10 * (1.0 - hat[name][0:2]) + 30 * (3.0 - hat[name][0:2])) / 40  # task 0: clients 0 and 2
        np.testing.assert_allclose(out[name][0:2], state[name][0:2] + change0, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[name][6:8], state[name][6:8] + 7.0 - hat[name][6:8], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[name][2:6], state[name][2:6])  # tasks 1 (rejected) and 2: unchanged
    np.testing.assert_allclose(out["head.weight"][0:2], 2.5)
    np.testing.assert_array_equal(out["head.weight"][2:6], state["head.weight"][2:6])
    assert metrics["clients"] == 3 and metrics["tasks-aggregated"] == 2
    assert len(outcome.rejected) == 2 and "array prompt" in outcome.rejected[0][1] and "cannot tell" in outcome.rejected[1][1]
    # alphas sent back unasked are refused
    msgs = configure(s, 6, arrays, 0, 2, 1)
    assert "did not ask" in s.check_reply(reply_for(msgs[0], s._sent_round.sent[0], 1.0, 5, alpha_record([0], [0])))


def echo(msg: Message, shift: dict[int, float] | None = None, n: int = 10) -> Message:
    """A client that trains nothing: it returns its task's part of what it was sent (its slice of
    the local pool, its head rows), its prompt slice moved by ``shift[task]`` if given."""
    config = msg.content[CONFIG]
    task, local = int(config["task"]), [int(t) for t in config[LOCAL_TASKS]]
    pos, out = local.index(task), {}
    for name, value in from_array_record(msg.content[ARRAYS]).items():
        if name.startswith("prompt."):
            per = value.shape[0] // len(local)
            out[name] = value[pos * per:(pos + 1) * per] + np.float32((shift or {}).get(task, 0.0))
        else:
            out[name] = value.copy()
    content = RecordDict({ARRAYS: to_array_record(out), ALPHA: ArrayRecord(),
                          METRICS: MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1})})
    return Message(content=content, reply_to=msg)


@pytest.mark.parametrize("row_top", [0, 3])
def test_clients_that_return_what_they_got_leave_the_raw_pool_unchanged(flower_identity, row_top):
    """Eq. 3 mixes P_g for sending; the mixed slices are never stored back (the issue: the pool grew
    from ~4 to ~1e7 in 15 rounds with eq. 3 as printed, and collapsed with row-top = 3)."""
    _, s, state = strategy_with_pool(k=2, **{"row-top": row_top})
    assert s.mixing_matrix()[0, 2] > 0.4  # tasks 0 and 2 strongly correlated: a mixed pool would move
    send_tasks(s, {0: 0, 1: 2, 2: 1, 3: 3})
    arrays = to_array_record(state)
    for r in range(1, 16):
        msgs = configure(s, r, arrays, 0, 2, 4)
        arrays, metrics = s.aggregate_train(r, [echo(m) for m in msgs])
        assert metrics["clients"] == 4
    out = from_array_record(arrays)
    for name, value in state.items():
        np.testing.assert_allclose(out[name], value, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("row_top", [0, 3])
def test_correlated_tasks_trained_in_the_same_rounds_keep_distinct_slices(flower_identity, row_top):
    """Two strongly correlated tasks, each trained every round: each raw slice accumulates exactly
    its own clients' changes, however much the mixed slices they train with overlap."""
    _, s, state = strategy_with_pool(k=2, **{"row-top": row_top})
    send_tasks(s, {0: 0, 1: 2, 2: 0, 3: 2})
    shift = {0: 0.01, 2: -0.02}
    arrays = to_array_record(state)
    for r in range(1, 16):
        msgs = configure(s, r, arrays, 0, 2, 4)
        assert all(list(m.content[CONFIG][LOCAL_TASKS]) == [0, 2] for m in msgs)  # each trains with the other
        arrays, _ = s.aggregate_train(r, [echo(m, shift) for m in msgs])
    out = from_array_record(arrays)
    for name in ("prompt.p0", "prompt.k0", "prompt.a0"):
        np.testing.assert_allclose(out[name][0:2], state[name][0:2] + 15 * 0.01, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[name][4:6], state[name][4:6] - 15 * 0.02, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[name][2:4], state[name][2:4])  # tasks nobody trained
        np.testing.assert_array_equal(out[name][6:8], state[name][6:8])
        before = np.linalg.norm(state[name][0:2] - state[name][4:6])
        assert np.linalg.norm(out[name][0:2] - out[name][4:6]) > 0.5 * before


def test_the_clients_change_enters_every_local_slice_with_its_eq3_weight():
    """The client trains its raw slice's change; eq. 3 puts it into local slice s with G_task[s, t]
    (as the authors' forward pass mixes the raw pool), so its gradient comes through all of them."""
    torch.manual_seed(0)
    prompt = PowderPrompt(6, [0], pool_size=8, length=4, num_tasks=4)
    prompt.set_task(1)
    prompt.train()
    before = prompt.p0.detach().clone()
    prompt.begin_round([0, 1, 3], {0: 0.5, 1: 0.8, 3: 0.0})
    with torch.no_grad():
        prompt.p0[2:4] += 1.0  # the client's change of its slice
    active = prompt._active("p", 0, train=True)
    torch.testing.assert_close(active[0:2], before[0:2] + 0.5)
    torch.testing.assert_close(active[2:4], before[2:4] + 0.8)  # a normalised row: own weight below 1
    torch.testing.assert_close(active[4:6], before[6:8])  # weight 0: untouched
    active.sum().backward()
    torch.testing.assert_close(prompt.p0.grad[2:4], torch.full_like(before[2:4], 0.5 + 0.8))
    assert prompt.p0.grad[[0, 1, 4, 5, 6, 7]].abs().sum() == 0  # other slices are used detached
    prompt.end_round()
    assert prompt.local_tasks is None and prompt.own_weights is None
    with pytest.raises(ValueError, match="mixing weights"):
        prompt.begin_round([0, 1], {1: 1.0})


def test_alpha_replies_update_the_correlations(flower_identity):
    cfg, s, state = strategy_with_pool(k=2, measuring="in-training")
    s.task_measured[:] = False
    s.new_tasks_pending = True
    msgs = configure(s, 1, to_array_record(state), 1, 0, 2)
    assert all(x.data.measure == (1, 0) for x in s._sent_round.sent)
    wrong = reply_for(msgs[0], s._sent_round.sent[0], 1.0, 5, alpha_record([2], [4]))
    assert "asked for" in s.check_reply(wrong)
    a0 = to_array_record({"tasks": np.array([1, 0]), "task-alpha": np.stack([np.eye(8)[0], np.eye(8)[0] + np.eye(8)[1]]),
                          "task-count": np.array([5, 5]), "classes": np.array([2, 3]),
                          "class-alpha": np.stack([np.eye(8)[2], np.eye(8)[2]]), "class-count": np.array([2, 3])})
    replies = [reply_for(msgs[0], s._sent_round.sent[0], 1.0, 5, a0), reply_for(msgs[1], s._sent_round.sent[1], 1.0, 5, alpha_record([1], [2]))]
    _, metrics = s.aggregate_train(1, replies)
    assert metrics["tasks-measured"] == 2 and not s.new_tasks_pending
    assert s.task_measured[:2].all() and not s.task_measured[2:].any()
    np.testing.assert_allclose(s.task_alpha[1], (np.eye(8)[0] + 1.0) / 2)  # count-weighted over both clients
    np.testing.assert_allclose(s.class_alpha[3], np.eye(8)[2])
    g = s.task_correlation()
    assert 0 < g[0, 1] < 1 and g[0, 2] == 0 and g[1, 1] == 1
    gc = s.class_correlation()
    assert gc[2, 3] > 0.0 and gc[3, 2] == gc[2, 3]
    m = list(s.configure_train(2, to_array_record(state), ConfigRecord({"task": 1, "round": 1}), NodeList(1)))[0]
    np.testing.assert_allclose(m.content[CONFIG][CLASS_CORR], gc[2:4].sum(axis=1))


def test_state_dict_round_trip():
    cfg, s, _ = strategy_with_pool()
    s.class_alpha[3] = 0.5
    s.class_measured[3] = True
    s.new_tasks_pending = True
    again = PowderStrategy.of(cfg, s.num_classes)
    again.load_state_dict(s.state_dict())
    assert again.known_tasks == 4 and again.new_tasks_pending
    np.testing.assert_array_equal(again.task_alpha, s.task_alpha)
    np.testing.assert_array_equal(again.task_measured, s.task_measured)
    np.testing.assert_array_equal(again.class_alpha, s.class_alpha)
    np.testing.assert_array_equal(again.task_correlation(), s.task_correlation())


# ---------------------------------------------------------------------------- dual distillation (eq. 5)
def test_dual_distillation_ignores_the_true_class_and_is_zero_when_models_agree():
    gen = torch.Generator().manual_seed(0)
    allowed = torch.tensor([False, True, True, True, True, False])
    student = torch.randn(4, 6, generator=gen).masked_fill(~allowed, float("-inf"))
    teacher = torch.randn(4, 6, generator=gen).masked_fill(~allowed, float("-inf"))
    labels = torch.tensor([1, 2, 4, 1])
    assert dual_distillation(student, student.clone(), labels).item() == pytest.approx(0.0, abs=1e-7)
    base = dual_distillation(student, teacher, labels)
    assert base.item() > 0
    moved = student.clone()
    moved[torch.arange(4), labels] += 5.0  # only the true-class logits change
    assert dual_distillation(moved, teacher, labels).item() == pytest.approx(base.item(), rel=1e-6)
    assert classic_distillation(moved, teacher).item() != pytest.approx(classic_distillation(student, teacher).item())
    # agreeing on the non-true classes is enough, whatever the true-class logit
    teacher2 = student.clone()
    teacher2[torch.arange(4), labels] -= 3.0
    assert dual_distillation(student, teacher2, labels).item() == pytest.approx(0.0, abs=1e-7)
    # per-sample weights: only weighted samples count
    w = torch.tensor([1.0, 0.0, 0.0, 0.0])
    one = dual_distillation(student[:1], teacher[:1], labels[:1])
    assert dual_distillation(student, teacher, labels, w).item() == pytest.approx(one.item(), rel=1e-6)
    # temperature: softer distributions, scaled by T^2
    assert dual_distillation(student, teacher, labels, temperature=3.0).item() != pytest.approx(base.item())
    # the gradient reaches the student's non-true logits only
    s = student.clone().requires_grad_(True)
    dual_distillation(s, teacher, labels).backward()
    assert (s.grad[torch.arange(4), labels] == 0).all() and s.grad[:, ~allowed].abs().sum() == 0
    assert s.grad[:, allowed].abs().sum() > 0


def test_beta_is_a_softmax_over_the_batch_of_class_total_correlation():
    total = torch.tensor([1.0, 3.0, 1.0])
    beta = sample_weights(total, torch.tensor([0, 1, 1, 2]))
    assert beta.sum().item() == pytest.approx(1.0)
    assert beta[1] == beta[2] > beta[0] == beta[3]
    assert (beta[1] / beta[0]).item() == pytest.approx(float(np.exp(2.0)), rel=1e-5)


# ---------------------------------------------------------------------------- client
def client_setup(**options):
    """Runtime with Powder's prompt; a strategy with 2 known tasks; a message for task 1."""
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.05)
    rt = get_runtime(cfg, PowderPrompt)
    s = PowderStrategy.of(cfg, rt.data.num_classes, options)
    arrays = to_array_record(rt.model.trainable_state())
    for t in range(2):
        arrays = s.on_task_start(t, arrays)
    return cfg, rt, s, arrays


def message_for(s, arrays, task, round_):
    return list(s.configure_train(1, arrays, ConfigRecord({"task": task, "round": round_}), NodeList(1)))[0]


def test_client_trains_its_slice_replies_it_and_measures_alphas(flower_identity):
    cfg, rt, s, arrays = client_setup(measuring="in-training")
    msg = message_for(s, arrays, 1, 0)  # new tasks pending: a measuring round, whole pool
    assert msg.content[CONFIG][MEASURE] is True
    learner = PowderLearner.of(cfg, rt, {})
    reply = learner.fit(msg.content, 1, 0, 0)
    assert set(reply.keys()) == {ARRAYS, METRICS, ALPHA}
    assert learner.last_distillation is not None and learner.last_distillation > 0
    out, sent = from_array_record(reply[ARRAYS]), from_array_record(msg.content[ARRAYS])
    assert out["prompt.p0"].shape[0] == cfg.model.pool_size // cfg.data.num_tasks  # its own slice only
    assert not np.allclose(out["prompt.p0"], sent["prompt.p0"][2:4])  # trained
    assert out["head.weight"].shape[0] == rt.data.num_classes // 2
    alpha = {k: v.numpy() for k, v in reply[ALPHA].items()}
    assert alpha["tasks"].tolist() == [1, 0]  # current and just-finished task
    assert alpha["task-alpha"].shape == (2, len(cfg.model.layers) * cfg.model.pool_size)
    assert sorted(alpha["classes"].tolist()) == list(range(rt.data.num_classes))
    assert s.check_reply(reply_from(100, reply)) is None
    arrays2, metrics = s.aggregate_train(1, [reply_from(100, reply)])
    assert s.task_measured[:2].all() and metrics["tasks-measured"] == 2
    assert rt.model.prompt.local_tasks is None  # the shared runtime is left as plain CODA-P
    # next round: no measuring, local pool from G_task, an empty alpha record
    msg = message_for(s, arrays2, 1, 1)
    assert msg.content[CONFIG][MEASURE] is False
    reply = learner.fit(msg.content, 1, 1, 0)
    assert list(reply[ALPHA].keys()) == [] and s.check_reply(reply_from(100, reply)) is None


def test_client_answers_the_measuring_exchange_with_the_alphas_it_would_measure_in_training(flower_identity):
    cfg, rt, s, arrays = client_setup(measuring="in-training")
    learner = PowderLearner.of(cfg, rt, {})
    in_training = learner.fit(message_for(s, arrays, 1, 0).content, 1, 0, 0)[ALPHA]
    _, _, s, arrays = client_setup()
    ex = s.configure_exchange(1, arrays, ConfigRecord({"task": 1, "round": 0}), NodeList(1))
    assert len(ex) == 1 and ex[0].content[CONFIG][MEASURE] is True
    answer = learner.answer(ex[0].content, 1, 0, 0)
    assert set(answer.keys()) == {ALPHA, METRICS} and answer[METRICS]["num-examples"] > 0
    for name in ("tasks", "task-alpha", "task-count", "classes", "class-alpha", "class-count"):
        np.testing.assert_allclose(answer[ALPHA][name].numpy(), in_training[name].numpy(), rtol=1e-6)
    assert s.check_exchange(reply_from(100, answer), s._exchange_round.sent[0]) is None
    assert rt.model.prompt.local_tasks is None
    with pytest.raises(NotImplementedError):
        LocalLearner.of(cfg, rt).answer(ex[0].content, 1, 0, 0)


def test_distillation_switches_change_local_training(flower_identity):
    cfg, rt, s, arrays = client_setup()
    s.task_measured[:] = True  # no measuring: same local pool for every variant
    msg = message_for(s, arrays, 1, 1)
    runs = {}
    for label, opts in {"dual": {}, "off": {"dual": False}, "classic": {"distillation": "classic"},
                        "lambda0": {"lambda": 0.0}}.items():
        learner = PowderLearner.of(cfg, rt, opts)
        runs[label] = from_array_record(learner.fit(msg.content, 1, 1, 0)[ARRAYS])
        if label in ("off", "lambda0"):
            assert learner.last_distillation is None
    for name in runs["dual"]:
        np.testing.assert_array_equal(runs["off"][name], runs["lambda0"][name])
    differs = lambda a, b: any(not np.allclose(runs[a][n], runs[b][n]) for n in runs[a])  # noqa: E731
    assert differs("dual", "off") and differs("dual", "classic")
    # w/o DUAL is the platform's CE-only learner on the same local pool
    helper = PowderLearner.of(cfg, rt, {})
    helper.local_tasks = [int(t) for t in msg.content[CONFIG][LOCAL_TASKS]]
    full = helper.expand(msg.content[ARRAYS], 1)
    rt.model.prompt.local_tasks = helper.local_tasks
    try:
        plain = LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: full, CONFIG: msg.content[CONFIG]}), 1, 1, 0)
    finally:
        rt.model.prompt.local_tasks = None
    for name, value in helper.uploaded(to_torch(plain[ARRAYS]), 1).items():
        np.testing.assert_array_equal(runs["off"][name], value.numpy())


# ---------------------------------------------------------------------------- end to end
@pytest.mark.simulation
def test_end_to_end_asynchronous_simulation(tmp_path):
    """Clients on different tasks; per-client payloads smaller than FedAvg's once no one measures."""
    from tests.helpers import simulate

    results = simulate(tmp_path / "run", strategy="powder", lr=0.05,
                       **{"switch-every": 1, "switch-fraction": 0.5, "powder.k": 1})
    rounds = results["rounds"]
    assert [sorted(r["client_tasks"]) for r in rounds] == [[0, 0, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    for r in rounds:
        assert r["clients_aggregated"] == 3 and not r["rejected"]
    assert rounds[1]["strategy_metrics"]["tasks-aggregated"] == 2
    assert rounds[1]["strategy_metrics"]["tasks-measured"] == 2  # a new task: everybody measures, before training
    assert rounds[1]["strategy_metrics"]["local-pool-tasks"] == 1.0  # and trains with top-k at once
    assert rounds[3]["strategy_metrics"]["tasks-measured"] == 0  # nothing new: top-k payloads
    assert rounds[3]["strategy_metrics"]["local-pool-tasks"] == 1.0
    n_params = results["communication"]["trainable_parameters"]
    last = rounds[3]["bytes_s2c"] / rounds[3]["clients_sampled"]
    assert last < 4 * n_params  # less than the bare float32 parameters FedAvg sends every client
    assert rounds[1]["bytes_s2c"] / rounds[1]["clients_sampled"] > last  # measuring rounds send the whole pool
    acc = results["accuracy_matrix"]
    assert acc[0][0] is not None and acc[1][1] is not None and acc[1][0] is None
    assert (tmp_path / "run" / "results.json").exists()


def test_update_norms_measure_the_clients_change_not_its_values(flower_identity):
    """The norm filter and update-clip read a Powder reply's update against what the client
    trained from (its task's P_hat slice, its head rows): a client that returns what it got has
    norm 0, and a reversed x10 change reads ten times an honest one (it read about 3.5 times when
    norms were of the values, and poisoned replies passed the filter)."""
    from dataclasses import replace

    from promptfcl.strategies.platform.screens import NormFilter, UpdateScreen

    _, s, state = strategy_with_pool(k=2)
    s.policies = replace(s.policies, screen=UpdateScreen.of(NormFilter(factor=10.0)))  # its norm filter alone
    send_tasks(s, {0: 0, 1: 1, 2: 2, 3: 3})
    msgs = configure(s, 1, to_array_record(state), 0, 2, 4)
    outcome = s.aggregate_round(1, [echo(m) for m in msgs])
    assert list(outcome.update_norms) == pytest.approx([0.0] * 4, abs=1e-6)
    msgs = configure(s, 2, to_array_record(state), 0, 2, 4)
    shifts = [{t: 0.01 for t in range(4)} for _ in msgs]
    shifts[0] = {t: -0.05 for t in range(4)}  # reversed and 5 times larger: under the filter's 10
    shifts[3] = {t: -0.3 for t in range(4)}  # reversed and 30 times larger: refused
    outcome = s.aggregate_round(2, [echo(m, shift) for m, shift in zip(msgs, shifts)])
    norms = outcome.update_norms
    assert len(norms) == 3 and norms[0] == pytest.approx(5 * norms[1], rel=1e-4)
    assert norms[1] == pytest.approx(norms[2], rel=1e-4) and norms[1] > 0
    assert "update norm" in outcome.rejected[-1][1]
