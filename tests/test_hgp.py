"""HGP: options, prompting, generative prototypes on the wire, mixtures, sampling, rebalancing, end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.runtime import model_spec
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.hgp.gaussians import (
    build_mixture,
    class_statistics,
    class_weights,
    decode_class_stats,
    sample_features,
)
from promptfcl.strategies.hgp.options import HGPOptions
from promptfcl.strategies.hgp.prompt import HGPPrompt
from promptfcl.strategies.hgp.records import STATS
from promptfcl.strategies.hgp.strategy import HGPStrategy
from tests.conftest import PLAIN_MEAN, tiny_config
from tests.helpers import accepted_of


# ---------------------------------------------------------------------------- helpers
def make_strategy(num_classes: int = 4, num_tasks: int = 2, task: int = 0, **options) -> HGPStrategy:
    cfg = tiny_config(**{"num-tasks": num_tasks, "strategy": "hgp"})
    strategy = HGPStrategy.of(cfg, num_classes, {k.replace("_", "-"): v for k, v in options.items()})
    strategy.task = task
    return strategy


def reply_with(stats_record, n: int | None = None) -> RecordDict:
    """A client reply carrying ``stats_record``; num-examples defaults to the sum of its counts."""
    n = int(stats_record["counts"].numpy().sum()) if n is None else n
    return RecordDict({ARRAYS: to_array_record({"head.bias": np.zeros(1, np.float32)}),
                       METRICS: MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1}), STATS: stats_record})


def gaussian_data(means: torch.Tensor, n_per_class: list[int], scale: float, gen: torch.Generator):
    xs, ys = [], []
    for c, n in enumerate(n_per_class):
        xs.append(means[c] + scale * torch.randn(n, means.shape[1], generator=gen))
        ys.append(torch.full((n,), c, dtype=torch.long))
    return torch.cat(xs), torch.cat(ys)


def random_spd(dim: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    a = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    return scale * (a @ a.T / dim + 0.1 * torch.eye(dim, dtype=torch.float64))


# ---------------------------------------------------------------------------- options
def test_options_defaults_and_validation():
    opts = HGPOptions.from_options({})
    assert (opts.cov_type, opts.rebalance_old, opts.rebalance_cur, opts.loss) == ("full", True, True, "ce")
    parsed = HGPOptions.from_options({"cov-type": "diag", "rebalance-old": "false", "samples-per-class": 8.0})
    assert parsed.cov_type == "diag" and parsed.rebalance_old is False and parsed.samples_per_class == 8
    for bad in ({"cov-typ": "full"}, {"cov-type": "banded"}, {"cov-multiplier": 0}, {"rebalance-old": "maybe"},
                {"samples-per-class": 2.5}, {"loss": "focal"}):
        with pytest.raises(ConfigError, match="hgp"):
            HGPOptions.from_options(bad)
        with pytest.raises(ConfigError, match="hgp"):
            HGPStrategy.parse_options(bad)  # what the CLI runs before any training


# ---------------------------------------------------------------------------- prompting
def test_prompt_weights_are_normalised_cosines_with_keys_only():
    p = HGPPrompt(16, [0, 1], 8, 4, 4)
    gen = torch.Generator().manual_seed(0)
    for t in range(4):
        p.init_task_slice(t, gen)
    assert not any(name.startswith("a") for name, _ in p.named_parameters())  # no attention vectors
    p.eval()
    p.set_task(2)
    q = torch.randn(5, 16)
    w = p.weights(q, 0)
    assert w.shape == (5, 6)
    cos = torch.nn.functional.cosine_similarity(q[:, None, :], p.k0[:6][None], dim=-1)
    torch.testing.assert_close(w, cos / cos.abs().sum(1, keepdim=True))
    torch.testing.assert_close(w.abs().sum(1), torch.ones(5))
    p.train()
    p(q, 0).sum().backward()
    assert p.k0.grad[4:6].abs().sum() > 0 and p.k0.grad[:4].abs().sum() == 0  # earlier slices frozen


@pytest.mark.parametrize("norm", ["l1", "softmax", "none"])
def test_score_normalisation_is_an_option_every_builder_of_the_model_reads(norm):
    """hgp.score-norm: l1 (the project's reading, default), softmax, or none (CODA-P's plain
    cosine); build_model and the server's prompt_from both configure the prompt from the run."""
    from promptfcl.common.model.prompted import build_model

    cfg = tiny_config(strategy="hgp", **{"hgp.score-norm": norm})
    model, _ = build_model(model_spec(cfg, 10), HGPPrompt)
    p = model.prompt
    assert p.score_norm == norm
    p.eval()
    p.set_task(1)
    q = torch.randn(5, p.embed_dim)
    cos = torch.nn.functional.cosine_similarity(q[:, None, :], p.k0[: 2 * p.per_task][None], dim=-1)
    expected = {"l1": cos / cos.abs().sum(1, keepdim=True), "softmax": cos.softmax(1), "none": cos}[norm]
    torch.testing.assert_close(p.weights(q, p.layers[0]), expected)
    s = HGPStrategy.of(cfg, 10)
    assert s.prompt_from({k: v.numpy() for k, v in model.trainable_state().items()}).score_norm == norm
    with pytest.raises(ConfigError, match="score-norm"):
        HGPOptions.from_options({"score-norm": "l2"})


@pytest.mark.parametrize("cov_type, statistics", [("full", 10 * (2 + 768 + 768 * 769 // 2)),
                                                   ("diag", 10 * (2 + 768 + 768))])
def test_stateful_count_is_the_papers_current_slice_up_and_whole_head_down(cov_type, statistics):
    """The exchange as the paper counts it at CIFAR-100's dimensions (pool 100 over 10 tasks, 5
    prefix blocks, L = 8, D = 768): down, the task's slice of components and keys and the whole
    rebalanced head; up, the slice and the task's 10 head rows; the class statistics apart."""
    cfg = tiny_config(strategy="hgp", num_tasks=10, pool_size=100, prompt_length=8, prompt_layers="0,1,2,3,4")
    s = HGPStrategy.of(cfg, 100, {"cov-type": cov_type})
    d = 768
    state = {**{f"prompt.p{layer}": np.zeros((100, 8, d), np.float32) for layer in range(5)},
             **{f"prompt.k{layer}": np.zeros((100, d), np.float32) for layer in range(5)},
             "head.weight": np.zeros((100, d), np.float32), "head.bias": np.zeros(100, np.float32)}
    slice_ = 5 * 10 * (8 * d + d)  # 345,600
    assert s.stateful_parameters(to_array_record(state)) == {
        "s2c": slice_ + 100 * (d + 1), "c2s": slice_ + 10 * (d + 1), "c2s-statistics": statistics}
    assert slice_ + 100 * (d + 1) == 422_500


# ---------------------------------------------------------------------------- statistics on the wire
@pytest.mark.parametrize("cov_type", ["full", "diag", "lowrank"])
def test_class_statistics_encode_counts_means_and_covariances(cov_type):
    gen = torch.Generator().manual_seed(1)
    dim = 12
    x, y = gaussian_data(torch.randn(3, dim, generator=gen) * 3, [40, 1, 4], 1.0, gen)
    y = y + 5  # arbitrary class ids travel unchanged
    opts = HGPOptions.from_options({"cov-type": cov_type, "cov-rank": 4})
    stats = decode_class_stats(from_array_record(class_statistics(x, y, opts)), dim)
    assert stats.classes.tolist() == [5, 6, 7] and stats.counts.tolist() == [40, 1, 4]
    for row, c in enumerate([5, 6, 7]):
        xc = x[y == c].double()
        torch.testing.assert_close(stats.means[row], xc.mean(0), atol=1e-5, rtol=1e-5)
        true_cov = torch.cov(xc.T) if len(xc) > 1 else torch.zeros(dim, dim, dtype=torch.float64)
        if cov_type == "full":
            torch.testing.assert_close(stats.cov[row], true_cov, atol=1e-5, rtol=1e-5)
        elif cov_type == "diag":
            torch.testing.assert_close(stats.cov[row], torch.diagonal(true_cov), atol=1e-5, rtol=1e-5)
        else:
            approx = stats.factor[row] @ stats.factor[row].T + torch.diag(stats.diag[row])
            torch.testing.assert_close(torch.diagonal(approx), torch.diagonal(true_cov), atol=1e-5, rtol=1e-5)
            if len(xc) - 1 <= 4:  # rank <= r: the low-rank encoding is exact
                torch.testing.assert_close(approx, true_cov, atol=1e-5, rtol=1e-5)
    if cov_type == "lowrank":  # 40 samples in 12 dims: rank 4 keeps the top of the spectrum
        xc = x[y == 5].double()
        top = torch.linalg.eigvalsh(torch.cov(xc.T))[-4:]
        torch.testing.assert_close(torch.linalg.eigvalsh(stats.factor[0] @ stats.factor[0].T)[-4:], top,
                                   atol=1e-5, rtol=1e-5)


def test_ledoit_wolf_shrinkage_makes_a_few_samples_covariance_full_rank():
    """A client-class cell with fewer samples than D has a singular covariance (its synthetic
    features stay in the span of its samples); Ledoit-Wolf shrinks it toward mu I by
    scikit-learn's intensity, keeping the trace, and it is then full rank."""
    from sklearn.covariance import ledoit_wolf_shrinkage

    gen = torch.Generator().manual_seed(3)
    dim = 24
    x, y = gaussian_data(torch.randn(1, dim, generator=gen), [10], 1.0, gen)  # 10 samples in 24 dims
    plain = decode_class_stats(from_array_record(class_statistics(x, y, HGPOptions())), dim).cov[0]
    opts = HGPOptions.from_options({"cov-shrinkage": "ledoit-wolf"})
    shrunk = decode_class_stats(from_array_record(class_statistics(x, y, opts)), dim).cov[0]
    def spectrum(cov):  # eigenvalues relative to the largest
        values = torch.linalg.eigvalsh(cov)
        return values / values[-1]

    assert (spectrum(plain) < 1e-5).sum() == dim - 9  # rank n - 1 = 9 (up to float32 on the wire)
    assert spectrum(shrunk).min() > 1e-2  # full rank, well conditioned
    s = float(ledoit_wolf_shrinkage(x.double().numpy()))
    assert 0 < s < 1
    mu = torch.diagonal(plain).mean()
    torch.testing.assert_close(shrunk, (1 - s) * plain + s * mu * torch.eye(dim, dtype=torch.float64),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.trace(shrunk), torch.trace(plain), atol=1e-4, rtol=1e-5)
    with pytest.raises(ConfigError, match="cov-shrinkage applies to cov-type = full"):
        HGPOptions.from_options({"cov-shrinkage": "ledoit-wolf", "cov-type": "diag"})


def test_float16_transport_is_close_and_smaller():
    gen = torch.Generator().manual_seed(2)
    x, y = gaussian_data(torch.randn(2, 32, generator=gen), [50, 50], 2.0, gen)
    full32 = class_statistics(x, y, HGPOptions.from_options({}))
    full16 = class_statistics(x, y, HGPOptions.from_options({"cov-dtype": "float16"}))
    a, b = decode_class_stats(from_array_record(full32), 32), decode_class_stats(from_array_record(full16), 32)
    torch.testing.assert_close(b.cov, a.cov, atol=5e-3, rtol=2e-3)
    assert from_array_record(full16)["cov-triu"].nbytes * 2 == from_array_record(full32)["cov-triu"].nbytes


def test_malformed_statistics_are_rejected():
    good = from_array_record(class_statistics(torch.randn(6, 4), torch.tensor([0, 0, 0, 1, 1, 1]),
                                              HGPOptions.from_options({"cov-type": "diag"})))
    decode_class_stats(good, 4)
    for change in ({"means": np.full((2, 4), np.nan, np.float32)}, {"counts": np.array([3, -1])},
                   {"cov-diag": np.zeros((2, 5), np.float32)}, {"classes": np.array([1, 1])}):
        with pytest.raises(ValueError):
            decode_class_stats({**good, **change}, 4)
    with pytest.raises(ValueError):
        decode_class_stats(good, 5)  # wrong feature width


# ---------------------------------------------------------------------------- mixtures and sampling
def stats_record(counts: dict[int, int], means: dict[int, torch.Tensor], dim: int, spread: float = 0.01,
                 cov_type: str = "full", seed: int = 0):
    """A client's class-stats record built from real samples around given means."""
    gen = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c, n in counts.items():
        xs.append(means[c] + spread * torch.randn(n, dim, generator=gen))
        ys.append(torch.full((n,), c))
    return class_statistics(torch.cat(xs), torch.cat(ys), HGPOptions.from_options({"cov-type": cov_type}))


def test_mixture_weights_follow_the_counts_at_both_tiers():
    dim = 6
    strategy = make_strategy(num_classes=6, num_tasks=2, task=0, cov_multiplier=1.0)  # task 0: classes 0, 1, 2
    # every (class, client) component has its own, well separated mean, so samples reveal their component
    centres = {(c, k): torch.full((dim,), 10.0 * (3 * c + k)) for c in range(3) for k in range(2)}
    client0 = stats_record({0: 30, 1: 12}, {0: centres[0, 0], 1: centres[1, 0]}, dim, seed=1)
    client1 = stats_record({0: 10, 2: 8}, {0: centres[0, 1], 2: centres[2, 1]}, dim, seed=2)
    strategy.ingest([reply_with(client0), reply_with(client1)])
    mixtures = strategy.rebalance_mixtures()
    assert [m.label for m in mixtures] == [0, 1, 2]
    torch.testing.assert_close(mixtures[0].weights, torch.tensor([0.75, 0.25], dtype=torch.float64))  # Tier 1
    torch.testing.assert_close(class_weights(mixtures), torch.tensor([40, 12, 8], dtype=torch.float64) / 60)  # Tier 2
    torch.testing.assert_close(class_weights(mixtures, "uniform"), torch.full((3,), 1 / 3, dtype=torch.float64))

    n = 30_000
    x, labels = sample_features(mixtures, class_weights(mixtures), n, 1.0, torch.Generator().manual_seed(3))
    component = torch.round(x[:, 0] / 10.0).long()  # 3 * class + client
    assert torch.equal(component // 3, labels)
    freq = torch.bincount(component, minlength=9).double() / n
    expected = torch.zeros(9, dtype=torch.float64)
    expected[[0, 1, 3, 7]] = torch.tensor([30, 10, 12, 8], dtype=torch.float64) / 60
    assert (freq - expected).abs().max() < 0.01


@pytest.mark.parametrize("multiplier", [1.0, 3.0])
def test_samples_have_the_two_client_mixtures_mean_and_covariance(multiplier):
    dim, gen = 5, torch.Generator().manual_seed(4)
    means = torch.randn(2, dim, generator=gen, dtype=torch.float64) * 2
    covs = torch.stack([random_spd(dim, gen), random_spd(dim, gen, 0.5)])
    counts = torch.tensor([70.0, 30.0], dtype=torch.float64)
    mixture = build_mixture(0, counts, means, "full", covs, None, None, eps=0.0)
    x, _ = sample_features([mixture], torch.ones(1), 200_000, multiplier, torch.Generator().manual_seed(5))
    pi = counts / counts.sum()
    mu = (pi[:, None] * means).sum(0)
    second = sum(pi[k] * (multiplier * covs[k] + torch.outer(means[k], means[k])) for k in range(2))
    cov = second - torch.outer(mu, mu)
    torch.testing.assert_close(x.double().mean(0), mu, atol=0.02, rtol=0)
    torch.testing.assert_close(torch.cov(x.double().T), cov, atol=0.06 * multiplier, rtol=0.03)


@pytest.mark.parametrize("cov_type", ["diag", "lowrank"])
def test_diag_and_lowrank_components_sample_their_encoded_covariance(cov_type):
    gen = torch.Generator().manual_seed(6)
    x, y = gaussian_data(torch.zeros(1, 8, dtype=torch.float32), [400], 1.0, gen)
    x = x @ torch.randn(8, 8, generator=gen)  # correlated features
    stats = decode_class_stats(from_array_record(class_statistics(x, y, HGPOptions.from_options(
        {"cov-type": cov_type, "cov-rank": 8}))), 8)
    mixture = build_mixture(0, stats.counts, stats.means, stats.kind, stats.cov, stats.factor, stats.diag, eps=0.0)
    sample, _ = sample_features([mixture], torch.ones(1), 100_000, 1.0, torch.Generator().manual_seed(7))
    target = torch.cov(x.double().T)
    if cov_type == "diag":
        target = torch.diag(torch.diagonal(target))
    scale = target.abs().max()
    torch.testing.assert_close(torch.cov(sample.double().T) / scale, target / scale, atol=0.03, rtol=0)


def test_degenerate_statistics_still_sample_and_rebalance():
    dim = 16
    strategy = make_strategy(num_classes=4, num_tasks=2, task=0, samples_per_class=64)
    gen = torch.Generator().manual_seed(8)
    one_sample = class_statistics(torch.randn(1, dim, generator=gen) * 1e3, torch.tensor([0]),
                                  HGPOptions.from_options({"cov-dtype": "float16"}))  # seen once, huge values
    singular = class_statistics(torch.randn(3, dim, generator=gen), torch.tensor([1, 1, 1]),
                                HGPOptions.from_options({}))  # rank 2 in 16 dims
    broken = from_array_record(singular)  # a covariance with a negative eigenvalue (e.g. lossy transport)
    broken["cov-triu"] = broken["cov-triu"].copy()
    broken["cov-triu"][0, 0] = -5.0
    zero_count = from_array_record(singular)
    zero_count["counts"] = np.array([0])
    strategy.ingest([reply_with(one_sample), reply_with(singular), reply_with(to_array_record(broken)),
                     reply_with(to_array_record(zero_count))])
    mixtures = strategy.rebalance_mixtures()
    assert [len(m.counts) for m in mixtures] == [1, 2]  # the zero-count component is dropped
    x, y = sample_features(mixtures, class_weights(mixtures), 500, 3.0, torch.Generator().manual_seed(9))
    assert torch.isfinite(x).all() and set(y.tolist()) == {0, 1}
    head = {"head.weight": np.random.default_rng(0).normal(size=(4, dim)).astype(np.float32),
            "head.bias": np.zeros(4, np.float32)}
    out = from_array_record(strategy.consolidate(1, to_array_record(head), []))
    assert np.isfinite(out["head.weight"]).all() and not np.allclose(out["head.weight"], head["head.weight"])
    assert np.array_equal(out["head.weight"][2:], head["head.weight"][2:])  # unseen classes untouched


def test_no_statistics_leaves_the_head_unchanged():
    """Replies without statistics (a client with nothing to report) leave the head as it is; bad
    statistics never get this far: check_reply excludes the reply (tests/test_hostile.py)."""
    strategy = make_strategy()
    head = to_array_record({"head.weight": np.ones((4, 8), np.float32), "head.bias": np.zeros(4, np.float32)})
    out = strategy.consolidate(1, head, accepted_of([RecordDict({METRICS: MetricRecord({"num-examples": 3})})]))
    assert out is head


# ---------------------------------------------------------------------------- rebalancing
def biased_setup(dim: int = 16, seed: int = 10):
    """4 Gaussian classes (task 0: 0, 1; task 1: 2, 3) and a head that favours the newest task."""
    gen = torch.Generator().manual_seed(seed)
    means = torch.randn(4, dim, generator=gen)
    train_x, train_y = gaussian_data(means, [60] * 4, 1.0, gen)
    test_x, test_y = gaussian_data(means, [500] * 4, 1.0, gen)
    weight = means.clone()  # a nearest-mean classifier ...
    bias = -0.5 * (means**2).sum(1)
    bias[2:] += 20.0  # ... biased towards the classes of the newest task
    return train_x, train_y, test_x, test_y, weight, bias


def per_class_accuracy(weight, bias, x, y):
    pred = (x @ weight.T + bias).argmax(1)
    return torch.stack([(pred[y == c] == c).double().mean() for c in range(4)])


@pytest.mark.parametrize("loss", ["ce", "logit-norm"])
def test_rebalancing_fixes_a_head_biased_toward_the_newest_classes(loss):
    train_x, train_y, test_x, test_y, weight, bias = biased_setup()
    before = per_class_accuracy(weight, bias, test_x, test_y)
    assert before[:2].max() < 0.3  # old classes are mostly predicted as new ones
    strategy = make_strategy(task=1, loss=loss, rebalance_lr=0.05, rebalance_batch_size=32, cov_multiplier=1.0)
    # task 0's prototypes arrived in an earlier round, task 1's now; two clients each
    first, second = (train_y % 2 == 0), (train_y % 2 == 1)
    halves = [torch.arange(len(train_y)) < 120, torch.arange(len(train_y)) >= 120]
    strategy.task = 0
    strategy.ingest([reply_with(class_statistics(train_x[halves[0] & m], train_y[halves[0] & m], strategy.opts))
                     for m in (first, second)])
    strategy.task = 1
    strategy.ingest([reply_with(class_statistics(train_x[halves[1] & m], train_y[halves[1] & m], strategy.opts))
                     for m in (first, second)])
    head = to_array_record({"head.weight": weight.numpy(), "head.bias": bias.numpy()})
    out = from_array_record(strategy.consolidate(7, head, []))
    after = per_class_accuracy(torch.from_numpy(out["head.weight"]), torch.from_numpy(out["head.bias"]), test_x, test_y)
    assert after.min() > 0.85, (before, after)
    assert strategy.last_rebalance["classes"] == 4


def test_rebalancing_switches_select_the_sampled_classes():
    train_x, train_y, test_x, test_y, weight, bias = biased_setup()
    results = {}
    for old, cur in ((False, False), (True, False), (False, True), (True, True)):
        strategy = make_strategy(task=0, rebalance_old=old, rebalance_cur=cur, rebalance_lr=0.05,
                                 rebalance_batch_size=32)
        strategy.ingest([reply_with(class_statistics(train_x[train_y < 2], train_y[train_y < 2], strategy.opts))])
        strategy.task = 1
        strategy.ingest([reply_with(class_statistics(train_x[train_y >= 2], train_y[train_y >= 2], strategy.opts))])
        assert [m.label for m in strategy.rebalance_mixtures()] == [0, 1] * old + [2, 3] * cur
        head = to_array_record({"head.weight": weight.numpy(), "head.bias": bias.numpy()})
        out = strategy.consolidate(3, head, [])
        if not (old or cur):
            assert out is head  # neither: plain FedAvg-Prompt with HGP's prompting
        arrays = from_array_record(out)
        results[old, cur] = per_class_accuracy(torch.from_numpy(arrays["head.weight"]),
                                               torch.from_numpy(arrays["head.bias"]), test_x, test_y)
    # CR_old alone lifts the old classes; CR_cur alone, seeing no old class, cannot
    assert results[True, False][:2].mean() > results[False, False][:2].mean() + 0.5
    assert results[False, True][:2].mean() < 0.3


def test_sampled_logits_leave_unsampled_classes_alone():
    train_x, train_y, _, _, weight, bias = biased_setup()
    strategy = make_strategy(task=1, rebalance_old=False, rebalance_logits="sampled")
    strategy.ingest([reply_with(class_statistics(train_x[train_y >= 2], train_y[train_y >= 2], strategy.opts))])
    head = to_array_record({"head.weight": weight.numpy(), "head.bias": bias.numpy()})
    out = from_array_record(strategy.consolidate(3, head, []))
    assert np.array_equal(out["head.weight"][:2], weight[:2].numpy())  # old classes take no part
    assert not np.allclose(out["head.weight"][2:], weight[2:].numpy())


def test_state_dict_restores_every_mixture():
    train_x, train_y, *_ = biased_setup()
    strategy = make_strategy(task=0, cov_type="lowrank", cov_dtype="float16")
    strategy.ingest([reply_with(class_statistics(train_x[train_y < 2], train_y[train_y < 2], strategy.opts))])
    strategy.task = 1
    strategy.ingest([reply_with(class_statistics(train_x[train_y >= 2], train_y[train_y >= 2], strategy.opts))])
    restored = make_strategy(cov_type="lowrank", cov_dtype="float16")
    restored.load_state_dict(strategy.state_dict())
    assert restored.task == 1
    for a, b in zip(strategy.rebalance_mixtures(), restored.rebalance_mixtures()):
        assert a.label == b.label
        torch.testing.assert_close(a.covariances(), b.covariances())


# ---------------------------------------------------------------------------- client and end to end
def test_learner_uploads_the_statistics_of_its_prompted_features():
    from promptfcl.common.model.runtime import get_runtime
    from promptfcl.strategies.hgp.learner import HGPLearner

    cfg = tiny_config(strategy="hgp", **{"hgp.cov-type": "diag"})
    rt = get_runtime(cfg, HGPPrompt)
    learner = HGPLearner.of(cfg, rt, cfg.method_options("hgp"))
    index = np.flatnonzero(rt.data.train.labels < 5)[:50]
    rt.model.prompt.set_task(0)
    record = learner.round_end(index, task=0)[STATS]
    stats = decode_class_stats(from_array_record(record), rt.model.embed_dim)
    labels = rt.data.train.labels[index]
    assert stats.counts.sum() == 50 and set(stats.classes.tolist()) == set(labels.tolist())
    feats, _ = learner.prompted_features(index, 0)
    for row, c in enumerate(stats.classes.tolist()):
        torch.testing.assert_close(stats.means[row].float(), feats[torch.from_numpy(labels == c)].mean(0),
                                   atol=1e-4, rtol=1e-4)


def test_statistics_with_augmentation_are_taken_over_seeded_augmented_views():
    """augment = crop-flip: hgp.stats-augment takes each image through one augmented view (q(x) on
    the view); stats-augment = false, or augment = none, uses the stored images."""
    from promptfcl.common.data.augment import augment_images
    from promptfcl.common.model.runtime import get_runtime
    from promptfcl.strategies.hgp.learner import HGPLearner

    index = None
    feats = {}
    for augment, stats_augment in (("none", True), ("crop-flip", False), ("crop-flip", True)):
        cfg = tiny_config(strategy="hgp", augment=augment, **{"hgp.stats-augment": stats_augment})
        rt = get_runtime(cfg, HGPPrompt)
        learner = HGPLearner.of(cfg, rt, cfg.method_options("hgp"))
        learner.seed = [cfg.run.seed, 3, 0, 1]  # as fit sets it: (seed, client, task, round)
        index = np.flatnonzero(rt.data.train.labels < 5)[:40]
        rt.model.prompt.set_task(0)
        feats[augment, stats_augment], _ = learner.prompted_features(index, 0)
    clean = feats["none", True]
    torch.testing.assert_close(feats["crop-flip", False], clean)
    assert not torch.allclose(feats["crop-flip", True], clean)
    views = augment_images(rt.data.train.images[index], "crop-flip", np.random.default_rng([0, 3, 0, 1, 0x57A75]))
    with torch.no_grad():
        x = rt.model.preprocess(torch.from_numpy(views))
        expected = rt.model.features(x, rt.model.query(x))
    torch.testing.assert_close(feats["crop-flip", True], expected)


@pytest.mark.e2e
def test_hgp_end_to_end_simulation(tmp_path):
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "hgp", strategy="hgp", lr=0.01, **PLAIN_MEAN, **{"hgp.samples-per-class": 64})
    assert results["config"]["strategy"] == "hgp"
    acc = results["accuracy_matrix"]
    assert acc[1][0] is None and all(0 <= v <= 100 for row in acc for v in row if v is not None)
    dim = results["config"]["embed-dim"]
    for r in results["rounds"]:
        assert r["clients_aggregated"] == r["clients_sampled"] and not r["rejected"]
        # each reply carries at least one class's mean and packed full covariance on top of the parameters
        extra = (r["bytes_c2s"] - r["bytes_s2c"]) / r["clients_sampled"]
        assert extra >= 4 * (dim + dim * (dim + 1) // 2)


# ---------------------------------------------------------------------------- asynchronous arrival
def async_strategy(**options) -> HGPStrategy:
    """4 clients, 2 tasks of 2 classes, 2 rounds per task; every round 2 clients move on."""
    cfg = tiny_config(**{"num-tasks": 2, "num-clients": 4, "clients-per-round": 4, "rounds-per-task": 2,
                         "switch-every": 1, "switch-fraction": 0.5, "strategy": "hgp"})
    return HGPStrategy.of(cfg, 4, {k.replace("_", "-"): v for k, v in options.items()})


def client_stats(client: int, classes: list[int], dim: int = 6):
    """Statistics whose class means encode the client (100 * client + class), so rows can be traced."""
    return stats_record({c: 5 for c in classes}, {c: torch.full((dim,), 100.0 * client + c) for c in classes},
                        dim, seed=client)


def mixture_clients(strategy: HGPStrategy, label: int) -> list[int]:
    """The clients whose components make ``label``'s mixture, read back from the component means."""
    m = strategy.mixture(label)
    return sorted(int(round((float(mu[0]) - label) / 100.0)) for mu in m.means)


def test_async_statistics_are_kept_per_class_and_client_over_several_rounds():
    strategy = async_strategy()
    schedule = strategy.schedule
    fast = sorted(c for c in range(4) if schedule.position(c, 1) == 1)
    slow = sorted(set(range(4)) - set(fast))
    assert len(fast) == 2 and all(schedule.position(c, 2) == 1 for c in range(4))

    def round_(server_round: int, reports: dict[int, tuple[int, list[int]]]) -> None:
        clients = sorted(reports)
        strategy.ingest([reply_with(client_stats(c, reports[c][1])) for c in clients], server_round,
                        [(c, reports[c][0]) for c in clients])

    # round 1: everyone on task 0
    round_(1, {c: (0, [0, 1]) for c in range(4)})
    assert mixture_clients(strategy, 0) == [0, 1, 2, 3]
    # round 2: the fast clients on task 1 (two tasks in flight); one slow client reports task 0 again
    round_(2, {fast[0]: (1, [2, 3]), fast[1]: (1, [2, 3]), slow[0]: (0, [0, 1])})
    # the fast clients have left task 0: their last statistics stay; slow[0]'s newer ones replace its
    # older; slow[1], still on task 0 and not reporting, is superseded by the round's fresher report
    assert mixture_clients(strategy, 0) == sorted(fast + [slow[0]])
    assert mixture_clients(strategy, 2) == fast
    assert strategy.class_stats[0]["rounds"].tolist() == [1, 1, 2]
    both = strategy.tasks_in_flight(1)
    assert list(both) == [0, 1]
    assert [m.label for m in strategy.rebalance_mixtures(both)] == [0, 1, 2, 3]  # CR_cur: both tasks
    old_only = async_strategy(rebalance_cur=False)
    old_only.class_stats, old_only.task = strategy.class_stats, 1
    assert old_only.rebalance_mixtures(both) == []  # no task has been left by every client yet
    # round 3: everyone on task 1; fast[0] and slow[1] report, fast[1] (still on task 1) is superseded
    round_(3, {fast[0]: (1, [2, 3]), slow[1]: (1, [2])})
    assert mixture_clients(strategy, 2) == sorted([fast[0], slow[1]])
    assert mixture_clients(strategy, 3) == [fast[0]]
    assert mixture_clients(strategy, 0) == sorted(fast + [slow[0]])  # task 0's classes: nobody reported them
    later = strategy.tasks_in_flight(2)
    assert list(later) == [1]
    old_only.class_stats = strategy.class_stats
    assert [m.label for m in old_only.rebalance_mixtures(later)] == [0, 1]  # CR_old: task 0, left by all
    cur_only = async_strategy(rebalance_old=False)
    cur_only.class_stats = strategy.class_stats
    assert [m.label for m in cur_only.rebalance_mixtures(later)] == [2, 3]
    # the checkpoint keeps clients and rounds
    restored = async_strategy()
    restored.load_state_dict(strategy.state_dict())
    for c in range(4):
        assert mixture_clients(restored, c) == mixture_clients(strategy, c)


def test_async_reply_statistics_must_be_of_the_task_the_server_sent(flower_identity):
    from flwr.app import ConfigRecord, Message

    from tests.helpers import NodeList

    strategy = async_strategy()
    dim = 6
    arrays = to_array_record({"head.weight": np.zeros((4, dim), np.float32), "head.bias": np.zeros(4, np.float32)})
    strategy.task = 1  # the fast clients' task has started
    sent = list(strategy.configure_train(2, arrays, ConfigRecord({"task": 0, "round": 1}), NodeList(4)))
    tasks = {int(m.content["config"]["client-id"]): int(m.content["config"]["task"]) for m in sent}
    assert sorted(tasks.values()) == [0, 0, 1, 1]

    def reply(msg: Message, classes: list[int]) -> Message:
        stats = client_stats(int(msg.content["config"]["client-id"]), classes, dim)
        content = reply_with(stats)
        content[ARRAYS] = arrays
        return Message(content=content, reply_to=msg)

    for msg in sent:
        own = [0, 1] if tasks[int(msg.content["config"]["client-id"])] == 0 else [2, 3]
        other = [2, 3] if own == [0, 1] else [0, 1]
        assert strategy.check_reply(reply(msg, own)) is None
        assert "outside the task it was sent" in strategy.check_reply(reply(msg, other))


@pytest.mark.e2e
def test_hgp_asynchronous_end_to_end(tmp_path):
    """Every round 2 of 3 clients move on (3 clients, 2 rounds per task): round 2 has both tasks in flight."""
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "hgp", strategy="hgp", lr=0.01, **PLAIN_MEAN,
                       **{"hgp.samples-per-class": 64, "switch-every": 1, "switch-fraction": 0.5})
    rounds = results["rounds"]
    assert [sorted(r["client_tasks"]) for r in rounds] == [[0, 0, 0], [0, 1, 1], [1, 1, 1], [1, 1, 1]]
    assert all(r["clients_aggregated"] == 3 and not r["rejected"] for r in rounds)
    acc = results["accuracy_matrix"]
    assert acc[1][0] is None and all(v is not None and 0 <= v <= 100 for v in (acc[0][0], acc[0][1], acc[1][1]))
