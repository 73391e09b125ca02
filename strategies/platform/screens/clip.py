"""Each task's reference norm, and the clip measured against it.

:class:`NormHistory` reads, after the norm filter, the lower median norm and count of the replies
on each task that the filter kept: the lower of those of this round's and those read with the
task's kept replies of its previous rounds (``update-norm-rounds``; at Dirichlet 0.1 a task's round
can have three replies, two of them hostile, and a round read alone then sets its own reference).
The later screens (the long-reply bound, the direction check, the clip) measure against it.

:class:`UpdateClip` scales an update longer than ``factor`` x its task's reference norm
(``update-clip``) down to that length, its direction kept; a reply on more samples than the task's
lower median count is allowed sqrt(n / that count) more (``update-clip-by-count``: an honest
update's norm grows with its local steps). It compares replies that trained the same rows: a
client alone on its task (random tasks, asynchronous arrival) is not clipped, as the single-task
reference of Powder's transfer metrics (server/transfer.py) is not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..replies import lower_median
from .base import Screen, ScreenRound

if TYPE_CHECKING:
    from typing import Self

    from ....common.config.sections import RobustnessSection


@dataclass
class NormHistory(Screen):
    """The norms and sample counts of each task's kept replies over its last ``rounds`` rounds
    (``update-norm-rounds``): a round's reference norm (and count) is the lower of the round's own
    and the one read over these with the round's replies. Read over one round alone, a round where
    most replies on a task are hostile sets its own reference (at Dirichlet 0.1 a task's round can
    have 3 replies, 2 of them hostile); pooled, it stays honest while fewer than half of the pooled
    replies are hostile. The lower of the two, because honest norms shrink over a task's rounds
    (PILoRA's by 10x): pooled alone, a later round's 10x reply would read as ordinary. Kept in the
    checkpoint."""

    key = "norm-history"

    rounds: int = 1
    kept: dict[int, list[list[tuple[float, float]]]] = field(default_factory=dict)  # task -> rounds of (norm, n)

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        return cls(rob.update_norm_rounds)

    def reference(self, task: int, current: list[tuple[float, float]]) -> tuple[float, float]:
        """The lower median norm and count of ``current`` (a round's replies on ``task``: norm, n), or
        of those with the task's earlier rounds kept here where that norm is lower; the round's own
        for a client alone on its task (compared with nothing)."""
        alone = _lower_medians(current)
        if self.rounds <= 1 or len(current) < 2:
            return alone
        pooled = [x for earlier in self.kept.get(task, [])[-(self.rounds - 1):] for x in earlier] + current
        return min(alone, _lower_medians(pooled))

    def add(self, task: int, kept: list[tuple[float, float]]) -> None:
        """Record one round's kept replies on ``task`` (their norms as aggregated, clipped ones clipped)."""
        if self.rounds > 1:
            self.kept[task] = (self.kept.get(task, []) + [kept])[-(self.rounds - 1):]

    def screen(self, r: ScreenRound) -> None:
        """The replies compared from now on (those the norm filter kept: what the direction check
        leaves may be a hostile majority, as honest label-skewed updates can disagree more than two
        attackers do) and each task's reference norm and count read from them."""
        r.compared = r.remaining()
        for task in set(r.tasks):
            r.references[task], r.sizes[task] = self.reference(
                task, [(r.norms[i], r.samples[i]) for i in r.compared if r.tasks[i] == task])

    def close(self, r: ScreenRound) -> None:
        kept = [i for i in r.compared if i not in r.out.excluded]
        for task in set(r.tasks):
            self.add(task, [(r.norms[i] * r.out.scales.get(i, 1.0), r.samples[i]) for i in kept if r.tasks[i] == task])

    def to_dict(self) -> dict[str, list[list[list[float]]]]:
        return {str(t): [[[n, c] for n, c in r] for r in v] for t, v in sorted(self.kept.items())}

    def load(self, state: Mapping[str, Sequence[Sequence[Sequence[float]]]]) -> None:
        self.kept = {int(t): [[(float(n), float(c)) for n, c in r] for r in v] for t, v in state.items()}


@dataclass(frozen=True)
class UpdateClip(Screen):
    """Scale an update longer than its bound down to it (``factor`` 0: off). The bound is ``factor`` x
    its task's lower median norm; ``by_count``: times sqrt(n / the lower median n) for a reply that
    trained on more samples than that median (never less).

    An honest update's norm grows with the samples its client trained on (more local steps; the
    measured growth per method: docs/reliability.md), so under label skew the long honest replies
    are those of the clients holding most of a class, whose rows the clip would shorten (PILoRA's
    prototypes are such rows); sqrt(n) bounds that growth from above.
    """

    factor: float = 0.0
    by_count: bool = False

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        return cls(rob.update_clip, rob.update_clip_by_count)

    @property
    def active(self) -> bool:
        return self.factor > 0

    def allowance(self, count: float, count_reference: float) -> float:
        """What a reply's bounds are multiplied by: sqrt(``count`` / ``count_reference``), never below
        1, where ``by_count`` and the reference is known (> 0); else 1."""
        if not self.by_count or not count_reference > 0:
            return 1.0
        return max(1.0, math.sqrt(count / count_reference))

    def scales(self, norms: Sequence[float], reference: float, counts: Sequence[float] | None = None,
               count_reference: float = 0.0) -> list[float]:
        """The multiplier of each update (1: untouched); ``counts``: each reply's sample count,
        ``count_reference``: the lower median count its ``reference`` norm was read with."""
        bound = self.factor * reference
        if not self.active or len(norms) < 2 or not bound > 0:
            return [1.0] * len(norms)
        bounds = [bound * self.allowance(c, count_reference) for c in (counts or [0.0] * len(norms))]  # 0: none
        return [b / n if n > b else 1.0 for n, b in zip(norms, bounds)]

    def screen(self, r: ScreenRound) -> None:
        """Clip the replies kept so far, norms compared among the replies on one task."""
        for members in r.task_groups([i for i in r.compared if i not in r.out.excluded]):
            task = r.tasks[members[0]]
            for i, scale in zip(members, self.scales([r.norms[i] for i in members], r.references[task],
                                                     [r.samples[i] for i in members], r.sizes[task])):
                if scale < 1.0:
                    r.out.scales[i] = scale


def _lower_medians(replies: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The lower median norm and the lower median count of (norm, count) pairs."""
    return lower_median([n for n, _ in replies]), lower_median([c for _, c in replies])
