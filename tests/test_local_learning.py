"""Local learning and the query cache: what trains, what stays frozen, what is reused."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import RecordDict

from client.learner import LocalLearner
from common.evaluation import accuracies, correct_counts
from common.records import ARRAYS, from_array_record, to_array_record, to_torch
from common.runtime import get_runtime
from strategies.fedavg import FedAvgPrompt
from tests.conftest import tiny_config


def start(cfg, task=0):
    rt = get_runtime(cfg)
    s = FedAvgPrompt(cfg, rt.data.num_classes)
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
