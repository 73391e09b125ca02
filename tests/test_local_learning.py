"""Local learning and the query cache: what trains, what stays frozen, what is reused."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import RecordDict

from promptfcl.common.evaluation import accuracies, correct_counts
from promptfcl.common.records import ARRAYS, from_array_record, to_array_record, to_torch
from promptfcl.common.runtime import get_runtime
from promptfcl.strategies.fedavg.strategy import FedAvgStrategy
from promptfcl.strategies.platform.learner import LocalLearner
from tests.conftest import tiny_config


def start(cfg, task=0):
    rt = get_runtime(cfg)
    s = FedAvgStrategy(cfg, rt.data.num_classes)
    arrays = to_array_record(rt.model.trainable_state())
    for t in range(task + 1):
        arrays = s.on_task_start(t, arrays)
    return rt, arrays


def test_only_the_current_task_slice_and_its_head_rows_change():
    cfg = tiny_config(num_tasks=2, centralised=True, lr=0.01)
    rt, arrays = start(cfg, task=1)
    before = from_array_record(arrays)
    reply = LocalLearner(rt).fit(RecordDict({ARRAYS: arrays}), task=1, round_=0, client_id=0)
    after = from_array_record(reply[ARRAYS])
    per_task = cfg.pool_size // cfg.num_tasks
    for layer in cfg.layers:
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
    a = LocalLearner(rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    b = LocalLearner(rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
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
    reply = LocalLearner(rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    assert all(reply[ARRAYS][k].numpy().dtype == np.float32 for k in reply[ARRAYS].keys())
    assert np.isfinite(reply["metrics"]["train-loss"])
    fp32_rt, _ = start(tiny_config(num_tasks=2, centralised=True, lr=0.01, local_epochs=3))
    fp32 = LocalLearner(fp32_rt).fit(RecordDict({ARRAYS: arrays}), 0, 0, 0)
    assert not np.array_equal(reply[ARRAYS]["head.weight"].numpy(), fp32[ARRAYS]["head.weight"].numpy())
    rt.model.load_trainable_state(to_torch(reply[ARRAYS]))
    assert accuracies(*correct_counts(rt, 0))[0] > max(chance_level, 20.0) + 15


def test_augmented_training_bypasses_the_query_cache_and_queries_the_augmented_images(monkeypatch):
    """augment = crop-flip: q(x) is computed on each augmented batch, never read from the cache."""
    from promptfcl.common.augment import augment_images

    cfg = tiny_config(num_tasks=2, centralised=True, augment="crop-flip", local_epochs=1, batch_size=64)
    rt, arrays = start(cfg)
    cache = rt.query_cache("train")
    computed = cache.computed
    seen: list[torch.Tensor] = []
    real_query = rt.model.query
    monkeypatch.setattr(rt.model, "query", lambda x: seen.append(x.clone()) or real_query(x))
    learner = LocalLearner(rt)
    a = learner.fit(RecordDict({ARRAYS: arrays}), task=0, round_=0, client_id=0)
    assert cache.computed == computed  # the cache was not asked (nor filled) by the loop
    index = np.flatnonzero(np.isin(rt.data.train.labels, [0, 1, 2, 3, 4]))
    assert sum(len(x) for x in seen) == len(index)  # one query per training image and epoch
    # the first batch's queries were taken on exactly the augmented views the loop trained on
    order = np.random.default_rng([cfg.seed, 0, 0, 0, 0xBA7C4]).permutation(len(index))
    views = augment_images(rt.data.train.images[index[order[:64]]], "crop-flip",
                           np.random.default_rng([cfg.seed, 0, 0, 0, 0xA06]))
    torch.testing.assert_close(seen[0], rt.model.preprocess(torch.from_numpy(views)))
    assert not torch.equal(seen[0], rt.model.preprocess(torch.from_numpy(rt.data.train.images[index[order[:64]]])))
    # seeded: the same fit gives the same result; another round sees other views
    monkeypatch.setattr(rt.model, "query", real_query)
    b = LocalLearner(rt).fit(RecordDict({ARRAYS: arrays}), task=0, round_=0, client_id=0)
    c = LocalLearner(rt).fit(RecordDict({ARRAYS: arrays}), task=0, round_=1, client_id=0)
    np.testing.assert_array_equal(a[ARRAYS]["head.weight"].numpy(), b[ARRAYS]["head.weight"].numpy())
    assert not np.array_equal(a[ARRAYS]["head.weight"].numpy(), c[ARRAYS]["head.weight"].numpy())
    plain_rt, _ = start(tiny_config(num_tasks=2, centralised=True, local_epochs=1, batch_size=64))
    plain = LocalLearner(plain_rt).fit(RecordDict({ARRAYS: arrays}), task=0, round_=0, client_id=0)
    assert not np.array_equal(a[ARRAYS]["head.weight"].numpy(), plain[ARRAYS]["head.weight"].numpy())


def test_joint_upper_bound_trains_once_on_the_union_of_the_seen_tasks():
    """centralised-mode = joint at task 1: tasks 0 and 1's images, every seen class in the CE."""
    joint = tiny_config(num_tasks=2, centralised=True, centralised_mode="joint", lr=0.01)
    rt, arrays = start(joint, task=1)
    before = from_array_record(arrays)
    reply = LocalLearner(rt).fit(RecordDict({ARRAYS: arrays}), task=1, round_=0, client_id=0)
    after = from_array_record(reply[ARRAYS])
    assert reply["metrics"]["num-examples"] == len(rt.data.train)  # both tasks: all 10 classes
    # the old task's head rows learn too (they compete in the CE), unlike incremental training
    assert not np.array_equal(after["head.weight"][:5], before["head.weight"][:5])
    per_task = joint.pool_size // joint.num_tasks
    for layer in joint.layers:  # the same model: earlier prompt slices stay frozen
        np.testing.assert_array_equal(after[f"prompt.p{layer}"][:per_task], before[f"prompt.p{layer}"][:per_task])
    incremental = tiny_config(num_tasks=2, centralised=True, lr=0.01)
    inc_rt, _ = start(incremental, task=1)
    inc = LocalLearner(inc_rt).fit(RecordDict({ARRAYS: arrays}), task=1, round_=0, client_id=0)
    assert inc["metrics"]["num-examples"] == np.isin(rt.data.train.labels, range(5, 10)).sum()
    np.testing.assert_array_equal(from_array_record(inc[ARRAYS])["head.weight"][:5], before["head.weight"][:5])
