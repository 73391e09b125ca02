"""C2Prompt: global class distributions, histograms, class-aware prompt aggregation (CPA), the
compensation prompt's attachment, asynchronous rounds, and a short federation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.prompted import build_model, masked_logits
from promptfcl.common.model.runtime import get_runtime, model_spec
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.c2prompt.cpa import (
    class_aware_aggregate,
    collapse_weights,
    cpa_matrix,
    selection_histogram,
)
from promptfcl.strategies.c2prompt.distributions import class_statistics, compensation_loss, pool_statistics
from promptfcl.strategies.c2prompt.learner import C2PromptLearner
from promptfcl.strategies.c2prompt.options import C2PromptOptions
from promptfcl.strategies.c2prompt.prompt import C2PromptPrompt
from promptfcl.strategies.c2prompt.records import CLASS_STATS, GLOBAL_STATS, HISTOGRAM, UPLOAD_STATS
from promptfcl.strategies.c2prompt.strategy import C2PromptStrategy
from promptfcl.strategies.platform.learner import Batch
from promptfcl.strategies.platform.run_checks import check_options
from tests.conftest import PLAIN_MEAN, tiny_config
from tests.helpers import accepted_of

NUM_CLASSES = 10  # digits: 2 tasks x 5 classes in the tiny configuration


# ---------------------------------------------------------------------------- global distributions
def test_pooled_mean_and_variance_are_those_of_the_union_of_the_clients_samples():
    rng = np.random.default_rng(0)
    parts = [rng.normal(loc, scale, (n, 6)) for loc, scale, n in ((0.0, 1.0, 3), (2.0, 0.5, 17), (-1.0, 2.0, 40))]
    records = [from_array_record(class_statistics(x, np.zeros(len(x), np.int64))) for x in parts]
    counts = np.array([int(r["counts"][0]) for r in records])
    # float64 on both sides: the wire's float32 rounding is not what is tested
    means = np.stack([x.mean(0) for x in parts])
    var = np.stack([x.var(0) for x in parts])
    total, mean, variance = pool_statistics(counts, means, var)
    union = np.concatenate(parts)
    assert total == len(union) == counts.sum()
    np.testing.assert_allclose(mean, union.mean(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(variance, union.var(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(records[1]["var"][0], parts[1].var(0), rtol=1e-6)  # population variance
    # a client with no samples of the class changes nothing
    again = pool_statistics(np.append(counts, 0), np.vstack([means, np.full(6, 1e3)]), np.vstack([var, np.ones(6)]))
    np.testing.assert_allclose(again[1], mean)


def test_gaussian_nll_is_lowest_at_the_global_mean_and_losses_are_their_closed_forms():
    mu, var = torch.tensor([[1.0, -2.0]]), torch.tensor([[4.0, 0.25]])
    f = torch.tensor([[3.0, -2.0]])
    nll = compensation_loss(f, mu, var, "nll", 1e-4)
    assert float(nll) == pytest.approx(0.5 * (4 / 4 + np.log(4) + np.log(0.25)), rel=1e-6)
    assert compensation_loss(mu, mu, var, "nll", 1e-4) < nll
    assert float(compensation_loss(f, mu, var, "mse", 1e-4)) == pytest.approx(4.0)
    # kl: a batch matching the global Gaussian's moments has KL 0
    batch = torch.tensor([[1.0 + 2.0, -2.0 + 0.5], [1.0 - 2.0, -2.0 - 0.5]])
    kl = compensation_loss(batch, mu.expand(2, 2), var.expand(2, 2), "kl", 1e-4, torch.zeros(2, dtype=torch.long))
    assert abs(float(kl)) < 1e-6


# ---------------------------------------------------------------------------- histograms
def test_histograms_sum_to_images_times_selected_components_and_match_a_hand_count():
    # 5 images, 3 components of the task's slice, 2 classes (positions 0, 1)
    weights = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.8, 0.5], [0.7, 0.6, 0.1], [0.1, 0.2, 0.9], [0.3, 0.4, 0.35]])
    positions = np.array([0, 0, 1, 1, 1])
    top1 = selection_histogram(weights, positions, 2, "top-k", 1)
    np.testing.assert_array_equal(top1, [[1, 1], [1, 1], [0, 1]])  # (component, class): by hand
    top2 = selection_histogram(weights, positions, 2, "top-k", 2)
    assert top2.sum() == 5 * 2
    np.testing.assert_array_equal(top2, [[1, 1], [1, 3], [2, 2]])
    mass = selection_histogram(weights - 0.25, positions, 2, "mass", 1)
    np.testing.assert_allclose(mass.sum(), 5.0)
    np.testing.assert_allclose(mass[:, 0], [0.65 / 0.7, 0.55 / 0.8, 0.05 / 0.7 + 0.25 / 0.8], rtol=1e-6)


def test_the_learners_histogram_counts_its_images_among_its_tasks_slice():
    cfg = tiny_config(strategy="c2prompt", centralised=True)
    rt = get_runtime(cfg, C2PromptPrompt)
    learner = C2PromptLearner.of(cfg, rt, {"histogram-k": 2})
    learner.classes = rt.layout.classes(1)
    rt.model.prompt.set_task(1)
    index = np.flatnonzero(rt.data.train.labels >= 5)[:40]
    labels = rt.data.train.labels[index]
    hist = from_array_record(learner.histogram(learner.queries_of(index), labels, 1))["hist"]
    assert hist.shape == (len(cfg.model.layers), cfg.model.pool_size // cfg.data.num_tasks, 5)
    for layer_hist in hist:  # every image selected k = 2 of the slice's 2 components
        np.testing.assert_array_equal(layer_hist.sum(0), np.bincount(labels - 5, minlength=5) * 2)


# ---------------------------------------------------------------------------- CPA
def test_cpa_with_identical_histograms_is_the_weighted_mean_within_a_component():
    rng = np.random.default_rng(1)
    hist = rng.integers(0, 9, (4, 5)).astype(float)  # N = 4 components, C = 5 classes
    values = rng.normal(size=(3, 4, 2, 6))  # K = 3 clients' copies of the slice (N, L, D)
    weights = np.array([10.0, 30.0, 60.0])
    merged, copies = class_aware_aggregate(values, np.stack([hist] * 3), weights, "component")
    mean = np.einsum("k,k...->...", weights / weights.sum(), values)
    np.testing.assert_allclose(merged, mean, atol=1e-12)
    np.testing.assert_allclose(copies, np.stack([mean] * 3), atol=1e-12)
    # scaled copies of one histogram (a bigger client) are the same class profile
    merged2, _ = class_aware_aggregate(values, np.stack([hist, 3 * hist, 0.5 * hist]), weights, "component")
    np.testing.assert_allclose(merged2, mean, atol=1e-12)
    # the figures' whole matrix (the default) also mixes components whose class profiles overlap
    _, everywhere = class_aware_aggregate(values, np.stack([hist] * 3), weights)
    assert not np.allclose(everywhere, copies)


@pytest.mark.parametrize("scope", ["component", "all"])
def test_cpa_with_disjoint_class_support_is_block_diagonal_and_rows_are_normalised(scope):
    rng = np.random.default_rng(2)
    a = np.zeros((3, 4))
    a[:, :2] = rng.integers(1, 5, (3, 2))  # client 0: classes 0, 1
    b = np.zeros((3, 4))
    b[:, 2:] = rng.integers(1, 5, (3, 2))  # client 1: classes 2, 3
    hists = np.stack([a, b])
    w = cpa_matrix(hists, np.array([1.0, 2.0]), scope)
    np.testing.assert_allclose(w.sum(1), 1.0)
    assert (w >= 0).all()
    np.testing.assert_array_equal(w[:3, 3:], 0.0)  # client 0's components take nothing of client 1's
    np.testing.assert_array_equal(w[3:, :3], 0.0)
    values = rng.normal(size=(2, 3, 5))
    _, copies = class_aware_aggregate(values, hists, np.array([1.0, 2.0]), scope)
    if scope == "component":  # nothing shared: every copy keeps its own value
        np.testing.assert_allclose(copies, values)
    # a partly shared class mixes in proportion to the similarity
    b[:, 1] = 1.0
    w = cpa_matrix(np.stack([a, b]), np.array([1.0, 1.0]), "component")
    assert (np.diag(w[:3, 3:]) > 0).all() and np.allclose(w.sum(1), 1.0)


def test_collapse_weighs_each_clients_copy_by_its_use_of_the_component():
    hists = np.zeros((2, 2, 1))
    hists[0, 0, 0], hists[1, 1, 0] = 4.0, 4.0  # client 0 used only component 0, client 1 only 1
    pi = collapse_weights(hists, np.array([1.0, 1.0]))
    np.testing.assert_allclose(pi, [[1.0, 0.0], [0.0, 1.0]])
    np.testing.assert_allclose(collapse_weights(np.zeros((2, 2, 1)), np.array([1.0, 3.0])), [[0.25, 0.75]] * 2)


# ---------------------------------------------------------------------------- compensation prompts
def test_an_added_zero_compensation_prompt_is_the_plain_forward_and_a_concatenated_one_is_not():
    cfg = tiny_config(strategy="c2prompt", prompt_mode="prompt")
    model, _ = build_model(model_spec(cfg, NUM_CLASSES), C2PromptPrompt)
    model.eval()
    x = torch.rand(3, 3, 16, 16)
    q = model.query(x)
    plain = model(x, q)
    prompt = model.prompt
    assert isinstance(prompt, C2PromptPrompt)
    zeros = {layer: torch.zeros(3, cfg.model.prompt_length, model.embed_dim) for layer in cfg.model.layers}
    prompt.attach = "add"
    with prompt.compensated(zeros, halves=False), torch.no_grad():
        torch.testing.assert_close(model(x, q), plain)
    prompt.attach = "concat"
    with prompt.compensated({k: v + 0.5 for k, v in zeros.items()}, halves=False), torch.no_grad():
        assert not torch.allclose(model(x, q), plain)
    torch.testing.assert_close(model(x, q), plain)  # detached again after the block
    assert not any("comp" in k for k in model.trainable_state())  # compensation prompts never travel


def _batch(learner: C2PromptLearner, task: int = 0):
    """One training batch through the platform's forward (what ``step`` hands ``extra_loss``)."""
    rt = learner.rt
    model = rt.model
    index = np.flatnonzero(rt.data.train.labels < 5)[:16]
    x = model.preprocess(torch.from_numpy(rt.data.train.images[index]))
    y = torch.as_tensor(rt.layout.head_targets(task, rt.data.train.labels[index]))
    allowed = torch.zeros(rt.layout.head_size, dtype=torch.bool)
    allowed[rt.layout.head_rows(task)] = True
    q = model.query(x)
    feats = model.features(x, q)
    logits = masked_logits(model.head(feats), allowed)
    return Batch(x, y, q, feats, logits), allowed


def _learner_with_compensation(options: dict):
    cfg = tiny_config(strategy="c2prompt", centralised=True, prompt_mode="prompt",
                      **{f"c2prompt.{k}": v for k, v in options.items()})
    rt = get_runtime(cfg, C2PromptPrompt)
    rt.model.prompt.configure(cfg.method)
    learner = C2PromptLearner.of(cfg, rt, options)
    learner.seed = [0, 0, 0, 0]
    rt.model.prompt.set_task(0)
    learner.round_start(global_content(rt.model.embed_dim), 0)
    return learner


def global_content(dim: int) -> RecordDict:
    """A train message's records for LCDC: task 0's classes at mean 0, variance 1."""
    return RecordDict({GLOBAL_STATS: to_array_record({"classes": np.arange(5), "means": np.zeros((5, dim), np.float32),
                                                      "var": np.ones((5, dim), np.float32)}),
                       "config": ConfigRecord({})})


def test_comp_prob_zero_leaves_the_plain_prompted_loss():
    learner = _learner_with_compensation({"comp-prob": 0.0, "comp-epochs": 1})
    assert learner.compensation is not None  # LCDC ran: prompts exist, but none is attached
    batch, _ = _batch(learner)
    assert learner.extra_loss(batch, 0) is None


def test_with_comp_prob_one_each_images_loss_is_its_compensated_forwards():
    learner = _learner_with_compensation({"comp-prob": 1.0, "comp-epochs": 0})
    batch, allowed = _batch(learner)
    model, prompt = learner.rt.model, learner.prompt
    total = F.cross_entropy(batch.logits, batch.labels) + learner.extra_loss(batch, 0)
    positions = learner.position[batch.labels]
    with prompt.compensated(learner.attached(positions, batch.images.device), False):
        direct = F.cross_entropy(masked_logits(model(batch.images, batch.query), allowed), batch.labels)
    torch.testing.assert_close(total, direct)


@pytest.mark.parametrize("schedule", ["once", "every-round"])
def test_lcdc_moves_the_compensated_features_toward_their_global_distribution(schedule):
    learner = _learner_with_compensation({"comp-epochs": 0, "comp-schedule": schedule})
    rt, prompt = learner.rt, learner.prompt
    index = np.flatnonzero(rt.data.train.labels < 5)
    x = rt.model.preprocess(torch.from_numpy(rt.data.train.images[index]))
    which = torch.as_tensor(rt.data.train.labels[index])
    alone = schedule == "once"  # figure (c): the class tokens alone on the frozen backbone

    def loss(comps):
        with prompt.compensated({k: c[which] for k, c in comps.items()}, False, alone), torch.no_grad():
            feats = rt.model.features(x, rt.model.query(x))
        return float(compensation_loss(feats, learner.global_means[which], learner.global_var[which], "nll", 1e-4))

    before = loss(learner.compensation)
    trained = learner.train_compensation(0)  # the fit's LCDC (comp-epochs 0 above: init only)
    assert trained.keys() == learner.compensation.keys()
    learner.opts = C2PromptOptions.from_options({"comp-epochs": 3, "comp-lr": 0.05, "comp-schedule": schedule})
    assert loss(learner.train_compensation(0)) < before


# ---------------------------------------------------------------------------- server
def strategy(**overrides):
    cfg = tiny_config(strategy="c2prompt", **overrides)
    model, _ = build_model(model_spec(cfg, NUM_CLASSES), C2PromptPrompt)
    s = C2PromptStrategy.of(cfg, NUM_CLASSES, cfg.method_options("c2prompt"))
    arrays = s.on_task_start(1, s.on_task_start(0, to_array_record(model.trainable_state())))
    return s, arrays


def reply(s, arrays, task: int, hist: np.ndarray, shift: float, stats: dict | None = None, n: int = 10) -> RecordDict:
    state = {k: v + np.float32(shift) for k, v in from_array_record(arrays).items()}
    dim = state["head.weight"].shape[1]
    stats = stats or {"classes": np.zeros(0, np.int64), "counts": np.zeros(0, np.int64),
                      "means": np.zeros((0, dim), np.float32), "var": np.zeros((0, dim), np.float32)}
    return RecordDict({ARRAYS: to_array_record(state),
                       METRICS: MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1}),
                       CLASS_STATS: to_array_record(stats),
                       HISTOGRAM: to_array_record({"hist": hist.astype(np.float32)})})


def test_an_asynchronous_round_aggregates_each_task_over_the_replies_sent_that_task():
    # component scope: identical histograms give each task's replies' mean, which this test reads
    s, arrays = strategy(num_clients=4, clients_per_round=4, rounds_per_task=2, switch_every=1, switch_fraction=0.5,
                         **{"c2prompt.cpa-scope": "component"})
    per_task, layers = s.layout.components_per_task, s.model.layers
    shape = (len(layers), per_task, 5)
    h0, h1 = np.ones(shape), np.zeros(shape)
    h1[:, :, 0] = 1.0
    replies = [reply(s, arrays, 0, h0, 1.0), reply(s, arrays, 0, h0, 3.0), reply(s, arrays, 1, h1, 10.0),
               reply(s, arrays, 1, 2 * h1, 20.0)]
    accepted = accepted_of(replies, tasks=[0, 0, 1, 1], weights=[1.0, 1.0, 1.0, 3.0])
    s.round_arrays = arrays
    out = from_array_record(s.aggregate(accepted))
    base = from_array_record(arrays)
    for layer in layers:
        for kind in "pka":
            name = f"prompt.{kind}{layer}"
            # task 0's slice from the task-0 replies only (identical histograms: their mean), task 1's likewise
            np.testing.assert_allclose(out[name][s.layout.slice_of(0)], base[name][s.layout.slice_of(0)] + 2.0,
                                       rtol=1e-5)
            np.testing.assert_allclose(out[name][s.layout.slice_of(1)], base[name][s.layout.slice_of(1)] + 17.5,
                                       rtol=1e-5)
    assert 0 < s.round_metrics(accepted)["cpa-self-weight"] < 1


def test_without_cpa_prompts_are_the_platforms_average():
    s, arrays = strategy(**{"c2prompt.cpa": False})
    shape = (len(s.model.layers), s.layout.components_per_task, 5)
    h0 = np.zeros(shape)
    h0[:, 0, 0] = 1.0
    h1 = np.zeros(shape)
    h1[:, 1, 1] = 1.0
    replies = [reply(s, arrays, 0, h0, 1.0), reply(s, arrays, 0, h1, 4.0)]
    s.round_arrays = arrays
    out = from_array_record(s.aggregate(accepted_of(replies, tasks=0, weights=[2.0, 1.0])))
    base = from_array_record(arrays)
    name = f"prompt.p{s.model.layers[0]}"
    np.testing.assert_allclose(out[name], base[name] + 2.0, rtol=1e-5)


def test_statistics_are_asked_once_per_client_and_task_and_pooled_over_every_report():
    s, arrays = strategy()
    dim = from_array_record(arrays)["head.weight"].shape[1]
    shape = (len(s.model.layers), s.layout.components_per_task, 5)
    rng = np.random.default_rng(3)
    samples = {(client, c): rng.normal(c, 1.0 + client, (3 + 5 * client + c, dim)) for client in range(3) for c in (0, 2)}
    replies = []
    for client in range(3):
        x = np.concatenate([samples[(client, c)] for c in (0, 2)])
        labels = np.concatenate([np.full(len(samples[(client, c)]), c) for c in (0, 2)])
        replies.append(reply(s, arrays, 0, np.ones(shape), 0.0, from_array_record(class_statistics(x, labels)),
                             n=len(x)))
    s.round_arrays = arrays
    accepted = accepted_of(replies, tasks=0)
    for a in accepted:
        a.sent.config[UPLOAD_STATS] = True
        assert s.check_records(a.reply, a.sent) is None
    s.consolidate(1, s.aggregate(accepted), accepted)
    for c in (0, 2):
        union = np.concatenate([samples[(client, c)] for client in range(3)])
        n, mean, var = s.global_distribution(c)
        assert n == len(union)
        np.testing.assert_allclose(mean, union.mean(0), atol=1e-5)  # float32 on the wire
        np.testing.assert_allclose(var, union.var(0), rtol=1e-4, atol=1e-5)
    # the next round asks nobody who has reported, and sends the global Gaussians of the task's classes
    global_record = from_array_record(s.global_record(0))
    np.testing.assert_array_equal(global_record["classes"], [0, 2])
    assert all((client, 0) in s.received for client in range(3))
    unasked = accepted[0]
    unasked.sent.config[UPLOAD_STATS] = False
    assert "did not ask" in s.check_records(unasked.reply, unasked.sent)
    # a checkpoint keeps the reports
    restored, _ = strategy()
    restored.load_state_dict(s.state_dict())
    np.testing.assert_allclose(restored.global_distribution(2)[1], s.global_distribution(2)[1])
    assert restored.received == s.received


def test_options_are_validated_and_checked_against_the_run():
    with pytest.raises(ConfigError, match="comp-prob"):
        C2PromptOptions.from_options({"comp-prob": 1.5})
    with pytest.raises(ConfigError, match="global-stats"):
        C2PromptOptions.from_options({"global-stats": "full"})
    with pytest.raises(ConfigError, match="comp-length"):
        check_options(C2PromptOptions.from_options({"comp-attach": "add", "comp-length": 3,
                                                    "comp-schedule": "every-round"}), tiny_config())
    with pytest.raises(ConfigError, match="comp-schedule = every-round"):  # "once" trains the tokens alone
        C2PromptOptions.from_options({"comp-attach": "add"})
    with pytest.raises(ConfigError, match="even"):
        check_options(C2PromptOptions.from_options({"comp-length": 3}), tiny_config(prompt_mode="prefix"))


# ---------------------------------------------------------------------------- end to end
@pytest.mark.simulation
def test_c2prompt_asynchronous_federation_runs_and_its_global_distributions_are_every_reports(tmp_path):
    """Three clients, two tasks, every round 2 of 3 move on: round 2 has both tasks in flight."""
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "c2", strategy="c2prompt", lr=0.01, **PLAIN_MEAN,
                       **{"switch-every": 1, "switch-fraction": 0.5})
    rounds = results["rounds"]
    assert [sorted(r["client_tasks"]) for r in rounds] == [[0, 0, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert all(r["clients_aggregated"] == 3 and not r["rejected"] for r in rounds)
    # every class of both tasks has a global distribution once each task has been reported
    assert [r["strategy_metrics"]["global-classes"] for r in rounds] == [5.0, 10.0, 10.0, 10.0]
    assert all(0 < r["strategy_metrics"]["cpa-self-weight"] <= 1 for r in rounds)
    acc = results["accuracy_matrix"]
    assert acc[1][0] is None and all(v is not None and 0 <= v <= 100 for v in (acc[0][0], acc[0][1], acc[1][1]))
