"""LoRM's trainable module: low-rank adapters on every projection of the adapted blocks, and the
recorder of their inputs' Gram diagonals (the statistics of the closed-form merges)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ...common.model.adapters import LowRankAdapters
from .options import LoRMOptions


@dataclass
class GramRecorder:
    """Per adapted (block, projection): the sum over every token (CLS included) of the squared input
    of the projection, ``diag(sum_tokens x x^T)`` (in,) in float64, and the tokens summed."""

    sums: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    tokens: dict[tuple[int, str], int] = field(default_factory=dict)

    def add(self, layer: int, target: str, x: torch.Tensor) -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).double()
        key = (layer, target)
        total = rows.square().sum(0)
        self.sums[key] = total if key not in self.sums else self.sums[key] + total
        self.tokens[key] = self.tokens.get(key, 0) + len(rows)


class LoRMAdapters(LowRankAdapters):
    """LoRA ``W0 + B A`` (no alpha / r scaling) on ``qkv`` (one adapter for q, k and v), ``proj``,
    ``fc1`` and ``fc2`` of every adapted block (the code's ``lora_pre.Lora``: every weight named
    ``qkv``, ``mlp`` or ``attn.proj``), one set per task. Training runs ``W0 + B_t A_t`` alone
    (``training_sets = "current"``: the code's ``get_optimization_dict``); evaluation runs the sets
    of tasks 0..t scaled by the server's column weights (the task merge, strategy.py).

    ``recording()`` collects the Gram diagonals of the projections' inputs in the forwards run
    inside it (:class:`GramRecorder`): the adapters see each projection's input, so this is the
    explicit path the note on the family asks for, the same for common/model/vit.py's ViT and timm's.
    """

    targets = ("qkv", "proj", "fc1", "fc2")
    rank = 1
    training_sets = "current"
    _recorder: GramRecorder | None = None

    def configure(self, options: Mapping[str, Any]) -> None:
        """The run's ``lorm.rank`` (``options``: its namespaced method options); the sets are made
        again at that rank."""
        rank = LoRMOptions.from_options({k[len("lorm."):]: v for k, v in options.items()
                                         if k.startswith("lorm.")}).rank
        if rank != self.rank:
            self.rank = rank
            self.allocate()

    @contextmanager
    def recording(self) -> Iterator[GramRecorder]:
        """Record the Gram diagonals of every adapted projection's input while inside."""
        self._recorder = GramRecorder()
        try:
            yield self._recorder
        finally:
            self._recorder = None  # the module is shared by every message of the process

    def adapt(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self._recorder is not None and name in self.targets:
            self._recorder.add(layer, name, x)
        return super().adapt(layer, name, x, y)
