"""FPPL's prototypes on the server: sets of (client, class) prototypes, and classifier debiasing (eq. 4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PrototypeSet:
    """A flat list of prototypes: one row per (client, class).

    Attributes
    ----------
    classes : (n,) int64 class of each prototype.
    means : (n, D) float32 prototypes.
    clients : (n,) int64 client id that produced it (-1 when unknown).
    """

    classes: np.ndarray
    means: np.ndarray
    clients: np.ndarray

    def __post_init__(self) -> None:
        self.classes = np.asarray(self.classes, np.int64).reshape(-1)
        self.means = np.asarray(self.means, np.float32)
        self.clients = np.asarray(self.clients, np.int64).reshape(-1)

    @classmethod
    def empty(cls, dim: int = 0) -> PrototypeSet:
        return cls(np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(self.classes.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.classes.nbytes + self.means.nbytes + self.clients.nbytes)

    def concat(self, other: PrototypeSet) -> PrototypeSet:
        if not len(self):
            return other
        if not len(other):
            return self
        return PrototypeSet(np.concatenate([self.classes, other.classes]),
                            np.concatenate([self.means, other.means]),
                            np.concatenate([self.clients, other.clients]))

    def replace_clients(self, newer: PrototypeSet, classes_per_task: int | None = None) -> PrototypeSet:
        """Keep only the newest prototypes of each client: drop ours of clients in ``newer``.

        With ``classes_per_task`` (the stream's tasks: task t owns classes [t k, (t+1) k)), only
        ours of the same (client, task) pairs: a client's prototypes of another task stay.
        """
        keep = ~np.isin(self.keys(classes_per_task), np.unique(newer.keys(classes_per_task)))
        return self.select(keep).concat(newer)

    def keys(self, classes_per_task: int | None = None) -> np.ndarray:
        """One key per prototype: its client, or its (client, task) pair with ``classes_per_task``."""
        if classes_per_task is None:
            return self.clients
        return np.stack([self.clients, self.classes // classes_per_task], axis=1).view(np.dtype((np.void, 16))).ravel()

    def select(self, mask: np.ndarray) -> PrototypeSet:
        """The prototypes where ``mask`` is true, in order."""
        return PrototypeSet(self.classes[mask], self.means[mask], self.clients[mask])

    def class_means(self) -> tuple[np.ndarray, np.ndarray]:
        """Eq. 5: per class, the plain (unweighted) mean over the clients holding it."""
        classes = np.unique(self.classes)
        rows = [self.means[self.classes == c] for c in classes]
        means = np.stack([r.astype(np.float64).mean(axis=0) for r in rows]) \
            if len(classes) else np.zeros((0, self.means.shape[1]))
        return classes.astype(np.int64), means.astype(np.float32)

    def to_state(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}_classes": self.classes, f"{prefix}_means": self.means, f"{prefix}_clients": self.clients}

    @classmethod
    def from_state(cls, state: dict[str, Any], prefix: str) -> PrototypeSet:
        return cls(state[f"{prefix}_classes"], state[f"{prefix}_means"], state[f"{prefix}_clients"])


# ---------------------------------------------------------------------------- debiasing
def debias_head(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
                epochs: int, lr: float, batch_size: int, seed: Any) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 4: train the linear head with CE on prototypes; returns the new (weight, bias).

    Logits are restricted to the classes present among the prototypes (as the authors'
    code does): classes without a prototype are neither pushed up nor down, which
    matters for FPPL-WOP, where only the current task's classes have prototypes.
    Adam, shuffled mini-batches (seeded), a fresh optimiser per call.
    """
    head = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(np.asarray(weight, np.float32)))
        head.bias.copy_(torch.from_numpy(np.asarray(bias, np.float32)))
    x = torch.from_numpy(np.asarray(features, np.float32))
    y = torch.from_numpy(np.asarray(labels, np.int64))
    allowed = torch.zeros(weight.shape[0], dtype=torch.bool)
    allowed[y.unique()] = True
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), batch_size):
            sel = order[start : start + batch_size]
            logits = head(x[sel]).masked_fill(~allowed[None, :], float("-inf"))
            loss = F.cross_entropy(logits, y[sel])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return (head.weight.detach().numpy().astype(weight.dtype, copy=False),
            head.bias.detach().numpy().astype(bias.dtype, copy=False))
