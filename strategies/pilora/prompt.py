"""PILoRA's trainable module: incremental LoRA on q and v, and the distance logits to prototypes.

* LoRA on the q and v slices of the adapted blocks' fused qkv (both codes: block 0 only, the run's
  ``prompt-layers = "0"``), one set per task; with ``pilora.lora-sum`` the forward adds the sets
  of tasks 0..t, the earlier ones frozen (``LowRankAdapters.training_sets = "all"``), else task
  t's alone (the authors' ``VLT.py``).
* The prototypes are the head's weight rows (one per class), so they travel, average per task and
  are checked and defended as every head row is; the head's bias is unused (zero). The logits are
  ``-d(f, c_k) / T`` with ``d(f, c) = sqrt(||f - c||^2 / D)`` (``VLT.compute_distance``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ...common.model.adapters import LowRankAdapters
from .options import PILoRAOptions

#: floor of ||f - c||^2 before the square root (its gradient at 0 is infinite)
DISTANCE_FLOOR = 1e-12


def prototype_distances(features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """``d(f, c) = sqrt(||f - c||^2 / D)`` of every feature (B, D) to every prototype (C, D): (B, C).

    By the expansion ``||f||^2 + ||c||^2 - 2 f.c`` (one matrix product), in float32 at least and
    outside autocast, where bf16 would cancel the large terms' digits.
    """
    dtype = torch.float64 if torch.float64 in (features.dtype, prototypes.dtype) else torch.float32
    with torch.autocast(features.device.type, enabled=False):
        f, c = features.to(dtype), prototypes.to(dtype)
        squared = (f * f).sum(-1, keepdim=True) + (c * c).sum(-1)[None, :] - 2.0 * (f @ c.T)
        return torch.sqrt(squared.clamp_min(DISTANCE_FLOOR) / f.shape[-1])


def paired_distances(features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """``d(f_b, c_b)`` of each feature (B, D) to its own prototype (B, D): (B,)."""
    dtype = torch.float64 if torch.float64 in (features.dtype, prototypes.dtype) else torch.float32
    with torch.autocast(features.device.type, enabled=False):
        diff = features.to(dtype) - prototypes.to(dtype)
        return torch.sqrt(diff.square().sum(-1).clamp_min(DISTANCE_FLOOR) / diff.shape[-1])


def prototype_logits(features: torch.Tensor, prototypes: torch.Tensor, temperature: float) -> torch.Tensor:
    """The DCE's logits ``-d(f, c_k) / T`` (B, C)."""
    return -prototype_distances(features, prototypes) / temperature


class PILoRAAdapters(LowRankAdapters):
    """LoRA sets on q and v (``pilora.rank``), scored by distance to the head's rows (module docstring).

    ``pilora.lora = false`` (ablation): the sets stay in the state (B = 0, frozen) and out of the
    forward, so the prototypes learn on the frozen backbone.
    """

    targets = ("q", "v")
    rank = 4
    training_sets = "all"
    temperature = 1.0
    lora_on = True
    lora_sum = True

    def configure(self, options: Mapping[str, Any]) -> None:
        """``pilora.rank``, ``temperature``, ``lora`` and ``lora-sum`` of the run (namespaced options)."""
        opts = PILoRAOptions.from_options({k[len("pilora."):]: v for k, v in options.items()
                                           if k.startswith("pilora.")})
        self.temperature, self.lora_on, self.lora_sum = opts.temperature, opts.lora, opts.lora_sum
        if opts.rank != self.rank:
            self.rank = opts.rank
            self.allocate()
        for name, param in self.named_parameters():
            if not name.endswith("_w"):
                param.requires_grad_(self.lora_on)

    def active(self) -> range:
        """Tasks 0..t (``lora-sum``), or task t alone (the authors' code), in training and evaluation."""
        return super().active() if self.lora_sum else range(self.task, self.task + 1)

    def adapt(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().adapt(layer, name, x, y) if self.lora_on else y

    def logits(self, head: nn.Linear, features: torch.Tensor) -> torch.Tensor:
        """``-d(f, c_k) / T`` over every class's prototype (the head's rows; its bias unused)."""
        return prototype_logits(features, head.weight, self.temperature)

    def task_factors(self, task: int) -> list[torch.Tensor]:
        """Task ``task``'s ``A`` of every adapted block and target (r, in), as the parameters' rows."""
        return [getattr(self, self.name(t, layer, "a"))[task] for layer in self.layers for t in self.targets]

    def task_parameters(self, task: int) -> list[torch.Tensor]:
        """Task ``task``'s ``A`` and ``B`` of every adapted block and target."""
        return [getattr(self, self.name(t, layer, p))[task] for layer in self.layers for t in self.targets
                for p in "ab"]


def orthogonality_loss(adapters: PILoRAAdapters, task: int) -> torch.Tensor:
    """``sum_{tau < t} sum |A_t A_tau^T|`` over every adapted block and target (q, v); earlier
    tasks' ``A`` detached (frozen). Zero at task 0."""
    total = torch.zeros(())
    for layer in adapters.layers:
        for target in adapters.targets:
            a = getattr(adapters, adapters.name(target, layer, "a"))
            for tau in range(task):
                total = total + (a[task] @ a[tau].detach().T).abs().sum()
    return total


def l1_loss(adapters: PILoRAAdapters, task: int) -> torch.Tensor:
    """``sum ||A_t||_1`` over every adapted block and target (the codes' ``||A_t^q||_1 + ||A_t^v||_1``)."""
    return sum((a.abs().sum() for a in adapters.task_factors(task)), torch.zeros(()))
