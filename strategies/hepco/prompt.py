"""HePCo's prompts: components weighted by the cosine of the query with their keys (sec. 5.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...common.model.prompted import CodaPrompt


class HePCoPrompt(CodaPrompt):
    """The paper's decomposed prompting (sec. 5.1): ``p = sum_m cos(q, K_m) P_m``.

    CODA-P without attention vectors (the paper's client weights are ``{P, K}``, so
    none are created and none travel). The paper describes one shared pool of M = 100 and no
    task slices, and the authors' code trains the whole pool on every task, nothing frozen:
    ``hepco.pool-training = "whole"`` (the default). ``"task-slices"`` keeps CODA-P's task
    slices, freezing of earlier slices and orthogonal initialisation of each new slice. Buffer
    ``whole_pool`` (1: the whole pool) travels with the parameters, so clients and evaluators
    follow the server's choice (0, a model that never received it: slices).
    """

    kinds = "pk"  # no attention vectors
    whole_pool: torch.Tensor  # a buffer (register_buffer), typed for the checker

    def __init__(self, embed_dim: int, layers: list[int], pool_size: int, length: int, num_tasks: int) -> None:
        super().__init__(embed_dim, layers, pool_size, length, num_tasks)
        self.register_buffer("whole_pool", torch.zeros(1))

    def slice_of(self, task: int) -> slice:
        """Task ``task``'s components: its CODA-P slice, or the whole pool (``whole_pool``)."""
        return slice(0, self.pool_size) if bool(self.whole_pool.item()) else super().slice_of(task)

    def init_task_slice(self, task: int, generator: torch.Generator, orthogonal: bool = True) -> None:
        """CODA-P's initialisation of the new slice; the whole pool is initialised once, at task 0."""
        if bool(self.whole_pool.item()) and task > 0:
            return
        super().init_task_slice(task, generator, orthogonal)

    def weights(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """alpha (B, M_active): cosine of the query with each active key."""
        keys = self._active("k", layer, self.training)
        return F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T
