"""Low-rank adapters (common/model/adapters.py): the adapted forward equals the dense weight it stands for,
sets per task, which sets train, the server's column weights, and what the runtime skips."""

import copy

import numpy as np
import pytest
import torch

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.adapters import LowRankAdapters
from promptfcl.common.model.prompted import build_model
from promptfcl.common.model.runtime import layout_of, model_spec
from tests.conftest import tiny_config


class QVAdapters(LowRankAdapters):
    targets = ("q", "v")
    rank = 2


class CurrentOnly(LowRankAdapters):
    training_sets = "current"
    rank = 3


def adapted_model(adapters=LowRankAdapters, tasks=3):
    cfg = tiny_config(**{"num-tasks": tasks, "prompt-layers": "0,1"})
    model, _ = build_model(model_spec(cfg, 10), adapters)
    return model.double().eval()


def randomise(adapters: LowRankAdapters, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def dense_copy(model, deltas):
    """The frozen backbone with ``W0 + delta`` written into each adapted projection's weight."""
    backbone = copy.deepcopy(model.backbone)
    with torch.no_grad():
        for (layer, target), delta in deltas.items():
            block = backbone.blocks[layer]
            if target in ("q", "v"):
                d = delta.shape[0]
                rows = slice(0, d) if target == "q" else slice(2 * d, 3 * d)
                block.attn.qkv.weight[rows] += delta
                continue
            linear = {"qkv": block.attn.qkv, "proj": block.attn.proj, "fc1": block.mlp.fc1, "fc2": block.mlp.fc2}[target]
            linear.weight += delta
    return backbone


def frozen_features(backbone, x):
    return backbone.forward_head(backbone.forward_features(x), pre_logits=True)


@pytest.mark.parametrize("adapters", [LowRankAdapters, QVAdapters])
def test_adapted_forward_equals_the_dense_weights_it_stands_for(adapters):
    model = adapted_model(adapters)
    randomise(model.prompt)
    model.prompt.set_task(2)
    x = torch.randn(3, 3, 16, 16, dtype=torch.float64)
    deltas = {(layer, t): model.prompt.merged_delta(t, layer) for layer in model.prompt.layers
              for t in model.prompt.targets}
    expected = frozen_features(dense_copy(model, deltas), x)
    torch.testing.assert_close(model.features(x, model.query(x)), expected, rtol=1e-10, atol=1e-10)
    # the dense delta is the sum of the tasks' B A, each column scaled by its weight
    a, b, w = (getattr(model.prompt, model.prompt.name(adapters.targets[0], 0, p)).detach() for p in "abw")
    hand = sum(b[t] @ (a[t] * w[t][None, :]) for t in range(3))
    torch.testing.assert_close(model.prompt.merged_delta(adapters.targets[0], 0), hand)


def test_fresh_sets_leave_the_frozen_model_unchanged_and_q_v_leave_k_alone():
    model = adapted_model(QVAdapters)
    g = torch.Generator().manual_seed(1)
    for t in range(3):
        model.prompt.init_task_slice(t, g)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    torch.testing.assert_close(model.features(x, model.query(x)), frozen_features(model.backbone, x))
    # only the q and v slices of qkv move
    randomise(model.prompt)
    block, tokens = model.backbone.blocks[0], torch.randn(2, 5, 48, dtype=torch.float64)
    plain = block.attn.qkv(tokens)
    adapted = model.prompt.adapt(0, "qkv", tokens, plain.clone())  # the hook may add in place
    assert not torch.equal(adapted[..., :48], plain[..., :48])
    torch.testing.assert_close(adapted[..., 48:96], plain[..., 48:96], rtol=0, atol=0)
    assert not torch.equal(adapted[..., 96:], plain[..., 96:])


def test_init_task_slice_draws_only_that_task_and_zeroes_its_b():
    model = adapted_model()
    randomise(model.prompt)
    before = {k: v.detach().clone() for k, v in model.prompt.state_dict().items()}
    model.prompt.init_task_slice(1, torch.Generator().manual_seed(3))
    for name, value in model.prompt.state_dict().items():
        torch.testing.assert_close(value[[0, 2]], before[name][[0, 2]], rtol=0, atol=0)
        if name.endswith("_b"):
            assert not value[1].any()
        if name.endswith("_w"):
            assert bool((value[1] == 1).all())
        if name.endswith("_a"):
            assert value[1].abs().max() <= 1 / np.sqrt(value.shape[-1])


@pytest.mark.parametrize("adapters,grad_tasks", [(LowRankAdapters, {0: False, 1: True, 2: False}),
                                                 (CurrentOnly, {0: False, 1: True, 2: False})])
def test_only_the_current_set_trains(adapters, grad_tasks):
    model = adapted_model(adapters).float()
    randomise(model.prompt)
    model.prompt.set_task(1)
    model.train()
    x = torch.randn(2, 3, 16, 16)
    (model.features(x, model.query(x)) ** 2).sum().backward()  # a LayerNorm output sums to a constant
    a = model.prompt.lora_qkv0_a
    for t, trained in grad_tasks.items():
        assert bool(a.grad[t].abs().sum() > 0) is trained
    assert model.prompt.lora_qkv0_w.grad is None  # column weights are the server's


def test_current_only_training_leaves_earlier_sets_out_of_the_forward():
    model = adapted_model(CurrentOnly)
    randomise(model.prompt)
    model.prompt.set_task(1)
    x = torch.randn(2, 5, 48, dtype=torch.float64)
    y = torch.zeros(2, 5, 144, dtype=torch.float64)
    model.train()
    a, b = model.prompt.lora_qkv0_a, model.prompt.lora_qkv0_b
    torch.testing.assert_close(model.prompt.adapt(0, "qkv", x, y), (x @ a[1].T) @ b[1].T)  # no column weights
    model.eval()
    w = model.prompt.lora_qkv0_w
    expected = sum(((x * w[t]) @ a[t].T) @ b[t].T for t in range(2))
    torch.testing.assert_close(model.prompt.adapt(0, "qkv", x, y), expected)


def test_adapters_read_no_query_and_their_sets_are_task_rows():
    model = adapted_model()
    assert model.query(torch.randn(4, 3, 16, 16, dtype=torch.float64)).shape == (4, 0)
    layout = layout_of(tiny_config(**{"num-tasks": 3}), 10)
    state = model.trainable_state()
    name = "prompt.lora_fc1" + "1_b"
    assert layout.task_rows(name, state[name].numpy(), 2) == slice(2, 3)
    assert not any(k.startswith("backbone") for k in state)  # the frozen weights never travel


def test_a_backbone_of_another_mlp_width_is_refused():
    class Wide(LowRankAdapters):
        mlp_ratio = 2.0

    with pytest.raises(ConfigError, match="fc1"):
        adapted_model(Wide)


@pytest.mark.parametrize("adapters", [LowRankAdapters, QVAdapters])
def test_training_gradients_equal_the_per_task_sum_it_stands_for(adapters):
    """The forward folds the column weights into A and stacks the tasks' sets (and adds q's and v's
    deltas in place): its gradients are those of sum_tau B_tau A_tau (w_tau * x) written out task by task."""
    model = adapted_model(adapters)
    randomise(model.prompt)
    model.prompt.set_task(2)
    model.train()
    prompt, target = model.prompt, adapters.targets[0]
    x = torch.randn(2, 5, 48, dtype=torch.float64)
    y = torch.randn(2, 5, 144, dtype=torch.float64)
    weights = torch.randn(2, 5, 144, dtype=torch.float64)
    (prompt.adapt(0, "qkv", x, y.clone()) * weights).sum().backward()
    a, b, w = (getattr(prompt, prompt.name(target, 0, p)) for p in "abw")
    got = a.grad[2].clone(), b.grad[2].clone()
    a.grad, b.grad = None, None
    delta = sum(((x * w[t]) @ (a[t] if t == 2 else a[t].detach()).T) @ (b[t] if t == 2 else b[t].detach()).T
                for t in range(3))
    rows = slice(0, 144) if target == "qkv" else slice(0, 48)
    (delta * weights[..., rows]).sum().backward()
    torch.testing.assert_close(got[0], a.grad[2], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], b.grad[2], rtol=1e-10, atol=1e-10)
