"""Powder's prompts: a local pool of the server's slices, the client's raw slice mixed in (eq. 3, 8)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ...common.model.prompted import CodaPrompt


class PowderPrompt(CodaPrompt):
    """CODA-P prompts restricted to a client's local pool (eq. 4), the first step applied in the
    forward pass.

    ``local_tasks`` (set by the client from the server's message; None = plain CODA-P over
    slices 0..task, as the server's evaluation uses) lists the task slices in use; the client
    loads them with the mixed slices of P_hat it was sent. With ``own_weights`` (set by
    :meth:`begin_round`: ``{s: G_task[s, task]}`` for every local task s) the current task's
    slice holds the raw slice's *change* on top of the P_hat slice it was sent, and that change
    enters every local slice with its eq. 3 weight:

        P_local[s] = P_hat[s] + G_task[s, task] * (x - x0)

    where x is the trained slice and x0 the P_hat slice it started from. That is eq. 3
    applied in the forward pass to the raw slice being trained (Powder, section 4.1 and
    eq. 8: the client learns its own P_c^t; the authors' code mixes the raw pool the same
    way inside the forward pass), computed from the k slices of P_hat the client was sent
    and k weights, so payloads stay eq. 4's. The reply x - x0 is the raw slice's change,
    which the server adds to its raw pool. While training, slices of other tasks are used
    detached; only the current task's slice learns.
    """

    # prompt-tuning's tokens stay in the sequence after their block (the authors' code; the paper's
    # Appendix A gives MHA([p; h_Q], [p; h_K], [p; h_V]) and does not say they are dropped)
    prompt_tokens = "accumulate"

    def __init__(self, embed_dim: int, layers: list[int], pool_size: int, length: int, num_tasks: int) -> None:
        super().__init__(embed_dim, layers, pool_size, length, num_tasks)
        self.local_tasks: list[int] | None = None
        self.own_weights: dict[int, float] | None = None
        self._start: dict[str, torch.Tensor] = {}  # x0: the current task's slice at the start of the round

    def begin_round(self, local_tasks: list[int], own_weights: Mapping[int, float] | None) -> None:
        """Use the local pool ``local_tasks`` (already loaded); mix the current slice's change
        into them with ``own_weights`` (None: no mixing, the current slice is used as it is)."""
        self.local_tasks = list(local_tasks)
        self.own_weights = None if own_weights is None else {int(t): float(w) for t, w in own_weights.items()}
        if self.own_weights is not None and set(self.own_weights) != set(self.local_tasks):
            raise ValueError(f"mixing weights for tasks {sorted(self.own_weights)}, local pool {self.local_tasks}")
        own = self.slice_of(self.task)
        self._start = {name: p[own].detach().clone() for name, p in self.named_parameters()}

    def end_round(self) -> None:
        """Back to plain CODA-P (the runtime's model is shared by every round of the process)."""
        self.local_tasks, self.own_weights, self._start = None, None, {}

    def _active(self, kind: str, layer: int, train: bool) -> torch.Tensor:
        if self.local_tasks is None:
            return super()._active(kind, layer, train)
        name = f"{kind}{layer}"
        param = getattr(self, name)
        own = param[self.slice_of(self.task)]
        weights = self.own_weights
        change = None if weights is None else own - self._start[name]
        parts = []
        for t in self.local_tasks:
            if change is None:
                part = param[self.slice_of(t)]
                parts.append(part if (not train or t == self.task) else part.detach())
            elif t == self.task:  # eq. 7's diagonal is 1: then the slice is the trained one itself, exactly
                assert weights is not None  # a change is made only with the weights
                w = weights[t]
                parts.append(own if w == 1.0 else self._start[name] + w * change)
            else:
                assert weights is not None
                parts.append(param[self.slice_of(t)].detach() + weights[t] * change)
        return torch.cat(parts, dim=0)

    def pool_rows(self) -> np.ndarray:
        """Pool rows of the local tasks, in the order ``_active`` stacks them."""
        tasks = range(self.task + 1) if self.local_tasks is None else self.local_tasks
        return np.concatenate([np.arange(self.pool_size)[self.slice_of(t)] for t in tasks])
