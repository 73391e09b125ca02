"""The shared strategy: seeded sampling, sample-weighted averaging, reply validation, task hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict

from promptfcl.common.model.runtime import layout_of, model_spec
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.platform.aggregation import weighted_average
from promptfcl.strategies.platform.screens import DirectionCheck
from tests.conftest import PLAIN_MEAN, reply_from, tiny_config
from tests.helpers import NodeList


def content(w: float, n: int, shape=(3, 2)):
    return RecordDict({
        ARRAYS: to_array_record({"head.weight": np.full(shape, w, np.float32)}),
        METRICS: MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1}),
    })


def test_weighted_average_uses_sample_counts():
    recs = [to_array_record({"a": np.array([0.0, 2.0], np.float32)}),
            to_array_record({"a": np.array([4.0, 6.0], np.float32)})]
    out = from_array_record(weighted_average(recs, np.array([3, 1])))["a"]
    np.testing.assert_allclose(out, [1.0, 3.0])
    assert out.dtype == np.float32


def test_sampling_is_seeded_and_independent_of_node_ids():
    s = FedAvgStrategy.of(tiny_config(num_clients=50, clients_per_round=5), 10)
    a, b = s.sample_clients(1, 2), s.sample_clients(1, 2)
    assert a == b and len(set(a)) == 5 and all(0 <= c < 50 for c in a)
    assert s.sample_clients(1, 3) != a
    other_seed = FedAvgStrategy.of(tiny_config(num_clients=50, clients_per_round=5, seed=9), 10)
    assert other_seed.sample_clients(1, 2) != a


def test_configure_train_assigns_clients_to_nodes(flower_identity):
    cfg = tiny_config(num_clients=50, clients_per_round=3)
    s = FedAvgStrategy.of(cfg, 10)
    arrays = to_array_record({"head.weight": np.zeros((3, 2), np.float32)})
    msgs = list(s.configure_train(7, arrays, ConfigRecord({"task": 1, "round": 0}), NodeList(4)))
    assert [m.metadata.dst_node_id for m in msgs] == [100, 101, 102]
    assert [m.content["config"]["client-id"] for m in msgs] == s.sample_clients(1, 0)
    assert all(m.content["config"]["config-digest"] == cfg.digest() for m in msgs)
    # fewer nodes than clients: nodes play several clients in turn
    msgs = list(s.configure_train(8, arrays, ConfigRecord({"task": 1, "round": 1}), NodeList(2)))
    assert [m.metadata.dst_node_id for m in msgs] == [100, 101, 100]
    assert len({m.content["config"]["client-id"] for m in msgs}) == 3


def test_bad_replies_are_excluded_and_the_rest_averaged(flower_identity):
    s = FedAvgStrategy.of(tiny_config(num_clients=7, clients_per_round=7, **PLAIN_MEAN), 10)
    msgs = list(s.configure_train(1, content(0.0, 1)[ARRAYS], ConfigRecord({"task": 0, "round": 0}), NodeList(7)))
    nan = content(1.0, 5)
    nan[ARRAYS] = to_array_record({"head.weight": np.full((3, 2), np.nan, np.float32)})
    missing = RecordDict({METRICS: MetricRecord({"num-examples": 5})})
    contents = [content(1.0, 10), content(4.0, 30), nan, content(9.0, 10, shape=(2, 2)), missing, content(9.0, 0)]
    replies = [Message(c, reply_to=m) for c, m in zip(contents, msgs)]
    replies.append(Message(Error(code=0, reason="boom"), reply_to=msgs[6]))
    outcome = s.aggregate_round(1, replies)
    arrays, metrics = outcome.arrays, outcome.metrics
    np.testing.assert_allclose(from_array_record(arrays)["head.weight"], 3.25)  # (10*1 + 30*4) / 40
    assert metrics["num-examples"] == 40 and metrics["clients"] == 2
    reasons = dict(outcome.rejected)
    assert set(reasons) == {102, 103, 104, 105, 106}  # the nodes the bad replies' messages went to
    assert "non-finite" in reasons[102] and "shape" not in reasons[102]
    assert "(2, 2)" in reasons[103] and "missing" in reasons[104] and "no training" in reasons[105]
    assert "boom" in reasons[106]
    # a reply to no message of this round is left out, under the node it came from
    stray = reply_from(42, content(1.0, 10))
    outcome = s.aggregate_round(1, [stray])
    assert s.aggregate_train(1, []) == (None, None) and outcome.arrays is None and outcome.metrics is None
    assert "no matching message" in dict(outcome.rejected)[42]


def test_all_replies_bad_leaves_the_model_unchanged(flower_identity):
    s = FedAvgStrategy.of(tiny_config(), 10)
    assert s.aggregate_train(1, [reply_from(1, error="x")]) == (None, None)


def test_task_start_initialises_only_the_new_slice_orthogonally():
    from promptfcl.common.model.prompted import build_model

    cfg = tiny_config(num_tasks=2, pool_size=4)
    model, _ = build_model(model_spec(cfg, 10))
    s = FedAvgStrategy.of(cfg, 10)
    a0 = s.on_task_start(0, to_array_record(model.trainable_state()))
    a1 = s.on_task_start(1, a0)
    p0, p1 = from_array_record(a0)["prompt.k0"], from_array_record(a1)["prompt.k0"]
    np.testing.assert_array_equal(p0[:2], p1[:2])  # task 0's slice untouched
    k = torch.from_numpy(p1)
    torch.testing.assert_close(k @ k.T, torch.eye(4), atol=1e-5, rtol=0)
    again = s.on_task_start(1, a0)  # seeded: the same init every time
    np.testing.assert_array_equal(from_array_record(again)["prompt.k0"], p1)


@pytest.mark.parametrize("per_task", [False, True])
def test_with_tasks_in_flight_a_slice_is_averaged_over_the_clients_on_its_task(per_task, flower_identity):
    """Asynchronous arrival, 2 of 4 clients a task ahead: with per_task = "in-flight", task 1's slice
    and head rows are the mean of the two ahead clients' values (not diluted by the two others'
    untouched copies), task 0's the mean of the others'; without, everything is the plain mean."""

    cfg = tiny_config(num_clients=4, clients_per_round=4, **PLAIN_MEAN, **{"rounds-per-task": 4, "switch-every": 2,
                                                             "switch-fraction": 0.5})
    strategy = FedAvgStrategy.of(cfg, 10)
    strategy.per_task = "in-flight" if per_task else "never"
    pool = np.zeros((cfg.model.pool_size, 3), np.float32)
    head = np.zeros((10, 3), np.float32)
    sent = to_array_record({"prompt.p0": pool, "head.weight": head})
    for server_round in range(1, 5):  # the first round with clients on both tasks
        msgs = list(strategy.configure_train(server_round, sent, ConfigRecord({"task": 0, "round": server_round - 1}),
                                             NodeList(4)))
        tasks = [int(m.content["config"]["task"]) for m in msgs]
        if len(set(tasks)) > 1:
            break
    assert sorted(tasks) == [0, 0, 1, 1]
    replies = []
    for i, (msg, task) in enumerate(zip(msgs, tasks)):
        value = float(i + 1)  # each client writes its own value into its own task's rows only
        p, h = pool.copy(), head.copy()
        p[layout_of(cfg, 10).task_rows("prompt.p0", p, task)] = value
        h[layout_of(cfg, 10).task_rows("head.weight", h, task)] = value
        replies.append(Message(RecordDict({ARRAYS: to_array_record({"prompt.p0": p, "head.weight": h}),
                                           METRICS: MetricRecord({"num-examples": 10, "train-loss": 1.0,
                                                                  "train-seconds": 0.1})}), reply_to=msg))
    arrays, _ = strategy.aggregate_train(server_round, replies)
    out = from_array_record(arrays)
    for task in (0, 1):
        on_it = [i + 1.0 for i, t in enumerate(tasks) if t == task]
        expected = np.mean(on_it) if per_task else sum(on_it) / 4  # diluted by the two untouched copies
        np.testing.assert_allclose(out["prompt.p0"][layout_of(cfg, 10).task_rows("prompt.p0", pool, task)], expected, rtol=1e-6)
        np.testing.assert_allclose(out["head.weight"][layout_of(cfg, 10).task_rows("head.weight", head, task)], expected,
                                   rtol=1e-6)


@pytest.mark.parametrize("clip, expected", [(0.0, -1.2), (1.0, 0.6), (2.0, 0.4)])
def test_update_clip_bounds_a_reversed_and_scaled_update_to_the_rounds_median(clip, expected, flower_identity):
    """Four honest clients move every weight by +1; one sends its update reversed and ten times
    longer (exactly at the norm filter's threshold, so the filter lets it through); update-strike-norm
    off, so the clip alone bounds it."""
    outcome = _one_reversed_and_scaled_round(update_clip=clip, update_strike_norm=0.0)
    np.testing.assert_allclose(from_array_record(outcome.arrays)["head.weight"], expected, rtol=1e-6)
    assert not outcome.rejected  # bounded, not refused
    if clip:  # the hostile update keeps its direction at clip x the honest length
        assert max(a.update_norm for a in outcome.accepted) == pytest.approx(clip * np.sqrt(6))


def test_a_reply_beyond_the_strike_norm_is_excluded_not_clipped(flower_identity):
    """The same round with update-strike-norm 5 (the default): the reply 10 x the honest length is
    excluded and named, and the round is the honest clients' alone."""
    outcome = _one_reversed_and_scaled_round(update_clip=3.0, update_strike_norm=5.0)
    np.testing.assert_allclose(from_array_record(outcome.arrays)["head.weight"], 1.0, rtol=1e-6)
    assert len(outcome.rejected) == 1 and "update-strike-norm" in outcome.rejected[0][1]


def _one_reversed_and_scaled_round(**keys):
    """Four honest clients move every weight by +1; one sends its update reversed and ten times
    longer (exactly at the norm filter's threshold, so the filter lets it through)."""
    s = FedAvgStrategy.of(tiny_config(num_clients=5, clients_per_round=5, defences="on", update_min_cosine=-1.0,
                                   update_reversed_norm=0.0, **keys), 10)
    msgs = list(s.configure_train(1, content(0.0, 1)[ARRAYS], ConfigRecord({"task": 0, "round": 0}), NodeList(5)))
    contents = [content(1.0, 10) for _ in range(4)] + [content(-10.0, 10)]
    return s.aggregate_round(1, [Message(c, reply_to=m) for c, m in zip(contents, msgs)])


@pytest.mark.parametrize("by_count", [True, False])
def test_the_clip_reads_each_replys_sample_count(by_count, flower_identity):
    """Four clients on 10 samples move every weight by +1; one on 40 samples (a label-skewed client
    holding most of a class) moves them by +3.5, in the same direction. With update-clip-by-count
    its bound is 3 x sqrt(40 / 10) = 6 x the lower median and it is kept whole; with one bound for
    all it is clipped to 3 x, and the mean moves less than the clients' data say."""
    s = FedAvgStrategy.of(tiny_config(num_clients=5, clients_per_round=5, defences="on", update_clip=3.0,
                                   update_clip_by_count=by_count), 10)
    msgs = list(s.configure_train(1, content(0.0, 1)[ARRAYS], ConfigRecord({"task": 0, "round": 0}), NodeList(5)))
    contents = [content(1.0, 10) for _ in range(4)] + [content(3.5, 40)]
    outcome = s.aggregate_round(1, [Message(c, reply_to=m) for c, m in zip(contents, msgs)])
    longest = 3.5 if by_count else 3.0
    np.testing.assert_allclose(from_array_record(outcome.arrays)["head.weight"], (4 * 10 + longest * 40) / 80,
                               rtol=1e-6)
    assert max(a.update_norm for a in outcome.accepted) == pytest.approx(longest * np.sqrt(6))
    assert outcome.defences["clip"] == (0 if by_count else 1)


def _non_iid_update(client: int, sign: float = 1.0) -> RecordDict:
    """A (3, 2) head update: every client moves row 0 (the shared part) by +1 and its own
    class's row by +2 (each on another row or column); ``sign`` -1 is that update reversed."""
    w = np.zeros((3, 2), np.float32)
    w[0] = 1.0
    w[1 + client % 2, client // 2 % 2] = 2.0
    return RecordDict({ARRAYS: to_array_record({"head.weight": sign * w}),
                       METRICS: MetricRecord({"num-examples": 10, "train-loss": 1.0, "train-seconds": 0.1})})


@pytest.mark.parametrize("min_cosine", [-1.0, 0.0])
def test_update_min_cosine_excludes_a_sign_flipped_update_of_honest_length(min_cosine, flower_identity):
    """Four honest clients, each with its own non-IID update (they share only row 0), and one
    that returns its update reversed, as long as an honest one: the norm filter and update-clip
    cannot see it; the direction check (cosine with the round's median update below 0) excludes
    it and only it, and what is averaged is then exactly the honest clients' mean (update-strikes
    0: a flag excludes at once, with no history; the strikes have their own tests)."""
    s = FedAvgStrategy.of(tiny_config(num_clients=5, clients_per_round=5, defences="on", update_min_cosine=min_cosine,
                                   update_clip=1.0, update_reversed_norm=0.0, update_strikes=0), 10)
    msgs = list(s.configure_train(1, content(0.0, 1)[ARRAYS], ConfigRecord({"task": 0, "round": 0}), NodeList(5)))
    contents = [_non_iid_update(c) for c in range(4)] + [_non_iid_update(4, sign=-1.0)]
    outcome = s.aggregate_round(1, [Message(c, reply_to=m) for c, m in zip(contents, msgs)])
    arrays = outcome.arrays
    honest = [from_array_record(c[ARRAYS])["head.weight"] for c in contents[:4]]
    flipped = from_array_record(contents[4][ARRAYS])["head.weight"]
    expected = np.mean(honest, axis=0) if min_cosine > -1 else np.mean(honest + [flipped], axis=0)
    np.testing.assert_allclose(from_array_record(arrays)["head.weight"], expected, rtol=1e-6)
    assert len(outcome.accepted) == (4 if min_cosine > -1 else 5)
    if min_cosine > -1:
        assert [node for node, _ in outcome.rejected] == [msgs[4].metadata.dst_node_id]
        assert "points against the round" in outcome.rejected[0][1]


def test_update_clip_reads_its_bound_before_the_direction_check(flower_identity):
    """Label-skewed honest updates can disagree more than two attackers do: here the direction
    check keeps both attackers (reversed x4, agreeing with each other) and only one of three
    honest clients. The clip bound is the lower median of all five norms (an honest length),
    not of what the check left, where the attackers are the majority and would set their own."""
    honest = [np.array([1.0, 0.0, -1.0]), np.array([-2.0, 0.0, 2.0]), np.array([-2.0, 0.0, 0.0])]
    hostile = -4.0 * np.array([-2.0, 0.0, 1.0])

    def reply(v: np.ndarray) -> RecordDict:
        w = np.zeros((3, 2), np.float32)
        w[:, 0] = v
        return RecordDict({ARRAYS: to_array_record({"head.weight": w}),
                           METRICS: MetricRecord({"num-examples": 10, "train-loss": 1.0, "train-seconds": 0.1})})

    s = FedAvgStrategy.of(tiny_config(num_clients=5, clients_per_round=5, defences="on", update_min_cosine=0.0,
                                   update_clip=1.0, update_reversed_norm=0.0, update_strikes=0), 10)
    msgs = list(s.configure_train(1, content(0.0, 1)[ARRAYS], ConfigRecord({"task": 0, "round": 0}), NodeList(5)))
    contents = [reply(v) for v in honest + [hostile, hostile]]
    outcome = s.aggregate_round(1, [Message(c, reply_to=m) for c, m in zip(contents, msgs)])
    arrays = outcome.arrays
    assert len(outcome.rejected) == 2 and all("points against the round" in why for _, why in outcome.rejected)
    bound = np.linalg.norm(honest[1])  # the 3rd smallest of the five norms
    assert sorted(a.update_norm for a in outcome.accepted) == pytest.approx([np.linalg.norm(honest[0]), bound, bound])
    clipped = hostile * bound / np.linalg.norm(hostile)
    np.testing.assert_allclose(from_array_record(arrays)["head.weight"][:, 0], (honest[0] + 2 * clipped) / 3,
                               rtol=1e-5)


def test_direction_outliers_judges_only_comparable_updates_of_three_or_more():
    from promptfcl.strategies.platform.replies import direction_outliers

    up = {"a": np.ones(4)}
    assert direction_outliers([up, {"a": -np.ones(4)}], 0.0) == [None, None]  # two: never judged
    # an array one update holds in another shape (another task slice) is left out of the comparison
    three = [{"a": np.ones(4), "b": np.ones(2)}, {"a": np.ones(4), "b": np.ones(3)}, {"a": -np.ones(4), "b": np.ones(2)}]
    flags = direction_outliers(three, 0.0)
    assert flags[:2] == [None, None] and "cosine -1.000" in flags[2]
    # a client that did not move (norm 0) is not pointing anywhere
    assert direction_outliers([up, up, {"a": np.zeros(4)}], 0.0) == [None, None, None]
    # the threshold is the user's: 0.99 also excludes an honest update at 45 degrees to the rest
    tilted = {"a": np.array([1.0, 1.0, 1.0, -1.0])}
    assert direction_outliers([up, up, tilted], 0.99)[2] is not None
    assert direction_outliers([up, up, tilted], 0.0)[2] is None


def test_direction_check_judges_each_update_against_the_clients_on_its_own_task(flower_identity):
    """Asynchronous arrival: four clients on task 0 (one of them reversed) and one a task ahead,
    whose update (its own task's rows up, task 0's head rows down, as a client learning new
    classes does) points against task 0's median. The reversed client is excluded; the one
    ahead is alone on its task, so nothing judges it and it is kept."""

    cfg = tiny_config(num_clients=5, clients_per_round=5, defences="on", update_min_cosine=0.0, update_strikes=0,
                      **{"rounds-per-task": 5, "switch-every": 1, "switch-fraction": 0.2})
    strategy = FedAvgStrategy.of(cfg, 10)
    head = np.zeros((10, 3), np.float32)
    sent = to_array_record({"head.weight": head})
    for server_round in range(1, 5):
        msgs = list(strategy.configure_train(server_round, sent, ConfigRecord({"task": 0, "round": server_round - 1}),
                                             NodeList(5)))
        tasks = [int(m.content["config"]["task"]) for m in msgs]
        if len(set(tasks)) > 1:
            break
    assert sorted(tasks) == [0, 0, 0, 0, 1]
    rows = {t: layout_of(cfg, 10).task_rows("head.weight", head, t) for t in (0, 1)}
    replies, on_task_0 = [], 0
    for msg, task in zip(msgs, tasks):
        h = head.copy()
        if task == 1:
            h[rows[1]], h[rows[0]] = 1.0, -0.5
        else:
            h[rows[0]] = -1.0 if on_task_0 == 3 else 1.0  # the fourth client on task 0 is reversed
            on_task_0 += 1
        replies.append(Message(RecordDict({ARRAYS: to_array_record({"head.weight": h}),
                                           METRICS: MetricRecord({"num-examples": 10, "train-loss": 1.0,
                                                                  "train-seconds": 0.1})}), reply_to=msg))
    outcome = strategy.aggregate_round(server_round, replies)
    assert sorted(a.task for a in outcome.accepted) == [0, 0, 0, 1]
    assert len(outcome.rejected) == 1 and "points against the round" in outcome.rejected[0][1]


def test_direction_check_is_not_applied_under_client_side_dp_noise():
    """With dp.noise-multiplier > 0 every honest update carries Gaussian noise much longer than its
    signal, so its cosine with the median is near 0 either way: the check would exclude honest
    clients at random, and it is not applied (clipping alone, without noise, keeps it)."""
    noisy = FedAvgStrategy.of(tiny_config(defences="on", update_min_cosine=0.0,
                                       **{"dp.clip": 1.0, "dp.noise-multiplier": 1.0}), 10)
    clipped = FedAvgStrategy.of(tiny_config(defences="on", update_min_cosine=0.0, **{"dp.clip": 1.0}), 10)
    assert (noisy.policies.screen.get(DirectionCheck).active, clipped.policies.screen.get(DirectionCheck).active) == (False, True)


def test_a_long_reversed_update_is_excluded_a_short_skewed_one_kept(flower_identity):
    """update-reversed-norm: honest label-skewed updates can point slightly against the median
    (here cosine about -0.2 at an honest length), which the defaults keep; the same direction
    sent 5x longer than the lower median (what poisoning sends) is excluded."""
    base = np.array([1.0, 1.0, 0.0, 0.0])
    honest = [base + np.array([0, 0, 0.2 * i, 0]) for i in range(3)]
    skewed = np.array([-0.3, -0.3, 0.0, 1.2])  # cosine about -0.4 with the median, honest length
    for extra, excluded in ((skewed, False), (skewed * 5 / np.linalg.norm(skewed) * np.linalg.norm(base), True)):
        s = FedAvgStrategy.of(tiny_config(num_clients=5, clients_per_round=5, defences="on"), 10)
        msgs = list(s.configure_train(1, content(0.0, 1)[ARRAYS], ConfigRecord({"task": 0, "round": 0}), NodeList(5)))
        replies = []
        for v, m in zip(honest + [base, extra], msgs):
            w = np.zeros((3, 2), np.float32)
            w.flat[:4] = v
            replies.append(Message(RecordDict({ARRAYS: to_array_record({"head.weight": w}), METRICS: MetricRecord(
                {"num-examples": 10, "train-loss": 1.0, "train-seconds": 0.1})}), reply_to=m))
        outcome = s.aggregate_round(1, replies)
        assert (outcome.defences["direction"] == 1) is excluded, outcome.rejected
        if excluded:
            assert "update-reversed-norm" in outcome.rejected[0][1]
        else:  # kept although it points against the round, by less than update-min-cosine
            assert len(outcome.accepted) == 5 and -0.6 < outcome.accepted[-1].cosine < 0
