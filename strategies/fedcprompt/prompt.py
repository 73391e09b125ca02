"""Fed-CPrompt's prompts: CODA-P that also uses the known future task slices, frozen (eq. 2)."""

from __future__ import annotations

import torch

from ...common.model.prompted import CodaPrompt


class FedCPromptPrompt(CodaPrompt):
    """CODA-P prompts that also use the known *future* task slices, frozen (eq. 2).

    ``known_tasks`` is the number of task slices the server has initialised (set by
    the client from the server's message; None = only slices 0..task, plain CODA-P).
    While training task m: slices < m and m < slices < known_tasks are used detached,
    slice m is trained, slices >= known_tasks are unused. Evaluation uses every known slice.
    """

    def __init__(self, embed_dim: int, layers: list[int], pool_size: int, length: int, num_tasks: int) -> None:
        super().__init__(embed_dim, layers, pool_size, length, num_tasks)
        self.known_tasks: int | None = None

    def known_stop(self) -> int:
        """End (exclusive) of the pool rows in use: the last known slice, at least the current one."""
        known = self.task + 1 if self.known_tasks is None else max(int(self.known_tasks), self.task + 1)
        return min(known, self.num_tasks) * self.per_task

    def _active(self, kind: str, layer: int, train: bool) -> torch.Tensor:
        param = getattr(self, f"{kind}{layer}")
        stop = self.known_stop()
        if not train:
            return param[:stop]
        s = self.slice_of(self.task)
        return torch.cat([param[: s.start].detach(), param[s], param[s.stop : stop].detach()], dim=0)
