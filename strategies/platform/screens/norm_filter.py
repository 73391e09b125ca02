"""The norm screens: :class:`NormFilter` excludes an update whose norm is above ``factor`` x the
round's lower median update norm (``update-norm-factor``) or above ``ceiling``
(``max-update-norm``); :class:`LongReply` excludes one longer than ``factor`` x its task's lower
median norm, times the clip's count allowance (``update-strike-norm``: above honest replies,
where ``update-clip`` sits inside their tail). Each exclusion is a strike against the client.

The lower median (the ceil(n/2)-th smallest) is an honest value while fewer than half of the
replies are hostile."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..replies import norm_outliers
from .base import NORM_FILTER, Screen, ScreenRound
from .clip import UpdateClip

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Self

    from ....common.config.sections import RobustnessSection


@dataclass(frozen=True)
class NormFilter(Screen):
    """Exclude updates above ``factor`` x the lower median norm (0: off) or above ``ceiling`` (0: off)."""

    factor: float = 0.0
    ceiling: float = 0.0

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        return cls(rob.update_norm_factor, rob.max_update_norm)

    @property
    def active(self) -> bool:
        return self.factor > 0 or self.ceiling > 0

    def __call__(self, norms: Sequence[float]) -> list[str | None]:
        return norm_outliers(norms, self.factor, self.ceiling) if self.active else [None] * len(norms)

    def screen(self, r: ScreenRound) -> None:
        """Every remaining reply's norm against the round's (all tasks together); each one excluded
        is a strike."""
        live = r.remaining()
        for i, reason in zip(live, self([r.norms[i] for i in live])):
            if reason is not None:
                r.strike(i, NORM_FILTER, reason, True)


@dataclass(frozen=True)
class LongReply(Screen):
    """Exclude an update longer than ``factor`` x its task's lower median norm x the clip's count
    allowance (``update-strike-norm``, 0: off), a strike; one strike per reply: a reply the direction
    check flagged (its strike) is excluded without a second."""

    factor: float = 0.0

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        return cls(rob.update_strike_norm)

    @property
    def active(self) -> bool:
        return self.factor > 0

    def screen(self, r: ScreenRound) -> None:
        if not self.active:
            return
        clip = r.find(UpdateClip)
        for i in r.compared:
            task = r.tasks[i]
            allowance = clip.allowance(r.samples[i], r.sizes[task]) if clip is not None else 1.0
            if i in r.out.excluded or not r.norms[i] > self.factor * r.references[task] * allowance:
                continue
            reason = (f"update norm {r.norms[i]:.3g} above update-strike-norm = {self.factor:g} x its task's "
                      f"lower median {r.references[task]:.3g}"
                      + (f" x {allowance:.3g} for its sample count" if allowance > 1 else ""))
            if i in r.flagged:
                r.out.excluded[i] = (NORM_FILTER, reason)
            else:
                r.strike(i, NORM_FILTER, reason, True)
