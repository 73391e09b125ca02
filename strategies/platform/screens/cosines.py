"""Each reply's cosine with the coordinate-wise median update of the replies on its task: what the
direction screens judge, and recorded in every round, defended or not (so a reader sees how far
honest clients disagree). Measured over the replies not excluded before it (those of clients
struck out earlier are not)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..replies import median_cosines
from .base import Screen, ScreenRound

if TYPE_CHECKING:
    from typing import Self

    from ....common.config.sections import RobustnessSection


class MedianCosines(Screen):
    """Not a defence (never excludes): the measurement the direction screens read."""

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        return cls()

    def screen(self, r: ScreenRound) -> None:
        """Each remaining reply's cosine (None: fewer than 3 on its task, or not finite)."""
        for group in r.task_groups(r.remaining()):
            for i, cosine in zip(group, median_cosines([r.updates[i] for i in group])):
                r.out.cosines[i] = None if cosine is None or not math.isfinite(cosine) else cosine

