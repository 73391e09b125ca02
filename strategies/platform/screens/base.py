"""What every screen shares: the :class:`Screen` interface, the round a pipeline screens
(:class:`ScreenRound`: the replies' updates, norms, tasks, clients and sample counts, and what the
screens before made of them) and what the pipeline returns (:class:`Screening`).

A screen reads the round and writes to it in its turn (strategies/platform/screens/registry.py
sets the order): it excludes replies (``ScreenRound.exclude`` or ``ScreenRound.strike``), clips
them (``Screening.scales``) or measures what later screens read (each reply's cosine, each task's
reference norm). One with state over the run names its checkpoint entry (``key``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

if TYPE_CHECKING:
    from typing import Self

    from ....common.config.sections import RobustnessSection
    from .strikes import Strikes

S = TypeVar("S", bound="Screen")

NORM_FILTER, DIRECTION, CLIP, STRUCK_OUT = "norm-filter", "direction", "clip", "struck-out"


@dataclass
class Screening:
    """What the defences made of a round's updates (indices into the screened list)."""

    excluded: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (defence, reason)
    scales: dict[int, float] = field(default_factory=dict)  # index of a kept update -> its multiplier (< 1)
    cosines: list[float | None] = field(default_factory=list)  # each update's cosine with its task's median

    def counts(self) -> dict[str, int]:
        """Replies excluded by each defence and clipped, for the round's record (the four defences
        always; a registered screen's own only where it excluded a reply)."""
        out = {NORM_FILTER: 0, DIRECTION: 0, CLIP: len(self.scales), STRUCK_OUT: 0}
        for defence, _ in self.excluded.values():
            out[defence] = out.get(defence, 0) + 1
        return out


@dataclass
class ScreenRound:
    """One round's replies as the screens see them, and what the screens so far made of them."""

    updates: Sequence[Mapping[str, np.ndarray]]
    norms: Sequence[float]
    tasks: Sequence[int]
    clients: Sequence[int]
    samples: Sequence[float]  # each reply's sample count (0: unknown, no count allowance)
    out: Screening
    strikes: Strikes | None = None  # the run's strikes (set by the Strikes screen; None: off)
    # the replies compared with each other: those the norm filter kept (set by the norm reference)
    compared: list[int] = field(default_factory=list)
    references: dict[int, float] = field(default_factory=dict)  # task -> its lower median norm
    sizes: dict[int, float] = field(default_factory=dict)  # task -> the lower median count read with it
    flagged: set[int] = field(default_factory=set)  # replies the direction check flagged (their strike)
    screens: Sequence[Screen] = ()  # the pipeline's screens (a screen may read another's settings)

    def find(self, kind: type[S]) -> S | None:
        """The pipeline's screen of class ``kind`` (None: it has none)."""
        return next((s for s in self.screens if isinstance(s, kind)), None)

    def remaining(self) -> list[int]:
        """The replies not excluded so far, in order."""
        return [i for i in range(len(self.updates)) if i not in self.out.excluded]

    def judged(self, i: int) -> float | None:
        """Reply ``i``'s cosine as the direction screens judge it: None where fewer than 3 replies
        are compared (nor where fewer than 3 are on its task: no cosine)."""
        return self.out.cosines[i] if len(self.compared) >= 3 else None

    def strike(self, i: int, defence: str, reason: str, excludes: bool) -> None:
        """A strike against reply ``i``'s client (where strikes are on); the reply is excluded by
        ``defence`` where ``excludes``, as struck out where this strike reaches the limit."""
        strikes = self.strikes
        if strikes is not None and strikes.add(self.clients[i]) and not excludes:
            self.out.excluded[i] = (STRUCK_OUT, f"{reason}; client {self.clients[i]}'s strike {strikes.limit} "
                                                f"(update-strikes = {strikes.limit})")
        elif excludes:
            self.out.excluded[i] = (defence, reason)

    def task_groups(self, indices: Sequence[int]) -> list[list[int]]:
        """``indices`` grouped by task (tasks in increasing order)."""
        return [[i for i in indices if self.tasks[i] == task] for task in sorted({self.tasks[i] for i in indices})]


class Screen:
    """One screen: built from the run's robustness section (:meth:`of`; its default instance is off),
    applied to a round in its turn (:meth:`screen`), told when every screen has run (:meth:`close`).
    ``key``: its checkpoint entry (None: nothing kept over the run)."""

    key: ClassVar[str | None] = None

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        """The screen a defended run with robustness section ``rob`` applies (``noisy``: clients add
        DP noise, which hides an update's direction)."""
        raise NotImplementedError

    @property
    def active(self) -> bool:
        """Whether it alone can exclude or clip a reply (the run's record then counts the defences)."""
        return False

    def screen(self, r: ScreenRound) -> None:
        """Apply to a round's replies, after the screens before it."""

    def close(self, r: ScreenRound) -> None:
        """The round's screening is done (every screen has run): record what it kept."""

    def to_dict(self) -> Any:
        """Its checkpoint entry (where ``key`` is set)."""
        return {}

    def load(self, state: Any) -> None:
        """Restore :meth:`to_dict`'s entry."""
