"""Local learning and the query cache: what trains, what stays frozen, what is reused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import RecordDict
from torch.optim.optimizer import register_optimizer_step_pre_hook

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.evaluation import accuracies, correct_counts
from promptfcl.common.model.runtime import get_runtime
from promptfcl.common.records import ARRAYS, from_array_record, to_array_record, to_torch
from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.platform.learner import LocalLearner, codap_cosine
from tests.conftest import tiny_config


def start(cfg, task=0):
    rt = get_runtime(cfg)
    s = FedAvgStrategy.of(cfg, rt.data.num_classes)
    arrays = to_array_record(rt.model.trainable_state())
    for t in range(task + 1):
        arrays = s.on_task_start(t, arrays)
    return rt, arrays


def test_only_the_current_task_slice_and_its_head_rows_change():
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01)
    rt, arrays = start(cfg, task=1)
    before = from_array_record(arrays)
    reply = LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: arrays}), task=1, round_=0, client_id=0)
    after = from_array_record(reply[ARRAYS])
    per_task = cfg.model.pool_size // cfg.data.num_tasks
    for layer in cfg.model.layers:
        for kind in "pka":
            name = f"prompt.{kind}{layer}"
            np.testing.assert_array_equal(after[name][:per_task], before[name][:per_task])  # task 0 frozen
            assert not np.array_equal(after[name][per_task:], before[name][per_task:])  # task 1 learns
    old_rows, new_rows = np.arange(0, 5), np.arange(5, 10)
    np.testing.assert_array_equal(after["head.weight"][old_rows], before["head.weight"][old_rows])
    assert not np.array_equal(after["head.weight"][new_rows], before["head.weight"][new_rows])
    assert reply["metrics"]["num-examples"] > 0


def test_training_is_deterministic_and_learns_the_task():
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01, local_epochs=3)
    rt, arrays = start(cfg)
    rt.model.load_trainable_state(to_torch(arrays))
    chance_level = accuracies(*correct_counts(rt, 0))[0]
    a = LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    b = LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    for k in a[ARRAYS].keys():
        np.testing.assert_array_equal(a[ARRAYS][k].numpy(), b[ARRAYS][k].numpy())
    rt.model.load_trainable_state(to_torch(a[ARRAYS]))
    learnt = accuracies(*correct_counts(rt, 0))[0]
    assert learnt > max(chance_level, 20.0) + 15  # 5 classes: chance is 20%


def test_query_cache_computes_each_query_once_and_matches_the_backbone():
    rt = get_runtime(tiny_config(seed=11))
    cache = rt.query_cache("train")
    idx = np.array([3, 1, 4, 1, 5])
    q = rt.queries("train", idx)
    assert cache.computed == 4  # duplicates computed once
    rt.queries("train", idx)
    assert cache.computed == 4  # second use: nothing recomputed
    x = rt.model.preprocess(torch.from_numpy(rt.data.train.images[idx]))
    torch.testing.assert_close(q, rt.model.query(x))


def test_query_cache_switch_off():
    rt = get_runtime(tiny_config(query_cache=False))
    assert rt.queries("train", np.arange(4)) is None


def test_bfloat16_autocast_trains_float32_parameters_and_still_learns():
    """precision = bf16 runs the forward passes in bfloat16 (here on CPU; on GPUs "auto" picks it)."""
    assert not get_runtime(tiny_config()).mixed_precision  # auto on a CPU: float32
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01, local_epochs=3, precision="bf16")
    rt, arrays = start(cfg)
    assert rt.mixed_precision
    rt.model.load_trainable_state(to_torch(arrays))
    chance_level = accuracies(*correct_counts(rt, 0))[0]
    reply = LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    assert all(reply[ARRAYS][k].numpy().dtype == np.float32 for k in reply[ARRAYS].keys())
    assert np.isfinite(reply["metrics"]["train-loss"])
    fp32_cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01, local_epochs=3)
    fp32_rt, _ = start(fp32_cfg)
    fp32 = LocalLearner.of(fp32_cfg, fp32_rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    assert not np.array_equal(reply[ARRAYS]["head.weight"].numpy(), fp32[ARRAYS]["head.weight"].numpy())
    rt.model.load_trainable_state(to_torch(reply[ARRAYS]))
    assert accuracies(*correct_counts(rt, 0))[0] > max(chance_level, 20.0) + 15


def test_augmented_training_bypasses_the_query_cache_and_queries_the_augmented_images(monkeypatch):
    """augment = crop-flip: q(x) is computed on each augmented batch, never read from the cache."""
    from promptfcl.common.data.augment import augment_images

    cfg = tiny_config(num_tasks=2, centralised=True, augment="crop-flip", local_epochs=1, batch_size=64)
    rt, arrays = start(cfg)
    cache = rt.query_cache("train")
    computed = cache.computed
    seen: list[torch.Tensor] = []
    real_query = rt.model.query
    monkeypatch.setattr(rt.model, "query", lambda x: seen.append(x.clone()) or real_query(x))
    learner = LocalLearner.of(cfg, rt)
    a = learner.fit(RecordDict({ARRAYS: arrays}), task=0, round_=0, client_id=0)
    assert cache.computed == computed  # the cache was not asked (nor filled) by the loop
    index = np.flatnonzero(np.isin(rt.data.train.labels, [0, 1, 2, 3, 4]))
    assert sum(len(x) for x in seen) == len(index)  # one query per training image and epoch
    # the first batch's queries were taken on exactly the augmented views the loop trained on
    order = np.random.default_rng([cfg.run.seed, 0, 0, 0, 0xBA7C4]).permutation(len(index))
    views = augment_images(rt.data.train.images[index[order[:64]]], "crop-flip",
                           np.random.default_rng([cfg.run.seed, 0, 0, 0, 0xA06]))
    torch.testing.assert_close(seen[0], rt.model.preprocess(torch.from_numpy(views)))
    assert not torch.equal(seen[0], rt.model.preprocess(torch.from_numpy(rt.data.train.images[index[order[:64]]])))
    # seeded: the same fit gives the same result; another round sees other views
    monkeypatch.setattr(rt.model, "query", real_query)
    b = LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: arrays}), task=0, round_=0, client_id=0)
    c = LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: arrays}), task=0, round_=1, client_id=0)
    np.testing.assert_array_equal(a[ARRAYS]["head.weight"].numpy(), b[ARRAYS]["head.weight"].numpy())
    assert not np.array_equal(a[ARRAYS]["head.weight"].numpy(), c[ARRAYS]["head.weight"].numpy())
    plain_cfg = tiny_config(num_tasks=2, centralised=True, local_epochs=1, batch_size=64)
    plain_rt, _ = start(plain_cfg)
    plain = LocalLearner.of(plain_cfg, plain_rt).fit(RecordDict({ARRAYS: arrays}), task=0, round_=0, client_id=0)
    assert not np.array_equal(a[ARRAYS]["head.weight"].numpy(), plain[ARRAYS]["head.weight"].numpy())


def test_joint_upper_bound_trains_once_on_the_union_of_the_seen_tasks():
    """centralised-mode = joint at task 1: tasks 0 and 1's images, every seen class in the CE."""
    joint = tiny_config(num_tasks=2, centralised=True, centralised_mode="joint", lr=0.01)
    rt, arrays = start(joint, task=1)
    before = from_array_record(arrays)
    reply = LocalLearner.of(joint, rt).fit(RecordDict({ARRAYS: arrays}), task=1, round_=0, client_id=0)
    after = from_array_record(reply[ARRAYS])
    assert reply["metrics"]["num-examples"] == len(rt.data.train)  # both tasks: all 10 classes
    # the old task's head rows learn too (they compete in the CE), unlike incremental training
    assert not np.array_equal(after["head.weight"][:5], before["head.weight"][:5])
    per_task = joint.model.pool_size // joint.data.num_tasks
    for layer in joint.model.layers:  # the same model: earlier prompt slices stay frozen
        np.testing.assert_array_equal(after[f"prompt.p{layer}"][:per_task], before[f"prompt.p{layer}"][:per_task])
    incremental = tiny_config(num_tasks=2, centralised=True, lr=0.01)
    inc_rt, _ = start(incremental, task=1)
    inc = LocalLearner.of(incremental, inc_rt).fit(RecordDict({ARRAYS: arrays}), task=1, round_=0, client_id=0)
    assert inc["metrics"]["num-examples"] == np.isin(rt.data.train.labels, range(5, 10)).sum()
    np.testing.assert_array_equal(from_array_record(inc[ARRAYS])["head.weight"][:5], before["head.weight"][:5])


# ---------------------------------------------------------------------------- lr-schedule = codap-cosine
def coda_p_rates(base: float, k: int, epochs: int) -> list[float]:
    """The rate of each local epoch under CODA-P's CosineSchedule as its code runs it (CODA-Prompt
    utils/schedulers.py, learners/default.py): made with K, ``last_epoch`` 0 at the first epoch and
    stepped at the start of every later one; rate = base * cos(99 pi last_epoch / (200 (K - 1)))."""
    rates, last_epoch = [], 0
    for epoch in range(epochs):
        if epoch > 0:
            last_epoch += 1
        rates.append(base * math.cos((99 * math.pi * last_epoch) / (200 * (k - 1))))
    return rates


def rates_of_a_fit(cfg) -> list[list[float]]:
    """Every optimiser step's learning rate in one real fit, grouped by local epoch."""
    rt, arrays = start(cfg)
    steps: list[float] = []
    hook = register_optimizer_step_pre_hook(lambda opt, args, kwargs: steps.append(opt.param_groups[0]["lr"]))
    try:
        reply = LocalLearner.of(cfg, rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    finally:
        hook.remove()
    per_epoch = math.ceil(reply["metrics"]["num-examples"] / cfg.training.batch_size)
    assert len(steps) == cfg.training.local_epochs * per_epoch
    return [steps[e * per_epoch : (e + 1) * per_epoch] for e in range(cfg.training.local_epochs)]


@pytest.mark.parametrize(("epochs", "k"), [(5, 0), (3, 50)])
def test_codap_cosine_trains_each_epoch_at_coda_p_s_rate(epochs, k):
    """Issue 58: CODA-P's schedule is per epoch, not per step; K = local epochs (k = 0) ends at
    cos(0.495 pi) = 1.57 % of the base; Powder's code fixes K = 50 and trains fewer epochs."""
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01, local_epochs=epochs, batch_size=8,
                      lr_schedule="codap-cosine", lr_schedule_epochs=k)
    expected = coda_p_rates(0.01, k or epochs, epochs)
    for rates, rate in zip(rates_of_a_fit(cfg), expected):
        np.testing.assert_allclose(rates, rate, rtol=1e-12)  # one rate through the epoch
    assert [codap_cosine(e, k or epochs) for e in range(epochs)] == pytest.approx(np.divide(expected, 0.01), rel=1e-12)
    if k == 0:  # the factors fidelity5 reads off CODA-P's code at K = 5
        np.testing.assert_allclose(np.divide(expected, 0.01), [1, 0.92538, 0.71264, 0.39354, 0.01571], atol=5e-6)
    assert codap_cosine(19, 20) == pytest.approx(math.cos(0.495 * math.pi)) == pytest.approx(0.0157073, abs=1e-7)


def test_codap_cosine_is_constant_over_one_epoch_and_refuses_negative_rates():
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01, local_epochs=1, batch_size=8, lr_schedule="codap-cosine")
    [rates] = rates_of_a_fit(cfg)
    assert len(rates) > 1 and rates == [0.01] * len(rates)  # K = 1: the code divides by zero; constant here
    assert codap_cosine(0, 1) == 1.0
    with pytest.raises(ConfigError, match="exceeds lr-schedule-epochs"):  # epoch K would train at a negative rate
        tiny_config(local_epochs=6, lr_schedule="codap-cosine", lr_schedule_epochs=5)
    with pytest.raises(ConfigError, match="applies to lr-schedule = codap-cosine"):
        tiny_config(lr_schedule="cosine", lr_schedule_epochs=5)
    with pytest.raises(ConfigError, match="lr-schedule must be one of"):
        tiny_config(lr_schedule="coda")
