"""Colluding hostile clients in a simulation: their replies replaced by the attack of
:mod:`.collusion`, before any screen sees them.

Why on the server: ALIE, IPM, Mimic, min-max and min-sum need the round's honest updates of the
colluders, which a real attacker gets by coordinating its clients out of band. In a simulation
the server is the one place where every colluder's honest update of the round exists at once,
so the hostile clients (``fault-clients``) train honestly, their fault mod sends what they
trained, and :class:`ColludingAttack` replaces their replies as the attacker would have sent
them, first thing after the record checks (the standard benchmark practice: an omniscient or
colluder-knowledge attacker applied at aggregation time, as ByzFL and FLPoison do).

Knowledge model (``fault-knowledge``): "colluders" (default) the hostile clients' own honest
updates of the round on the same task ("what an attacker would know"); "all" every reply on
that task (the omniscient attacker of the papers' strongest setting). The screens' parameters
are public either way, and none of these attacks reads them. Each task's replies are attacked
apart (clients on different tasks train different rows); the update is what the reply's
arrays differ from what its message started from (the arrays the method uploads, the screen's
update), flattened over them; statistics records are left as trained (the statistics attacks
forge those). Deployed nodes cannot collude this way: a colluding fault kind with
``population = "nodes"`` is refused by the run's configuration check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ...common.records import ARRAYS, array_views, arrays_of, to_array_record
from .collusion import COLLUDING_ATTACKS, malicious_update
from .rounds import Accepted, Sent

log = logging.getLogger("promptfcl")

KNOWLEDGE = ("colluders", "all")


@dataclass(frozen=True)
class ColludingAttack:
    """The run's colluding attack (inactive: ``kind`` not one of :data:`COLLUDING_ATTACKS`)."""

    kind: str = ""
    hostile: frozenset[int] = frozenset()
    knowledge: str = "colluders"
    z: float = 0.0  # ALIE's z; 0: the paper's formula
    epsilon: float = 0.5  # IPM's epsilon

    @property
    def active(self) -> bool:
        return self.kind in COLLUDING_ATTACKS and bool(self.hostile)

    def apply(self, replies: Sequence[Accepted],
              start_of: Callable[[Sent], Mapping[str, np.ndarray] | None]) -> int:
        """Replace, in place, the arrays of the hostile clients' ``replies`` by the attack, task by
        task; the number of replies replaced."""
        if not self.active:
            return 0
        replaced = 0
        for task in sorted({a.task for a in replies}):
            group = [a for a in replies if a.task == task]
            hostile = [a for a in group if a.client in self.hostile]
            if hostile:
                replaced += self._attack(group, hostile, start_of)
        if replaced:
            log.info("fault %s: %d replies of colluding clients replaced (knowledge: %s)", self.kind, replaced,
                     self.knowledge)
        return replaced

    def _attack(self, group: list[Accepted], hostile: list[Accepted],
                start_of: Callable[[Sent], Mapping[str, np.ndarray] | None]) -> int:
        known = hostile if self.knowledge == "colluders" else group
        arrays = {id(a): array_views(arrays_of(a.content)) for a in group}
        starts = {id(a): start_of(a.sent) or {} for a in group}
        first = arrays[id(hostile[0])]
        # the arrays every reply on the task holds with one shape (all of them, for one method)
        names = [n for n in first if all(n in arrays[id(a)] and np.shape(arrays[id(a)][n]) == np.shape(first[n])
                                         for a in group)]
        if not names:
            return 0

        def update(a: Accepted, name: str) -> np.ndarray:
            value = np.asarray(arrays[id(a)][name], dtype=np.float64)
            start = starts[id(a)].get(name)
            return value - np.asarray(start, dtype=np.float64) if start is not None and \
                np.shape(start) == value.shape else value

        flat = np.stack([np.concatenate([update(a, n).ravel() for n in names]) for a in known])
        bad = malicious_update(self.kind, flat, len(group), len(hostile), self.z, self.epsilon)
        for a in hostile:
            out, offset = dict(arrays[id(a)]), 0
            for name in names:
                value = np.asarray(arrays[id(a)][name])
                part = bad[offset:offset + value.size].reshape(value.shape)
                offset += value.size
                start = starts[id(a)].get(name)
                origin = np.asarray(start, dtype=np.float64) if start is not None and \
                    np.shape(start) == value.shape else 0.0
                out[name] = (origin + part).astype(value.dtype)
            a.content[ARRAYS] = to_array_record(out)
        return len(hostile)


__all__ = ["KNOWLEDGE", "ColludingAttack"]
