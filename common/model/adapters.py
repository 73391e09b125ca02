"""Low-rank adapters (LoRA) on the frozen ViT's projections: the second family of trainable modules.

A method's trainable part is a module family (``family``): CODA-P's prompts
(``common/model/prompted.py: CodaPrompt``) or these adapters. Both implement the trainable-module
protocol (common/model/trainable.py), sit in ``PromptedViT``'s ``prompt`` slot, travel under the
``prompt.`` prefix of the trainable state and keep one part per task, so the platform's per-task
aggregation, checks, defences and privacy apply to either unchanged.

Per adapted block and projection (``qkv``, its ``q`` or ``v`` slice, ``proj``, ``fc1``, ``fc2``),
task t owns a set ``(A_t, B_t)`` with ``A_t`` (r, in) and ``B_t`` (out, r), and a row of column
weights ``w_t`` (in,). The projection ``y = W0 x + b`` becomes

    y + sum_{tau in active} B_tau A_tau (w_tau * x)

("Low-rank adaptation": ``Delta W = B A``, no alpha / r scaling, as the authors' code of LoRM and
of PILoRA has it). Which sets are active: while training, the current task's alone
(``training_sets = "current"``, LoRM) or sets 0..t with the earlier ones frozen (``"all"``,
PILoRA's incremental LoRA); in evaluation sets 0..t, each scaled by its column weights. The
weights are the server's: ones by default, a method that merges the tasks' deltas in closed
form (LoRM's RegMean across tasks, with diagonal Gram matrices: ``w_tau = d_tau / sum d``) sets
them, and they travel with the arrays (never trained).

Caches: an adapter changes every activation from its first block on, so q(x) (the unprompted
backbone's feature) is no feature of the adapted model; ``uses_query = False`` tells the runtime
to neither compute nor cache it. What stays valid is the frozen input of the first adapted block,
for unaugmented views; the data cache (decoded images) is unaffected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any, Self

import torch
from torch import nn

from ..config.experiment import ConfigError
from .trainable import BlockForward, ModuleShape
from .vit import block_forward

#: projections an adapter can target; ``q`` and ``v`` are slices of ``qkv``'s output
TARGETS = ("qkv", "q", "v", "proj", "fc1", "fc2")


class LowRankAdapters(nn.Module):
    """Per-task low-rank adapters for a list of blocks (see the module's docstring).

    Built from a ``ModuleShape`` (:meth:`of`) as the prompt family is, reading its width, blocks
    and tasks (a prompt pool's size and length are not its). A method's subclass sets the class
    attributes (or reads its options in :meth:`configure`, then calls :meth:`allocate`).

    Parameters
    ----------
    embed_dim : int
        Token width D of the backbone.
    layers : list[int]
        Indices of the adapted blocks.
    num_tasks : int
        Number of adapter sets per projection.
    """

    family = "adapters"
    #: whether the forward reads q(x): adapters do not (the runtime skips the query pass and its cache)
    uses_query = False
    #: the adapted projections of each adapted block (of :data:`TARGETS`)
    targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
    rank = 4
    #: sets in the training forward: "current" (task t's alone) or "all" (0..t, earlier ones frozen)
    training_sets = "all"
    #: MLP hidden width over D (every standard ViT: 4); :meth:`check_backbone` checks it
    mlp_ratio = 4.0
    #: the protocol's: no tokens enter the sequence, so there are none to truncate
    prompt_tokens = "truncate"
    tokens_per_block = 0

    def __init__(self, embed_dim: int, layers: list[int], num_tasks: int) -> None:
        super().__init__()
        self.embed_dim, self.layers, self.num_tasks = embed_dim, list(layers), num_tasks
        self.task = 0
        self.allocate()

    @classmethod
    def of(cls, shape: ModuleShape) -> Self:
        """The adapters of ``shape`` (common/model/trainable.py's protocol)."""
        return cls(shape.embed_dim, list(shape.layers), shape.num_tasks)

    # ------------------------------------------------------------------ shape
    def shapes(self, target: str) -> tuple[int, int]:
        """(in, out) of ``target``'s adapter."""
        d, hidden = self.embed_dim, int(self.mlp_ratio * self.embed_dim)
        return {"qkv": (d, 3 * d), "q": (d, d), "v": (d, d), "proj": (d, d), "fc1": (d, hidden),
                "fc2": (hidden, d)}[target]

    def allocate(self) -> None:
        """(Re)create every set: ``A`` Kaiming-uniform, ``B`` zero (each set's delta starts at zero),
        column weights one. Called by the constructor, and by a subclass's ``configure`` after it
        changed ``rank`` or ``targets``."""
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or ("qkv" in self.targets and {"q", "v"} & set(self.targets)):
            raise ConfigError(f"adapter targets {self.targets}: each of {TARGETS}, qkv not with q or v")
        if self.rank < 1:
            raise ConfigError(f"adapter rank {self.rank}: at least 1")
        for name in [n for n, _ in self.named_parameters()]:
            delattr(self, name)
        for layer in self.layers:
            for target in self.targets:
                fan_in, fan_out = self.shapes(target)
                a = torch.empty(self.num_tasks, self.rank, fan_in)
                for t in range(self.num_tasks):
                    nn.init.kaiming_uniform_(a[t], a=math.sqrt(5))
                self.register_parameter(self.name(target, layer, "a"), nn.Parameter(a))
                self.register_parameter(self.name(target, layer, "b"),
                                        nn.Parameter(torch.zeros(self.num_tasks, fan_out, self.rank)))
                self.register_parameter(self.name(target, layer, "w"),
                                        nn.Parameter(torch.ones(self.num_tasks, fan_in), requires_grad=False))

    @staticmethod
    def name(target: str, layer: int, part: str) -> str:
        """The parameter of ``target``'s adapter in block ``layer``: ``part`` "a", "b" or "w" (column
        weights). Its first dimension is the task (``TaskLayout.task_rows``)."""
        return f"lora_{target}{layer}_{part}"

    def check_backbone(self, backbone: Any) -> None:
        """Refuse a backbone whose adapted projections do not have the shapes the sets were made for."""
        for layer in self.layers:
            block = backbone.blocks[layer]
            linears = {"qkv": block.attn.qkv, "proj": block.attn.proj, "fc1": block.mlp.fc1, "fc2": block.mlp.fc2}
            for target in self.targets:
                fan_in, fan_out = self.shapes(target)
                linear = linears["qkv" if target in ("q", "v") else target]
                want = (fan_in, 3 * fan_out) if target in ("q", "v") else (fan_in, fan_out)
                if (linear.in_features, linear.out_features) != want:
                    raise ConfigError(f"block {layer}'s {target} is {linear.in_features} -> {linear.out_features}; "
                                      f"the adapters expect {want[0]} -> {want[1]} (mlp_ratio {self.mlp_ratio})")

    # ------------------------------------------------------------------ the trainable-module protocol
    def configure(self, options: Mapping[str, Any]) -> None:
        """Read the method's options (hook, as ``CodaPrompt.configure``). Default: none."""

    def set_task(self, task: int) -> None:
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"task {task} out of range [0, {self.num_tasks})")
        self.task = task

    def slice_of(self, task: int) -> slice:
        return slice(task, task + 1)

    def init_task_slice(self, task: int, generator: torch.Generator, orthogonal: bool = True) -> None:
        """Draw task ``task``'s sets afresh: ``A`` uniform in +-1/sqrt(in) (Kaiming-uniform with
        a = sqrt(5), as ``nn.Linear`` and both methods' code), ``B`` zero, column weights one, so the
        adapted model starts the task computing exactly what it computed before. ``orthogonal`` is
        the prompt family's and is ignored."""
        with torch.no_grad():
            for layer in self.layers:
                for target in self.targets:
                    a = getattr(self, self.name(target, layer, "a"))
                    bound = 1.0 / math.sqrt(a.shape[-1])
                    a[task] = (torch.rand(a[task].shape, generator=generator) * 2 - 1) * bound
                    getattr(self, self.name(target, layer, "b"))[task] = 0.0
                    getattr(self, self.name(target, layer, "w"))[task] = 1.0

    def orthogonality_penalty(self) -> torch.Tensor:
        return torch.zeros(())

    # ------------------------------------------------------------------ forward
    def in_block(self, layer: int, block: nn.Module, query: torch.Tensor) -> tuple[BlockForward, None]:
        """The block's forward with its projections adapted (``adapt`` bound to ``layer``); no tokens
        added, and ``query`` is not read."""
        return partial(block_forward, block, adapt=partial(self.adapt, layer)), None

    def active(self) -> range:
        """The tasks whose sets this forward adds."""
        if self.training and self.training_sets == "current":
            return range(self.task, self.task + 1)
        return range(self.task + 1)

    def delta(self, target: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        """sum over the active sets of ``B_tau A_tau (w_tau * x)`` for ``x`` (..., in): (..., out).
        Earlier tasks' sets are detached while training; the column weights apply outside training
        and with ``training_sets = "all"``.

        The weights are folded into ``A_tau`` (r x in, not the activations) and the active sets
        stacked, ``[B_0 .. B_t] [A_0 diag(w_0); ..; A_t diag(w_t)]``, so the sum over tasks is two
        matrix products whatever the number of tasks."""
        a, b, w = (getattr(self, self.name(target, layer, p)) for p in "abw")
        weighted = not (self.training and self.training_sets == "current")
        downs, ups = [], []
        for t in self.active():
            at, bt = (a[t], b[t]) if (t == self.task or not self.training) else (a[t].detach(), b[t].detach())
            downs.append(at * w[t] if weighted else at)
            ups.append(bt)
        down = downs[0] if len(downs) == 1 else torch.cat(downs)  # (k r, in)
        up = ups[0] if len(ups) == 1 else torch.cat(ups, dim=1)  # (out, k r)
        return (x @ down.to(x.dtype).T) @ up.to(x.dtype).T

    def adapt(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Projection ``name``'s output ``y`` in block ``layer`` with its adapters' deltas added
        (``common.vit.Adapt`` once bound to ``layer``)."""
        if name == "qkv":
            if "qkv" in self.targets:
                return y + self.delta("qkv", layer, x)
            slices = [t for t in ("q", "v") if t in self.targets]
            if not slices:
                return y
            # added in place to q's and v's slices of the projection's fresh output (its backward
            # keeps the input, not the output), not rebuilt by concatenation
            d = y.shape[-1] // 3
            if "q" in slices:
                y[..., :d] += self.delta("q", layer, x)
            if "v" in slices:
                y[..., 2 * d :] += self.delta("v", layer, x)
            return y
        return y + self.delta(name, layer, x) if name in self.targets else y

    def merged_delta(self, target: str, layer: int) -> torch.Tensor:
        """The evaluation forward's dense delta ``sum_tau B_tau A_tau diag(w_tau)`` (out, in) over tasks
        0..task (tests and the paper-dimension figures; the forward never builds it)."""
        a, b, w = (getattr(self, self.name(target, layer, p)).detach() for p in "abw")
        return sum(b[t] @ a[t] * w[t][None, :] for t in range(self.task + 1))  # type: ignore[return-value]


def is_adapter_array(name: str) -> bool:
    """Whether trainable array ``name`` is an adapter set (first dimension: the task)."""
    return name.startswith("prompt.lora_")
