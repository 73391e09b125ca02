"""The colluding attacks of issue 55 (strategies/platform/collusion.py), each checked on a toy round
against what its paper says, their application by the simulation's server before the screens
(strategies/platform/attack_policy.py), and label flipping through the learner's data path."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from promptfcl.client.node_policy import NodePolicy
from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.platform.attack_policy import ColludingAttack
from promptfcl.strategies.platform.collusion import (
    alie,
    alie_z,
    flipped_labels,
    ipm,
    malicious_update,
    mimic,
    min_max,
    min_sum,
)
from promptfcl.strategies.platform.learner import FitConditions
from tests.conftest import tiny_config
from tests.helpers import NodeList, accepted_of


@pytest.fixture
def honest() -> np.ndarray:
    """Eight honest updates of 40 coordinates, spread around a common direction."""
    rng = np.random.default_rng(0)
    return 1.0 + rng.normal(scale=0.5, size=(8, 40))


def _sq_dist(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return ((b - a) ** 2).sum(axis=-1)


def test_alie_shifts_every_coordinate_by_z_standard_deviations_with_the_papers_z(honest):
    # Baruch et al. 2019, Section 3: s = floor(n/2 + 1) - m, z = Phi^-1((n - s) / n); n = 10, m = 2: z = 0.253
    assert alie_z(10, 2) == pytest.approx(0.2533, abs=1e-3)
    assert alie_z(50, 12) == pytest.approx(0.5828, abs=1e-3)  # s = 14: Phi^-1(36 / 50)
    assert alie_z(3, 0) == 0.0  # s = 2 of 3: no coordinate to move while staying above the median
    # colluders holding the majority of a task's replies (two of three at Dirichlet 0.1) still attack:
    assert alie_z(3, 2) == pytest.approx(NormalDist().inv_cdf(2 / 3)) and alie_z(4, 3) == pytest.approx(0.6745, abs=1e-3)
    z = alie_z(10, 2)
    bad = alie(honest, z)
    mean, std = honest.mean(axis=0), honest.std(axis=0)
    assert np.all(np.abs(bad - mean) <= z * std + 1e-12)  # within z std of the mean, per coordinate
    np.testing.assert_allclose(bad, mean - z * std)
    assert np.array_equal(malicious_update("alie", honest, 10, 2, z=1.5), alie(honest, 1.5))  # fault-z wins


def test_ipm_has_a_negative_inner_product_with_the_honest_mean(honest):
    bad = ipm(honest, 0.5)
    mean = honest.mean(axis=0)
    assert float(bad @ mean) < 0
    np.testing.assert_allclose(bad, -0.5 * mean)


def test_mimic_sends_one_honest_update():
    rng = np.random.default_rng(1)
    honest = rng.normal(size=(6, 30))
    honest[4] += 5 * np.eye(30)[3]  # one client far along a direction of its own: the heterogeneity mimic skews
    bad = mimic(honest)
    assert any(np.array_equal(bad, h) for h in honest)
    assert np.array_equal(bad, honest[4])


@pytest.mark.parametrize("attack", [min_max, min_sum])
def test_min_max_and_min_sum_stay_inside_the_honest_distances_with_the_largest_gamma(honest, attack):
    bad, gamma = attack(honest)
    mean, direction = honest.mean(axis=0), -honest.std(axis=0)
    np.testing.assert_allclose(bad, mean + gamma * direction)
    pairwise = np.array([[_sq_dist(a, b) for b in honest] for a in honest])
    if attack is min_max:  # max distance to an honest update <= the largest honest pairwise distance
        bound, score = pairwise.max(), lambda g: _sq_dist(mean + g * direction, honest).max()
    else:  # sum of squared distances <= the largest honest one
        bound, score = pairwise.sum(axis=1).max(), lambda g: _sq_dist(mean + g * direction, honest).sum()
    assert gamma > 0 and score(gamma) <= bound
    assert score(gamma * 1.001) > bound  # maximal: a slightly larger gamma breaks it


def test_label_flip_reverses_the_tasks_classes_and_nothing_else():
    classes = np.arange(5, 10)
    labels = np.array([5, 6, 7, 8, 9, 5, 3])
    assert flipped_labels(labels, classes).tolist() == [9, 8, 7, 6, 5, 9, 3]  # 3: not the task's, kept


def test_label_flip_changes_the_labels_a_hostile_client_trains_on_and_only_its():
    """Through the learner's data path: the hostile client's steps see its task's classes
    reversed; an honest client's (and a client of a node that did not enable fault injection) the true ones."""
    from promptfcl.client.faults import flips_labels
    from promptfcl.common.model.runtime import get_runtime
    from promptfcl.strategies.registry import build_learner, prompt_class

    cfg = tiny_config(fault="label-flip", **{"fault-clients": "0"})
    enabled, disabled = NodePolicy.from_node_config({"fault-injection": True}), NodePolicy.from_node_config({})
    assert flips_labels(cfg, enabled, 0, 1, 0) and not flips_labels(cfg, enabled, 1, 1, 0)
    assert not flips_labels(cfg, disabled, 0, 1, 0)
    rt = get_runtime(cfg, prompt_class("fedavg"))
    seen: dict[int, list[int]] = {}
    for client in (0, 1):
        learner = build_learner(cfg, rt)
        conditions = FitConditions(flip_labels=flips_labels(cfg, enabled, client, 1, 0))
        step, labels = learner.step, []

        def recording(x, y, queries, allowed, task, step=step, labels=labels):
            labels.extend(y.tolist())
            return step(x, y, queries, allowed, task)

        learner.step = recording
        content = RecordDict({ARRAYS: to_array_record(rt.model.trainable_state()),
                              "config": ConfigRecord({"client-id": client})})
        learner.fit(content, task=1, round_=0, client_id=client, conditions=conditions)
        seen[client] = labels
    classes = rt.layout.classes(1)
    assert set(seen[1]) <= set(classes.tolist()) and seen[0] and seen[1]
    from promptfcl.common.data.partitions import client_indices

    index = client_indices(rt.data.train.labels, rt.layout, rt.partition, 0, 1, 0)
    true = np.bincount(rt.data.train.labels[index], minlength=10)
    flipped = np.bincount(np.asarray(seen[0]), minlength=10)
    # the hostile client's labels are its true ones with the task's classes reversed (up to held-out rows)
    assert np.all(flipped[classes] <= true[classes[::-1]]) and flipped[classes].sum() > 0
    assert not np.array_equal(flipped[classes], true[classes]) or np.array_equal(true[classes], true[classes[::-1]])


def _round(updates: list[np.ndarray], clients: list[int], start: np.ndarray) -> list:
    contents = [RecordDict({ARRAYS: to_array_record({"w": (start + u).astype(np.float32)}),
                            METRICS: MetricRecord({"num-examples": 10, "train-loss": 1.0, "train-seconds": 0.1})})
                for u in updates]
    return accepted_of(contents, tasks=0, clients=clients)


def test_the_server_replaces_only_the_colluders_replies_computed_from_their_honest_updates():
    rng = np.random.default_rng(2)
    start = rng.normal(size=(4, 5)).astype(np.float32)
    updates = [rng.normal(size=(4, 5)).astype(np.float32) for _ in range(5)]
    hostile = frozenset({0, 1})
    for knowledge, known in (("colluders", [0, 1]), ("all", [0, 1, 2, 3, 4])):
        replies = _round(updates, [0, 1, 2, 3, 4], start)
        replaced = ColludingAttack("ipm", hostile, knowledge, epsilon=0.5).apply(replies, lambda sent: {"w": start})
        assert replaced == 2
        expected = -0.5 * np.mean([updates[i].astype(np.float64) for i in known], axis=0)
        for a in replies:
            sent = from_array_record(a.content[ARRAYS])["w"]
            if a.client in hostile:
                np.testing.assert_allclose(sent - start, expected, atol=1e-5)
            else:  # honest replies untouched
                np.testing.assert_array_equal(sent, (start + updates[a.client]).astype(np.float32))
    assert ColludingAttack("poison", hostile).apply(_round(updates, [0, 1, 2, 3, 4], start), lambda s: None) == 0


def test_a_colluding_attack_reaches_the_platforms_round_before_the_screens(flower_identity):
    """A defended fedavg round with fault = ipm: the hostile client's reply is the attack, and the
    screen sees (and judges) that, not what it trained."""
    from promptfcl.common.model.prompted import build_model
    from promptfcl.common.model.runtime import model_spec
    from promptfcl.strategies.registry import prompt_class, strategy_class

    cfg = tiny_config(fault="ipm", **{"fault-clients": "0", "num-clients": 4, "clients-per-round": 4,
                                      "num-tasks": 1, "pool-size": 2})
    model, _ = build_model(model_spec(cfg, 10), prompt_class("fedavg"))
    s = strategy_class("fedavg").of(cfg, 10)
    arrays = s.on_task_start(0, to_array_record(model.trainable_state()))
    start = from_array_record(arrays)
    msgs = list(s.configure_train(1, arrays, ConfigRecord({"task": 0, "round": 0}), NodeList(4)))
    rng = np.random.default_rng(3)
    replies = []
    common = {k: rng.normal(scale=0.01, size=v.shape) for k, v in start.items()}  # the round's shared direction
    for m in msgs:
        state = {k: (v + common[k] + rng.normal(scale=0.002, size=v.shape)).astype(v.dtype) for k, v in start.items()}
        replies.append(Message(RecordDict({ARRAYS: to_array_record(state), METRICS: MetricRecord(
            {"num-examples": 10, "train-loss": 1.0, "train-seconds": 0.1})}), reply_to=m))
    outcome = s.aggregate_round(1, replies)
    hostile = [i for i, c in enumerate(outcome.clients) if c == 0]
    honest = [i for i, c in enumerate(outcome.clients) if c != 0]
    # knowledge = colluders, one colluder: IPM sends -0.5 x its own update, half its length and reversed
    assert len(hostile) == 1 and len(honest) == 3
    assert outcome.update_cosines[hostile[0]] < -0.9
    assert all(outcome.update_cosines[i] > 0.9 for i in honest)
    assert outcome.update_norms[hostile[0]] == pytest.approx(0.5 * np.median([outcome.update_norms[i] for i in honest]),
                                                             rel=0.2)


def test_a_colluding_attack_is_refused_on_deployed_nodes():
    with pytest.raises(ConfigError, match="cannot collude"):
        from promptfcl.common.config.checks import validate_config

        validate_config(tiny_config(fault="alie", population="nodes", **{"fault-clients": "0"}))
    ExperimentConfig.from_dict({"fault": "label-flip", "population": "nodes", "fault-clients": "0"})  # its own data
    with pytest.raises(ConfigError, match="name its colluders with fault-clients"):
        tiny_config(fault="min-max", **{"fault-rate": 0.2})
    with pytest.raises(ConfigError, match="fault-knowledge"):
        tiny_config(**{"fault-knowledge": "everyone"})


def test_a_forged_lorm_gram_passes_the_record_checks_and_pulls_the_closed_form_merge(flower_identity):
    """LoRM's Grams are second moments (strategies/lorm/records.py), so ``cov-inflate`` forges them:
    the hostile client's Grams x 100, well-formed (the round excludes nobody), make its B dominate
    the closed-form merge of an undefended round."""
    from promptfcl.client.faults import forge_statistics
    from promptfcl.strategies.lorm.records import GRAMS, STATISTICS
    from tests.conftest import PLAIN_MEAN
    from tests.test_lorm import reply, strategy_and_model

    s, model = strategy_and_model(**PLAIN_MEAN, **{"num-clients": 3, "clients-per-round": 3})
    arrays = s.on_task_start(0, to_array_record(model.float().trainable_state()))
    sent = from_array_record(arrays)
    distance = {}
    for round_, forged in enumerate((False, True), start=1):
        contents = [reply(sent, 0, "b", 10, 0.0, i) for i in range(3)]
        if forged:
            grams = forge_statistics("cov-inflate", from_array_record(contents[0][GRAMS]), STATISTICS[GRAMS])
            assert not np.array_equal(grams["diag-qkv"], from_array_record(contents[0][GRAMS])["diag-qkv"])
            contents[0][GRAMS] = to_array_record(grams)
        msgs = list(s.configure_train(round_, arrays, ConfigRecord({"task": 0, "round": 0}), NodeList(3)))
        by_client = {int(m.content["config"]["client-id"]): m for m in msgs}
        outcome = s.aggregate_round(round_, [Message(c, reply_to=by_client[i]) for i, c in enumerate(contents)])
        assert outcome.rejected == () and len(outcome.accepted) == 3  # the forged Grams pass every check
        merged = from_array_record(outcome.arrays)
        hostile = from_array_record(contents[0][ARRAYS])
        names = [n for n in hostile if n.startswith("prompt.lora_") and n.endswith("_b")]
        distance[forged] = sum(float(np.linalg.norm(merged[n][0] - hostile[n][0])) for n in names)
    assert distance[True] < 0.5 * distance[False]  # the hostile client's B now dominates the merge


@pytest.mark.parametrize("method", ["hepco", "fppl"])
def test_a_label_flipping_client_uploads_statistics_of_its_flipped_labels(method):
    """A relabelled dataset poisons everything computed from it: HePCo's class counts and FPPL's
    prototypes of a label-flipping client are those of its flipped labels, not its true ones."""
    from promptfcl.common.data.partitions import client_indices
    from promptfcl.common.model.runtime import get_runtime
    from promptfcl.strategies.registry import build_learner, prompt_class

    cfg = tiny_config(strategy=method, **({"hepco.client-weights": "class-counts"} if method == "hepco" else {}))
    rt = get_runtime(cfg, prompt_class(method))
    index = client_indices(rt.data.train.labels, rt.layout, rt.partition, 0, 1, 0)
    rt.model.prompt.set_task(1)
    uploads = {}
    for flip in (False, True):
        learner = build_learner(cfg, rt)
        learner.conditions = FitConditions(flip_labels=flip)  # the hook alone, as a fit would run it
        learner.client_id = 0
        uploads[flip] = from_array_record(next(iter(learner.round_end(index, 1).values())))
    flipped = flipped_labels(rt.data.train.labels[index], rt.layout.classes(1))
    if method == "hepco":
        classes, counts = np.unique(flipped, return_counts=True)
        np.testing.assert_array_equal(uploads[True]["classes"], classes)
        np.testing.assert_array_equal(uploads[True]["counts"], counts)
        honest = dict(zip(uploads[False]["classes"].tolist(), uploads[False]["counts"].tolist()))
        assert dict(zip(classes.tolist(), counts.tolist())) != honest
    else:  # the same images' means, under the reversed classes
        honest, hostile = uploads[False], uploads[True]
        order = {int(c): i for i, c in enumerate(honest["classes"])}
        reverse = dict(zip(rt.layout.classes(1).tolist(), rt.layout.classes(1)[::-1].tolist()))
        assert sorted(hostile["classes"].tolist()) == sorted(reverse[int(c)] for c in honest["classes"])
        for i, c in enumerate(hostile["classes"].tolist()):
            source = [k for k, v in reverse.items() if v == c][0]
            np.testing.assert_allclose(hostile["means"][i], honest["means"][order[source]], rtol=1e-5)
