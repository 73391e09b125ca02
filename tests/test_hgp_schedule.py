"""HGP's head rebalancing schedules (``hgp.rebalance-schedule``, issue 58 item 5): the rates the
optimiser actually steps with, read at each step of a real ``rebalance_head``."""

from __future__ import annotations

import math

import pytest
import torch

from promptfcl.strategies.hgp.gaussians import rebalance_head
from promptfcl.strategies.hgp.options import HGPOptions

#: fed-mammoth's rebalancing (CosineAnnealingLR(T_max = 5 epochs) from 0.01, stepped once an epoch),
#: as the issue quotes it
LAB_RATES = [0.01, 0.009045, 0.006545, 0.003455, 0.000955]


def rates_used(schedule: str, monkeypatch: pytest.MonkeyPatch, samples: int = 20, batch: int = 8) -> list[float]:
    """The learning rate of every SGD step of a 5-epoch rebalancing of ``samples`` features in
    batches of ``batch``."""
    seen: list[float] = []
    step = torch.optim.SGD.step

    def recording(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.SGD, "step", recording)
    g = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(samples, 6, generator=g), torch.arange(samples) % 3
    opts = HGPOptions.from_options({"rebalance-schedule": schedule, "rebalance-batch-size": batch})
    rebalance_head(torch.zeros(3, 6), torch.zeros(3), lambda epoch: (feats, labels), torch.arange(3), opts, g)
    return seen


def test_cosine_epoch_steps_the_lab_codes_rates_once_an_epoch(monkeypatch):
    seen = rates_used("cosine-epoch", monkeypatch)
    per_epoch = math.ceil(20 / 8)
    assert len(seen) == 5 * per_epoch
    epochs = [seen[e * per_epoch : (e + 1) * per_epoch] for e in range(5)]
    assert all(len(set(rates)) == 1 for rates in epochs)  # constant within an epoch
    assert [round(rates[0], 6) for rates in epochs] == LAB_RATES


def test_cosine_steps_per_batch_and_constant_does_not_move(monkeypatch):
    seen = rates_used("cosine", monkeypatch)
    steps = len(seen)
    assert steps == 15
    expected = [0.005 * (1 + math.cos(math.pi * k / steps)) for k in range(steps)]  # T_max = every step
    assert seen == pytest.approx(expected, rel=1e-9)
    assert len(set(seen[:3])) == 3  # it moves within the first epoch, where cosine-epoch does not
    monkeypatch.undo()
    assert set(rates_used("constant", monkeypatch)) == {0.01}
