"""A method's trainable module: the one small protocol both families implement.

Two families sit in ``PromptedViT``'s ``prompt`` slot (the name is historical: read it as "the
trainable module"): CODA-P's prompt pools (common/model/prompted.py: ``CodaPrompt`` and the
methods' subclasses) and low-rank adapters (common/model/adapters.py: ``LowRankAdapters``; LoRM,
PILoRA). The prompted model, the platform and a node's memory plan use only what
:class:`TrainableModule` names, so none of them branches on the family:

* built from a :class:`ModuleShape` (``of``), then ``configure``-d from the run's method options;
* ``check_backbone``: refuse a backbone it cannot work in;
* ``in_block``: how it enters a block's forward: the block function to run (adapters wrap the
  block's projections) and the prompt tokens it adds there (None for a module that adds none);
* ``tokens_per_block``: how many tokens a prompted block's sequence gains (prompt-tuning's memory);
* one part per task: ``set_task``, ``slice_of`` (the rows of task t in each parameter, what the
  platform aggregates per task), ``init_task_slice`` (a task's part drawn afresh);
* its ``state_dict``: what travels (under the ``prompt.`` prefix of the trainable state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Self, runtime_checkable

import torch
from torch import nn

#: a block's forward as the prompted model runs it: ``forward(tokens, *prefix)``
BlockForward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class ModuleShape:
    """What sizes a trainable module: the backbone's token width, the blocks it works in and the
    tasks it keeps one part for; the prompt family also reads its pool (components per block) and
    prompt length, which the adapter family does not."""

    embed_dim: int
    layers: tuple[int, ...]
    num_tasks: int
    pool_size: int
    length: int


@runtime_checkable
class TrainableModule(Protocol):
    """What the prompted model and the platform need of a method's trainable module (an ``nn.Module``)."""

    layers: list[int]  # indices of the blocks it works in
    num_tasks: int
    task: int  # the task whose part trains (``set_task``)
    #: whether its forward reads q(x), the unprompted backbone's feature (the runtime caches it)
    uses_query: bool
    #: with prompt-tuning and ``prompt-tokens = "auto"``: what becomes of a block's prompt tokens
    #: after the block, "truncate" or "accumulate" (a module that adds none: either)
    prompt_tokens: str

    @classmethod
    def of(cls, shape: ModuleShape) -> Self:
        """The module of ``shape``, freshly initialised from torch's global generator."""
        ...

    @property
    def tokens_per_block(self) -> int:
        """Tokens a prompted block's sequence gains under prompt-tuning (0: none)."""
        ...

    def configure(self, options: Mapping[str, Any]) -> None:
        """Read the run's namespaced method options that shape the forward pass."""
        ...

    def check_backbone(self, backbone: Any) -> None:
        """Refuse (ConfigError) a backbone whose prompted blocks it cannot work in."""
        ...

    def in_block(self, layer: int, block: nn.Module, query: torch.Tensor) -> tuple[BlockForward, torch.Tensor | None]:
        """Block ``layer``'s forward with this module in it, and the prompt (B, L, D) it adds there
        (None: it adds no tokens; the forward is run on the tokens alone)."""
        ...

    def set_task(self, task: int) -> None: ...

    def slice_of(self, task: int) -> slice:
        """The rows of task ``task``'s part in each parameter (first dimension)."""
        ...

    def init_task_slice(self, task: int, generator: torch.Generator, orthogonal: bool = True) -> None: ...

    def orthogonality_penalty(self) -> torch.Tensor: ...

    # nn.Module's, as the prompted model and the platform call them
    def state_dict(self, *args: Any, **kwargs: Any) -> Any: ...

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self, *args: Any, **kwargs: Any) -> Iterator[nn.Parameter]: ...

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]: ...

    def buffers(self, *args: Any, **kwargs: Any) -> Iterator[torch.Tensor]: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...
