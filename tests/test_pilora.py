"""PILoRA ("PILoRA: Prototype Guided Incremental LoRA for Federated Class-Incremental Learning"): the
distance logits, the loss terms and where their gradients go, the incremental LoRA forward, the
prototype re-weighting's closed form, prototypes after many rounds, the class means, and a run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.prompted import build_model
from promptfcl.common.model.runtime import get_runtime, model_spec
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.pilora.learner import PILoRALearner
from promptfcl.strategies.pilora.options import PILoRAOptions
from promptfcl.strategies.pilora.prompt import (
    PILoRAAdapters,
    l1_loss,
    orthogonality_loss,
    paired_distances,
    prototype_distances,
    prototype_logits,
)
from promptfcl.strategies.pilora.prototypes import heterogeneity_weights, reweighted_prototypes
from promptfcl.strategies.pilora.records import CLASS_MEANS
from promptfcl.strategies.pilora.strategy import PILoRAStrategy
from promptfcl.strategies.platform.learner import Batch
from promptfcl.strategies.registry import learner_class, prompt_class, strategy_class
from tests.conftest import PLAIN_MEAN, tiny_config
from tests.helpers import accepted_of

NUM_CLASSES = 10  # digits: 2 tasks x 5 classes in the tiny configuration


def pilora_config(**overrides):
    return tiny_config(strategy="pilora", **{"prompt-layers": "0", **overrides})


def model_of(tasks: int = 3, **options):
    cfg = pilora_config(**{"num-tasks": tasks, **{f"pilora.{k}": v for k, v in options.items()}})
    model, _ = build_model(model_spec(cfg, NUM_CLASSES if tasks in (2, 5) else 9), PILoRAAdapters)
    return model.double().eval()


def randomise(module: torch.nn.Module, seed: int = 0) -> None:
    """Random values in every trained array (the server's column weights stay ones: PILoRA never sets them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("_w"):
                continue
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


# ---------------------------------------------------------------------------- distances and logits
def test_distance_expansion_equals_cdist_over_sqrt_d():
    g = torch.Generator().manual_seed(0)
    f, c = torch.randn(7, 16, generator=g, dtype=torch.float64) * 5, torch.randn(4, 16, generator=g, dtype=torch.float64)
    expected = torch.cdist(f, c) / 4.0  # sqrt(D) = 4
    torch.testing.assert_close(prototype_distances(f, c), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(paired_distances(f, c[[0, 1, 2, 3, 0, 1, 2]]), expected[torch.arange(7), [0, 1, 2, 3, 0, 1, 2]])
    torch.testing.assert_close(prototype_logits(f, c, 2.0), -expected / 2.0)
    # a feature on its prototype: distance ~0 with a finite gradient
    c0 = c[:1].clone().requires_grad_(True)
    prototype_distances(c[:1].clone(), c0).sum().backward()
    assert torch.isfinite(c0.grad).all()


def test_the_model_scores_by_distance_to_the_heads_rows_and_ignores_its_bias():
    model = model_of()
    randomise(model.head)
    f = torch.randn(3, model.embed_dim, dtype=torch.float64)
    expected = -torch.cdist(f, model.head.weight) / np.sqrt(model.embed_dim)
    torch.testing.assert_close(model.logits(f), expected)
    model2 = model_of(temperature=0.5)
    model2.head.load_state_dict(model.head.state_dict())
    torch.testing.assert_close(model2.logits(f), 2 * expected)


# ---------------------------------------------------------------------------- incremental LoRA
def qkv_of(model, tokens):
    block = model.backbone.blocks[0]
    return block.attn.qkv(tokens), model.prompt.adapt(0, "qkv", tokens, block.attn.qkv(tokens))


def test_incremental_lora_adds_the_sets_of_tasks_up_to_t_on_q_and_v_and_leaves_k_alone():
    model = model_of(tasks=3)
    randomise(model.prompt)
    model.prompt.set_task(1)
    d = model.embed_dim
    x = torch.randn(2, 5, d, dtype=torch.float64)
    plain, adapted = qkv_of(model, x)
    p = model.prompt
    for target, rows in (("q", slice(0, d)), ("v", slice(2 * d, 3 * d))):
        a, b = getattr(p, f"lora_{target}0_a"), getattr(p, f"lora_{target}0_b")
        delta = sum((x @ a[t].T) @ b[t].T for t in range(2))  # tasks 0 and 1, not 2
        torch.testing.assert_close(adapted[..., rows], plain[..., rows] + delta)
    torch.testing.assert_close(adapted[..., d : 2 * d], plain[..., d : 2 * d], rtol=0, atol=0)
    # the authors' code (lora-sum = false): task t's set alone
    current = model_of(tasks=3, **{"lora-sum": False})
    current.prompt.load_state_dict(p.state_dict())
    current.prompt.set_task(1)
    _, alone = qkv_of(current, x)
    a, b = p.lora_q0_a, p.lora_q0_b
    torch.testing.assert_close(alone[..., :d], plain[..., :d] + (x @ a[1].T) @ b[1].T)


def test_with_every_b_zero_or_lora_off_the_model_is_the_frozen_one():
    model = model_of(tasks=3)
    randomise(model.prompt)
    images = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    frozen = model.backbone.forward_head(model.backbone.forward_features(images), pre_logits=True)
    model.prompt.set_task(2)
    assert not torch.allclose(model.features(images, model.query(images)), frozen)
    off = model_of(tasks=3, lora=False)
    off.prompt.load_state_dict(model.prompt.state_dict())
    off.prompt.set_task(2)
    torch.testing.assert_close(off.features(images, off.query(images)), frozen)
    assert not any(p.requires_grad for p in off.prompt.parameters())
    with torch.no_grad():
        for name, param in model.prompt.named_parameters():
            if name.endswith("_b"):
                param.zero_()
    torch.testing.assert_close(model.features(images, model.query(images)), frozen)


# ---------------------------------------------------------------------------- losses
def test_orthogonality_is_zero_at_task_0_and_sums_abs_products_with_earlier_sets_then():
    model = model_of(tasks=3)
    randomise(model.prompt)
    p = model.prompt
    assert float(orthogonality_loss(p, 0)) == 0.0
    hand = sum((getattr(p, f"lora_{t}0_a")[2] @ getattr(p, f"lora_{t}0_a")[tau].T).abs().sum()
               for t in ("q", "v") for tau in (0, 1))
    torch.testing.assert_close(orthogonality_loss(p, 2), hand)
    torch.testing.assert_close(l1_loss(p, 2), p.lora_q0_a[2].abs().sum() + p.lora_v0_a[2].abs().sum())


@pytest.fixture(scope="module")
def runtime():
    cfg = pilora_config(centralised=True, **{"local-epochs": 2, "pilora.lora-lr": 1e-3})
    return cfg, get_runtime(cfg, PILoRAAdapters)


def one_batch(rt, task: int, softmax_over: str):
    """A Batch of 8 task samples as the platform's step makes it, and the platform's CE of it."""
    model = rt.model
    model.train()
    model.prompt.set_task(task)
    idx = np.flatnonzero(np.isin(rt.data.train.labels, rt.layout.classes(task)))[:8]
    x = model.preprocess(torch.from_numpy(rt.data.train.images[idx]))
    y = torch.as_tensor(rt.data.train.labels[idx])
    feats = model.features(x, model.query(x))
    allowed = torch.zeros(rt.layout.head_size, dtype=torch.bool)
    allowed[rt.layout.head_rows(task)] = True
    logits = model.logits(feats).masked_fill(~allowed[None, :], float("-inf"))
    return Batch(x, y, model.query(x), feats, logits), F.cross_entropy(logits, y)


@pytest.mark.parametrize("softmax_over", ["all", "task"])
def test_the_loss_is_the_four_terms_and_trains_only_the_current_set_and_prototypes(runtime, softmax_over):
    cfg, rt = runtime
    strategy = PILoRAStrategy.of(cfg, NUM_CLASSES)
    arrays = strategy.on_task_start(1, strategy.on_task_start(0, to_array_record(rt.model.trainable_state())))
    state = {k: torch.from_numpy(v) for k, v in from_array_record(arrays).items()}
    rt.model.load_trainable_state(state)
    with torch.no_grad():  # every set non-zero, so each term has a gradient to give
        for name, p in rt.model.prompt.named_parameters():
            p.add_(0.01 * torch.randn(p.shape))
    learner = PILoRALearner.of(cfg, rt, {"softmax-over": softmax_over, "weight-decay": 0.0})
    learner.round_start(RecordDict({"config": ConfigRecord({"client-id": 0})}), 1)
    rt.model.zero_grad()
    batch, ce_task = one_batch(rt, 1, softmax_over)
    loss = ce_task + learner.extra_loss(batch, 1)
    loss.backward()
    model, p = rt.model, rt.model.prompt
    # by hand: DCE over all classes (or the task's) + lambda PL + gamma ORT + mu L1
    w = model.head.weight.detach()
    scope = np.arange(NUM_CLASSES) if softmax_over == "all" else rt.layout.head_rows(1)
    logits = -torch.cdist(batch.features.detach().double(), w.double()[scope]) / np.sqrt(model.embed_dim)
    target = torch.as_tensor(np.searchsorted(scope, batch.labels.numpy()))
    dce = F.cross_entropy(logits, target)
    pl = (torch.linalg.norm(batch.features.detach().double() - w.double()[batch.labels], dim=1)
          / np.sqrt(model.embed_dim)).mean()
    ort = sum((getattr(p, f"lora_{t}0_a")[1] @ getattr(p, f"lora_{t}0_a")[0].T).abs().sum() for t in "qv")
    l1 = p.lora_q0_a[1].abs().sum() + p.lora_v0_a[1].abs().sum()
    hand = dce + 0.001 * pl + 0.5 * ort.double() + 0.01 * l1.double()
    assert loss.item() == pytest.approx(hand.item(), rel=1e-5)
    # gradients: the task's prototypes and task 1's set only
    grad = model.head.weight.grad
    rows = rt.layout.head_rows(1)
    assert grad[rows].abs().sum(1).min() > 0 and not grad[np.setdiff1d(np.arange(NUM_CLASSES), rows)].any()
    assert model.head.bias.grad is None or not model.head.bias.grad.any()
    for name, param in p.named_parameters():
        if name.endswith("_w"):
            assert param.grad is None
            continue
        others = [t for t in range(param.shape[0]) if t != 1]
        assert param.grad[1].abs().sum() > 0 and not param.grad[others].any(), name
    learner.round_cleanup()
    model.eval()


def test_learning_rates_are_the_authors_per_part_rates_with_their_round_cosine(runtime):
    cfg, rt = runtime
    learner = PILoRALearner.of(cfg, rt, {})
    learner.seed = [0, 0, 0, 0]
    assert learner.learning_rate("head.weight", 0) == pytest.approx(2e-3)
    assert learner.learning_rate("prompt.lora_q0_a", 0) == pytest.approx(1e-5)
    assert learner.learning_rate("head.bias", 0) is None
    flat = PILoRALearner.of(cfg, rt, {"round-schedule": "none", "prototype-lr": 0.02})
    flat.seed = [0, 0, 0, 3]
    assert flat.learning_rate("head.weight", 0) == pytest.approx(0.02)


def authors_rates(base: float, rounds: int) -> list[float]:
    """The rate each round of a task trains at, by the authors' loop (Ghy0501/PILoRA, PILoRA-cifar/VITLORA.py,
    train()) run as written: the rate is set after each round for the next one."""
    rate, used = base, []
    for epoch in range(rounds):  # their "epoch" is a global round
        used.append(rate)  # local_model.update_weights(..., lr_c=center_lr, lr_e=encoder_lr)
        rate = base * 0.5 * (1 + math.cos(epoch * math.pi / rounds))
    return used


@pytest.mark.parametrize("rounds", [3, 5, 30])
def test_round_cosine_follows_the_authors_loop_round_by_round(runtime, rounds):
    """Issue 58: the project's cosine ran one round ahead (1, 0.75, 0.25 at 3 rounds); the authors' loop
    trains round 0 at the base rate and round r >= 1 at (1 + cos((r - 1) pi / E)) / 2."""
    cfg, rt = runtime
    learner = PILoRALearner.of(cfg, rt, {})
    learner.federation = cfg.replace(rounds_per_task=rounds).federation
    ours = {"head.weight": [], "prompt.lora_q0_a": []}
    for round_ in range(rounds):
        learner.seed = [0, 0, 0, round_]
        for name, rates in ours.items():
            rates.append(learner.learning_rate(name, 0))
    np.testing.assert_allclose(ours["head.weight"], authors_rates(2e-3, rounds), rtol=1e-12)
    np.testing.assert_allclose(ours["prompt.lora_q0_a"], authors_rates(1e-5, rounds), rtol=1e-12)
    if rounds == 3:  # the sequences as issue 58 quotes them
        np.testing.assert_allclose(np.array(ours["head.weight"]) / 2e-3, [1, 1, 0.75], rtol=1e-12)
    if rounds == 5:
        np.testing.assert_allclose(np.array(ours["head.weight"]) / 2e-3, [1, 1, 0.9045085, 0.6545085, 0.3454915],
                                   rtol=1e-7)


# ---------------------------------------------------------------------------- class means
class Recording(PILoRALearner):
    """Records the features and labels of every training batch the loop hands to ``extra_loss``."""

    def extra_loss(self, batch, task):
        self.seen.append((batch.features.detach().double().clone(), batch.labels.clone()))
        return super().extra_loss(batch, task)


def test_class_means_are_the_means_of_the_features_of_every_training_batch(runtime):
    cfg, rt = runtime
    strategy = PILoRAStrategy.of(cfg, NUM_CLASSES)
    arrays = strategy.on_task_start(0, to_array_record(rt.model.trainable_state()))
    learner = Recording.of(cfg, rt, {"lora-lr": 1e-2})  # the adapters move: the features of each epoch differ
    learner.seen = []
    reply = learner.fit(RecordDict({ARRAYS: arrays, "config": ConfigRecord({"client-id": 0})}), 0, 0, 0)
    feats = torch.cat([f for f, _ in learner.seen])
    labels = torch.cat([y for _, y in learner.seen])
    rec = from_array_record(reply[CLASS_MEANS])
    assert rec["classes"].tolist() == list(range(5)) and rec["client"].tolist() == [0]
    for c, mean in zip(rec["classes"], rec["means"]):
        np.testing.assert_allclose(mean, feats[labels == int(c)].mean(0).numpy(), rtol=1e-5, atol=1e-6)
    # counts: each class's training samples (bounded by num-examples), not rows over two epochs
    assert int(reply[METRICS]["num-examples"]) == len(labels) // 2 == rec["counts"].sum()
    first, last = learner.seen[0][0], learner.seen[-1][0]
    assert len(first) and len(last)  # the epochs' features differ (the LoRA trained)
    # min-class-count above every class's row count: nothing uploaded
    none = PILoRALearner.of(cfg, rt, {"min-class-count": 10**6}).fit(
        RecordDict({ARRAYS: arrays, "config": ConfigRecord({"client-id": 0})}), 0, 0, 0)
    assert from_array_record(none[CLASS_MEANS])["means"].shape == (0, rt.model.embed_dim)


def test_separate_pass_class_means_are_the_trained_models_features(runtime):
    cfg, rt = runtime
    strategy = PILoRAStrategy.of(cfg, NUM_CLASSES)
    arrays = strategy.on_task_start(0, to_array_record(rt.model.trainable_state()))
    reply = PILoRALearner.of(cfg, rt, {"class-means": "separate-pass"}).fit(
        RecordDict({ARRAYS: arrays, "config": ConfigRecord({"client-id": 0})}), 0, 0, 0)
    rec = from_array_record(reply[CLASS_MEANS])
    rt.model.load_trainable_state({k: torch.from_numpy(v) for k, v in from_array_record(reply[ARRAYS]).items()})
    rt.model.prompt.set_task(0)
    rt.model.eval()
    idx = np.flatnonzero(rt.data.train.labels == 3)
    with torch.no_grad():
        x = rt.model.preprocess(torch.from_numpy(rt.data.train.images[idx]), evaluation=True)
        direct = rt.model.features(x, rt.model.query(x)).mean(0).numpy()
    np.testing.assert_allclose(rec["means"][3], direct, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------- re-weighting
def test_reweighting_matches_its_closed_form_by_hand():
    # D = 2; three clients' prototypes of one class; the class means of the two clients holding it
    c = np.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])
    mu = np.array([[0.0, 0.0], [0.0, 2.0]])
    s = np.array([0.0 + 2.0, 5.0 + np.sqrt(9 + 4), 10.0 + np.sqrt(36 + 36)])  # sum_j ||c_i - mu_j||
    u = 1 / s
    u_t = (u - u.min()) / (u.max() - u.min())
    w = np.exp(u_t / 0.2) / np.exp(u_t / 0.2).sum()
    got = heterogeneity_weights(c, mu, 0.2)
    np.testing.assert_allclose(got, w, rtol=1e-12)
    assert got.sum() == pytest.approx(1.0) and got.argmax() == 0  # the prototype nearest every mean
    assert got[0] == pytest.approx(np.exp(5) / (np.exp(5) + np.exp(u_t[1] / 0.2) + 1))
    # temperature: large -> the plain mean; small -> the best client alone
    np.testing.assert_allclose(heterogeneity_weights(c, mu, 1e6), np.full(3, 1 / 3), atol=1e-6)
    np.testing.assert_allclose(heterogeneity_weights(c, mu, 1e-3), [1, 0, 0], atol=1e-12)


def test_identical_prototypes_come_back_unchanged_and_degenerate_cases_are_uniform():
    rng = np.random.default_rng(0)
    same = np.repeat(rng.normal(size=(1, 4, 6)), 3, axis=0)  # (clients, classes, D)
    means = rng.normal(size=(3, 4, 6))
    holds = np.array([[True, False, True, True], [True, True, False, True], [False, False, False, True]])
    holds[:, 2] = False  # class 2: no holder at all
    merged, weights = reweighted_prototypes(same, means, holds, 0.2)
    np.testing.assert_allclose(merged, same[0], rtol=1e-12)
    np.testing.assert_allclose(weights, 1 / 3)  # equal distances: uniform, not NaN
    one, w1 = reweighted_prototypes(same[:1] + 1.0, means[:1], holds[:1], 0.2)
    np.testing.assert_allclose(one, same[0] + 1.0) and np.testing.assert_array_equal(w1, 1.0)
    # equal distances by symmetry: two prototypes mirrored about the one mean
    mirrored = heterogeneity_weights(np.array([[1.0, 0.0], [-1.0, 0.0]]), np.zeros((1, 2)), 0.2)
    np.testing.assert_array_equal(mirrored, [0.5, 0.5])
    assert np.isfinite(heterogeneity_weights(np.zeros((3, 2)), np.zeros((2, 2)), 0.2)).all()


def strategy_at(task: int = 0, options: dict | None = None, **overrides):
    cfg = pilora_config(**{"num-clients": 3, "clients-per-round": 3, **PLAIN_MEAN, **overrides})
    model, _ = build_model(model_spec(cfg, NUM_CLASSES), PILoRAAdapters)
    s = PILoRAStrategy.of(cfg, NUM_CLASSES, options or {})
    arrays = to_array_record(model.trainable_state())
    for t in range(task + 1):
        arrays = s.on_task_start(t, arrays)
    return s, arrays


def reply_of(arrays, shift: np.ndarray, means: dict[int, np.ndarray], n: int, client: int) -> RecordDict:
    state = from_array_record(arrays)
    state["head.weight"] = state["head.weight"] + shift.astype(np.float32)
    classes = np.array(sorted(means), np.int64)
    return RecordDict({
        ARRAYS: to_array_record(state),
        METRICS: MetricRecord({"num-examples": n, "train-loss": 1.0, "train-seconds": 0.1}),
        CLASS_MEANS: to_array_record({"classes": classes,
                                      "means": np.stack([means[c] for c in classes]).astype(np.float32),
                                      "counts": np.full(len(classes), 5, np.int64),
                                      "client": np.array([client], np.int64)})})


def test_task_start_draws_small_seeded_prototypes_and_a_fresh_set():
    s, arrays = strategy_at(0)
    state = from_array_record(arrays)
    w = state["head.weight"]
    assert 0.05 < w.std() < 0.15 and not state["head.bias"].any()
    assert not state["prompt.lora_q0_b"][0].any()
    again = from_array_record(s.on_task_start(1, arrays))["head.weight"]
    np.testing.assert_array_equal(again, w)  # task 1's rows were drawn at the start already


def test_consolidate_reweights_each_trained_class_and_fedavg_leaves_the_average():
    s, arrays = strategy_at(0)
    base = from_array_record(arrays)["head.weight"]
    d = base.shape[1]
    rng = np.random.default_rng(1)
    shifts = [rng.normal(size=base.shape) * 0.1 for _ in range(3)]
    means = {0: {0: rng.normal(size=d), 1: rng.normal(size=d)}, 1: {0: rng.normal(size=d)}, 2: {3: rng.normal(size=d)}}
    replies = [reply_of(arrays, shifts[i], means[i], 10 * (i + 1), i) for i in range(3)]
    accepted = accepted_of(replies, tasks=0)
    averaged = s.aggregate(accepted)
    out = from_array_record(s.consolidate(1, averaged, accepted))["head.weight"]
    prototypes = np.stack([base + sh for sh in shifts]).astype(np.float32).astype(np.float64)
    for k in range(5):
        holders = [means[i][k] for i in range(3) if k in means[i]]
        w = heterogeneity_weights(prototypes[:, k], np.array(holders), 0.2) if holders else np.full(3, 1 / 3)
        np.testing.assert_allclose(out[k], w @ prototypes[:, k], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[5:], from_array_record(averaged)["head.weight"][5:])  # task 1's rows
    fedavg, _ = strategy_at(0, {"reweight": "fedavg"})
    plain = from_array_record(fedavg.consolidate(1, averaged, accepted))["head.weight"]
    np.testing.assert_array_equal(plain, from_array_record(averaged)["head.weight"])
    np.testing.assert_allclose(plain[:5], np.einsum("i,ikd->kd", [1 / 6, 2 / 6, 3 / 6], prototypes[:, :5]), rtol=1e-5)
    assert s.uploaded_features([3, 4], 0)[0]["client"] == 2 and len(s.uploaded_features([3, 4], 0)) == 1


def test_malformed_class_means_are_rejected(flower_identity):
    s, arrays = strategy_at(0)
    d = from_array_record(arrays)["head.weight"].shape[1]
    good = reply_of(arrays, np.zeros((NUM_CLASSES, d)), {0: np.zeros(d)}, 10, 0)
    sent = accepted_of([good])[0].sent
    assert s.check_records(accepted_of([good])[0].reply, sent) is None
    for name, change in (("nan", {"means": np.full((1, d), np.nan, np.float32)}),
                         ("class of task 1", {"classes": np.array([7], np.int64)}),
                         ("shape", {"means": np.zeros((1, d + 1), np.float32)}),
                         ("zero count", {"counts": np.zeros(1, np.int64)}),
                         ("other client", {"client": np.array([2], np.int64)})):
        bad = reply_of(arrays, np.zeros((NUM_CLASSES, d)), {0: np.zeros(d)}, 10, 0)
        bad[CLASS_MEANS] = to_array_record({**from_array_record(bad[CLASS_MEANS]), **change})
        assert s.check_records(accepted_of([bad])[0].reply, sent) is not None, name


# ---------------------------------------------------------------------------- many rounds
def clustered_clients(d: int = 8, k: int = 3, seed: int = 0):
    """Three clients over the same three clusters, each with its own skewed class counts."""
    rng = np.random.default_rng(seed)
    centres = 4.0 * np.eye(k, d)
    out = []
    for counts in ([40, 5, 5], [5, 40, 5], [5, 5, 40]):
        f = np.concatenate([centres[c] + 0.5 * rng.normal(size=(n, d)) for c, n in enumerate(counts)])
        y = np.repeat(np.arange(k), counts)
        out.append((torch.tensor(f), torch.tensor(y)))
    return out


def local_steps(c: np.ndarray, f: torch.Tensor, y: torch.Tensor, loss_of, steps: int, lr: float) -> np.ndarray:
    p = torch.tensor(c, requires_grad=True)
    for _ in range(steps):
        (grad,) = torch.autograd.grad(loss_of(f, y, p), p)
        with torch.no_grad():
            p -= lr * grad
    return p.detach().numpy()


def test_prototypes_converge_under_reweighting_and_classify_the_clusters():
    """Frozen LoRA, fixed features: 50 rounds of local DCE + PL steps and re-weighting converge, and
    the nearest prototype classifies every sample right."""
    clients = clustered_clients()
    k = 3
    c = 0.1 * np.random.default_rng(1).normal(size=(k, 8))

    def dce_pl(f, y, p):
        return F.cross_entropy(prototype_logits(f, p, 1.0), y) + 1.0 * paired_distances(f, p[y]).mean()

    means = np.stack([np.stack([f[y == j].mean(0).numpy() for j in range(k)]) for f, y in clients])
    changes = []
    for _ in range(50):
        local = np.stack([local_steps(c, f, y, dce_pl, 8, 0.5) for f, y in clients])
        new, _ = reweighted_prototypes(local, means, np.ones((3, k), bool), 0.2)
        changes.append(np.abs(new - c).max())
        c = new
    assert changes[-1] < 1e-6 and changes[0] > 1.0
    features = torch.cat([f for f, _ in clients])
    labels = torch.cat([y for _, y in clients])
    assert bool((torch.cdist(features, torch.tensor(c)).argmin(1) == labels).all())


def test_control_count_weighted_averaging_of_squared_pl_converges_to_the_global_class_mean():
    """The control: each class's prototype averaged over the clients by their class counts, a
    squared-distance PL alone. c <- sum_i w_i mu_i + (1 - eta)^s (c - sum_i w_i mu_i): the global class mean."""
    clients = clustered_clients()
    k = 3
    c = np.zeros((k, 8))

    def squared_pl(f, y, p):  # 1/2 of each class's mean squared distance: gradient c_k - mu_k
        return sum(0.5 * (f[y == j] - p[j]).square().sum(1).mean() for j in range(k))

    counts = np.array([[(y == j).sum().item() for j in range(k)] for _, y in clients], dtype=np.float64)
    for _ in range(50):
        local = np.stack([local_steps(c, f, y, squared_pl, 3, 0.3) for f, y in clients])
        c = np.einsum("ik,ikd->kd", counts / counts.sum(0), local)
    features = torch.cat([f for f, _ in clients]).numpy()
    labels = torch.cat([y for _, y in clients]).numpy()
    np.testing.assert_allclose(c, np.stack([features[labels == j].mean(0) for j in range(k)]), atol=1e-10)


# ---------------------------------------------------------------------------- options, registry, sizes
def test_options_are_validated_and_registered():
    with pytest.raises(ConfigError, match="pilora.reweight"):
        PILoRAOptions.from_options({"reweight": "median"})
    with pytest.raises(ConfigError, match="pilora.softmax-over"):
        PILoRAOptions.from_options({"softmax-over": "seen"})
    with pytest.raises(ConfigError, match="pilora.bogus"):
        PILoRAStrategy.parse_options({"bogus": 1})
    assert strategy_class("pilora") is PILoRAStrategy and learner_class("pilora") is PILoRALearner
    assert prompt_class("pilora") is PILoRAAdapters
    with pytest.raises(ConfigError, match="random"):
        from promptfcl.strategies.platform.run_checks import load_config

        load_config(None, ["task-generator=\"random\"", "classes-per-task=2"], "pilora", None)


def test_rank_option_shapes_the_sets_and_the_stateful_count_is_the_current_set_and_prototypes():
    model = model_of(rank=2)
    assert model.prompt.lora_q0_a.shape == (3, 2, model.embed_dim)
    # ViT-B/16, r = 4, 10 classes a task: 4 x 4 x 768 (A and B of q and v) + 10 x 768
    cfg = pilora_config(**{"num-tasks": 10})
    s = PILoRAStrategy.of(cfg, 100)
    state = {"prompt.lora_q0_a": np.zeros((10, 4, 768)), "prompt.lora_q0_b": np.zeros((10, 768, 4)),
             "prompt.lora_q0_w": np.zeros((10, 768)), "prompt.lora_v0_a": np.zeros((10, 4, 768)),
             "prompt.lora_v0_b": np.zeros((10, 768, 4)), "prompt.lora_v0_w": np.zeros((10, 768)),
             "head.weight": np.zeros((100, 768)), "head.bias": np.zeros(100)}
    assert s.stateful_parameters(to_array_record(state)) == 12_288 + 7_680


# ---------------------------------------------------------------------------- end to end
@pytest.mark.e2e
@pytest.mark.simulation
def test_pilora_end_to_end_simulation(tmp_path):
    from tests.helpers import simulate_in_process as simulate

    results = simulate(tmp_path / "pilora", strategy="pilora", **{"prompt-layers": "0"}, **PLAIN_MEAN)
    acc = results["accuracy_matrix"]
    assert acc[0][0] is not None and acc[1][1] is not None and acc[1][0] is None
    rounds = results["rounds"]
    assert len(rounds) == 4 and all(r["clients_aggregated"] == 3 and not r["rejected"] for r in rounds)
    assert all(1 / 3 <= r["strategy_metrics"]["prototype-weight-max"] <= 1 for r in rounds)
