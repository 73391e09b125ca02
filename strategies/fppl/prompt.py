"""FPPL's prompts: one prompt per task, fused by a cosine-linear layer on the query (eq. 2)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...common.model.prompted import CodaPrompt


def task_prompt_names(layers: list[int]) -> set[str]:
    """The trainable-state names of the per-task prompts (``prompt.p<layer>``, one row per task)."""
    return {f"prompt.p{layer}" for layer in layers}


class FPPLPrompt(CodaPrompt):
    """One prompt per task, fused by a cosine-linear layer on the query (eq. 2).

    Parameters (all travel in the trainable state as ``prompt.*``):

    * ``p{layer}`` (T, L, D): task ``t``'s prompt for block ``layer`` is row ``t``;
    * ``fusion`` (T, D): the cosine-linear layer ``psi``; row ``t`` scores task ``t``;
    * ``fusion_scale`` (1,): multiplies the cosine; stays 1 unless
      ``fppl.fusion-scale = "learnable"`` (the authors' code);
    * buffer ``hard_selection`` (1,): 1 selects the argmax task prompt instead of the
      softmax fusion (the "w/o fusion" ablation). It is a buffer so that the switch
      travels with the parameters: clients and the server's evaluator build the model
      from the prompt class alone, without the method options.

    ``pool_size`` is accepted for the shared constructor signature and ignored: FPPL
    has exactly one prompt per task.
    """

    hard_selection: torch.Tensor  # a buffer (register_buffer), typed for the checker

    def __init__(self, embed_dim: int, layers: list[int], pool_size: int, length: int, num_tasks: int) -> None:
        nn.Module.__init__(self)  # not CodaPrompt.__init__: none of its components/keys/attention
        self.embed_dim, self.layers, self.pool_size = embed_dim, list(layers), pool_size
        self.length, self.num_tasks = length, num_tasks
        self.per_task = 1
        self.task = 0
        for layer in self.layers:
            # Uniform in [-1, 1], as the authors' FedPrompt ("uniformly initialized", paper).
            self.register_parameter(
                f"p{layer}", nn.Parameter(torch.empty(num_tasks, length, embed_dim).uniform_(-1, 1))
            )
        bound = 1.0 / math.sqrt(embed_dim)  # CosineLinear's init
        self.fusion = nn.Parameter(torch.empty(num_tasks, embed_dim).uniform_(-bound, bound))
        self.fusion_scale = nn.Parameter(torch.ones(1))
        self.register_buffer("hard_selection", torch.zeros(1))

    # -- task bookkeeping -------------------------------------------------------
    def slice_of(self, task: int) -> slice:
        """Rows of ``p{layer}`` and ``fusion`` that belong to ``task``."""
        return slice(task, task + 1)

    def init_task_slice(self, task: int, generator: torch.Generator, orthogonal: bool = True) -> None:
        """Task 0: uniform random prompt. Task t > 0: copy of task t-1's prompt (p_t <- p_{t-1}).

        ``orthogonal`` is CODA-P's and has no meaning here.
        """
        with torch.no_grad():
            for layer in self.layers:
                param = getattr(self, f"p{layer}")
                if task == 0:
                    param[0] = torch.rand(param[0].shape, generator=generator) * 2 - 1
                else:
                    param[task] = param[task - 1]

    # -- fusion -------------------------------------------------------------------
    def task_scores(self, query: torch.Tensor) -> torch.Tensor:
        """g_psi(q): scaled cosine of the query with every task's row of psi, (B, T)."""
        return self.fusion_scale * (F.normalize(query, dim=-1) @ F.normalize(self.fusion, dim=-1).T)

    def weights(self, query: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Fusion weights (B, T): softmax over seen tasks 0..task, exactly 0 for unseen tasks.

        With ``hard_selection`` set, a one-hot of the argmax over seen tasks instead.
        """
        scores = self.task_scores(query)
        seen = torch.arange(self.num_tasks, device=scores.device) <= self.task
        scores = scores.masked_fill(~seen[None, :], float("-inf"))
        if bool(self.hard_selection.item()):
            return F.one_hot(scores.argmax(dim=1), self.num_tasks).to(scores.dtype)
        return torch.softmax(scores, dim=1)

    def task_prompts(self, layer: int) -> torch.Tensor:
        """Prompts of tasks 0..task (task+1, L, D); finished tasks' detached while training."""
        param = getattr(self, f"p{layer}")
        if self.training:
            return torch.cat([param[: self.task].detach(), param[self.task : self.task + 1]], dim=0)
        return param[: self.task + 1]

    def forward(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """Fused prompt (B, L, D) for ``layer``: sum_t w_t(q) p_t^(layer) (eq. 2)."""
        w = self.weights(query)[:, : self.task + 1]
        return torch.einsum("bt,tld->bld", w, self.task_prompts(layer))

    def orthogonality_penalty(self) -> torch.Tensor:
        """CODA-P's regulariser does not apply to FPPL."""
        return torch.zeros(())
