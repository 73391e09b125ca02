"""HGP's lab network as a configuration variant (``hgp.prompt-design = "lab-prefix"``, issue 58
item 5): fed-mammoth's ``VitHGP`` with one keyless prefix per prompted block, the same for every
image, shared by every task and never frozen; by shape, by gradient and on a tiny run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.model.prompted import build_model, initial_trainable_state
from promptfcl.common.model.runtime import model_spec
from promptfcl.common.records import from_array_record, to_array_record
from promptfcl.server.cli import load_config
from promptfcl.strategies.hgp.prompt import HGPPrompt
from promptfcl.strategies.hgp.strategy import HGPStrategy
from tests.conftest import PLAIN_MEAN, tiny_config

LAB = {"hgp.prompt-design": "lab-prefix"}
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "hgp-cifar100-lab.toml"


def test_the_lab_configuration_builds_one_200_token_prefix_at_blocks_0_to_4():
    """The configuration's network on a small stand-in backbone (its prompt as configured)."""
    cfg = load_config(str(CONFIG), ["weights=\"random\"", "image-size=16", "patch-size=4", "embed-dim=48",
                                    "depth=6", "num-heads=2"], None, None)
    state = initial_trainable_state(model_spec(cfg, 100), HGPPrompt)
    prompts = {k: tuple(v.shape) for k, v in state.items() if k.startswith("prompt.")}
    assert prompts == {f"prompt.p{layer}": (1, 200, 48) for layer in range(5)}  # no keys, no pool


def test_the_prefix_is_the_same_for_every_image_and_trains_in_every_task():
    cfg = tiny_config(strategy="hgp", **LAB)
    model, _ = build_model(model_spec(cfg, 10), HGPPrompt)
    prompt = model.prompt
    assert set(dict(prompt.named_parameters())) == {"p0", "p1"} and not prompt.uses_query
    x = torch.rand(3, 3, 16, 16)
    query = model.query(x)
    assert query.shape == (3, 0)  # no frozen pass for a query nobody reads
    out = prompt(query, 0)
    assert out.shape == (3, cfg.model.prompt_length, 48)
    torch.testing.assert_close(out[0], out[2])
    torch.testing.assert_close(out[1], prompt.p0[0])
    model.prompt.set_task(1)  # a later task: the prefix is not frozen (the pool's earlier slices would be)
    model.train()
    model(x, query).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in prompt.parameters())


def test_a_new_task_keeps_the_prefix_and_the_wrong_mode_is_refused():
    cfg = tiny_config(strategy="hgp", **LAB)
    s = HGPStrategy.of(cfg, 10, cfg.method_options("hgp"))
    arrays = to_array_record(initial_trainable_state(model_spec(cfg, 10), HGPPrompt))
    before = from_array_record(arrays)
    after = from_array_record(s.on_task_start(1, s.on_task_start(0, arrays)))
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    counts = s.stateful_parameters(arrays)  # the whole prefix goes both ways, every round
    prefix = 2 * cfg.model.prompt_length * 48
    assert counts["s2c"] == prefix + 10 * 48 + 10
    from promptfcl.strategies.platform.run_checks import load_config as load_run

    with pytest.raises(ConfigError, match="lab-prefix.*prompt-mode = prefix"):
        load_run(None, ['hgp.prompt-design="lab-prefix"', 'prompt-mode="prompt"'], "hgp")


@pytest.mark.simulation
def test_a_tiny_run_trains_one_shared_prefix_through_both_tasks(tmp_path, monkeypatch):
    from tests.helpers import simulate_in_process as simulate

    ends: list[dict[str, np.ndarray]] = []
    on_task_end = HGPStrategy.on_task_end

    def spy(self, task, arrays):
        ends.append({k: v.copy() for k, v in from_array_record(arrays).items() if k.startswith("prompt.")})
        return on_task_end(self, task, arrays)

    monkeypatch.setattr(HGPStrategy, "on_task_end", spy)
    results = simulate(tmp_path / "lab", strategy="hgp", lr=0.01, **PLAIN_MEAN, **LAB, **{"hgp.samples-per-class": 32})
    matrix = results["accuracy_matrix"]
    assert all(matrix[i][j] is not None for j in range(2) for i in range(j + 1))
    assert len(ends) == 2 and set(ends[0]) == {"prompt.p0", "prompt.p1"}
    assert all(v.shape == (1, 4, 48) for v in ends[0].values())
    assert any(not np.array_equal(ends[0][k], ends[1][k]) for k in ends[0])  # task 2 trained the same prefix
