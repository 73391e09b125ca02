"""The direction screens, which compare each reply with the coordinate-wise median update of the
replies on its task (its cosine, :mod:`.cosines`; 3+ replies compared):

* :class:`DirectionCheck` flags an update whose cosine is below ``min_cosine``
  (``update-min-cosine``, a strike), and excludes one whose cosine is below 0 while it is longer
  than ``reversed_norm`` x the lower median norm on its task (``update-reversed-norm``): a reversed
  update reads a negative cosine whatever its length;
* :class:`DirectionHistory` keeps a client's cosines over the run (``update-mean-cosine``): one whose
  replies point against their task's median update on average, judged from its
  ``update-mean-cosine-after``-th reply on, is excluded while its mean stays below the threshold
  (its replies are still judged, and kept again once the mean is back above). A reversed update of
  ordinary length reads cosines that swing with the round and often stays above any per-round
  threshold honest clients also cross; its mean does not. An honest client holding a task's
  minority class can point against the round for a few replies: it is left out while its mean is
  below, not for the rest of the run (the measurements: docs/reliability.md).

Both are off under client-side DP noise (``dp.noise-multiplier`` > 0 hides an honest update's
direction: it reads a cosine near 0), with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .base import DIRECTION, Screen, ScreenRound

if TYPE_CHECKING:
    from typing import Self

    from ....common.config.sections import RobustnessSection

log = logging.getLogger("promptfcl")


@dataclass(frozen=True)
class DirectionCheck(Screen):
    """Updates pointing against their task's median update: a cosine below ``min_cosine`` (-1: off)
    is flagged (a strike; excluded at once where strikes are off), a cosine below 0 with a norm
    above ``reversed_norm`` x the lower median norm of the task's replies (0: off) is excluded.

    Honest label-skewed updates disagree with the median too, but not strongly and long at once
    (docs/reliability.md): a reversed update that is also scaled up is what poisoning sends.
    """

    min_cosine: float = -1.0
    reversed_norm: float = 0.0

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        if not noisy:
            return cls(rob.update_min_cosine, rob.update_reversed_norm)
        if rob.update_min_cosine > -1 or rob.update_reversed_norm > 0 or rob.update_mean_cosine > -1:
            log.info("the direction checks (update-min-cosine, update-reversed-norm, update-mean-cosine) are not "
                     "applied: with dp.noise-multiplier > 0 the clients' noise hides their updates' directions")
        return cls()

    @property
    def active(self) -> bool:
        return self.min_cosine > -1 or self.reversed_norm > 0

    def __call__(self, cosines: Sequence[float | None], norms: Sequence[float],
                 references: Sequence[float]) -> list[tuple[str, bool] | None]:
        """Why each update is flagged and whether that alone excludes it (None: not flagged), from
        its cosine with its task's median update (None: fewer than 3 on its task, not judged), its
        norm and its task's lower median norm."""
        out: list[tuple[str, bool] | None] = []
        for cosine, norm, reference in zip(cosines, norms, references):
            if not self.active or cosine is None:
                out.append(None)
            elif self.reversed_norm > 0 and cosine < 0 and norm > self.reversed_norm * reference:
                out.append((f"a long update points against the round: cosine {cosine:.3f} with its task's median "
                            f"update and norm {norm:.3g}, above update-reversed-norm = {self.reversed_norm:g} x the "
                            f"lower median {reference:.3g}", True))
            elif cosine < self.min_cosine:
                out.append((f"update points against the round: cosine {cosine:.3f} with its task's median update, "
                            f"below update-min-cosine = {self.min_cosine:g}", False))
            else:
                out.append(None)
        return out

    def screen(self, r: ScreenRound) -> None:
        """Judge the compared replies; a flag is a strike (without a strike history it excludes at once)."""
        compared = r.compared
        flags = self([r.judged(i) for i in compared], [r.norms[i] for i in compared],
                     [r.references[r.tasks[i]] for i in compared])
        limit = r.strikes.limit if r.strikes is not None else 0
        for i, flag in zip(compared, flags):
            if flag is not None:
                r.flagged.add(i)
                r.strike(i, DIRECTION, flag[0], flag[1] or limit <= 0)


@dataclass
class DirectionHistory(Screen):
    """Each client's cosines with its task's median update over the run; a client whose mean is below
    ``mean_cosine`` (-1: off) once ``after`` of its replies were judged is excluded while it stays
    below. Kept in the checkpoint."""

    key = "direction-history"

    mean_cosine: float = -1.0
    after: int = 3
    sums: dict[int, tuple[float, int]] = field(default_factory=dict)  # client id -> (sum of cosines, replies)
    excluded: set[int] = field(default_factory=set)  # clients whose mean is below the threshold now

    @classmethod
    def of(cls, rob: RobustnessSection, noisy: bool) -> Self:
        return cls(-1.0 if noisy else rob.update_mean_cosine, rob.update_mean_cosine_after)

    @property
    def active(self) -> bool:
        return self.mean_cosine > -1

    def add(self, client: int, cosine: float) -> str | None:
        """Record one judged reply's cosine; why this reply is excluded (None: it is kept).

        A client stays excluded while its mean is below ``mean_cosine``, and its replies are kept
        again once the mean is back above it: a mean rises only on replies that agree with the
        round, so what a readmitted client can send against the round stays bounded by what it sent
        with it. An honest label-skewed client that disagreed in its first rounds comes back."""
        if not self.active:
            return None
        total, count = self.sums.get(client, (0.0, 0))
        total, count = total + cosine, count + 1
        self.sums[client] = (total, count)
        if count < self.after or total / count >= self.mean_cosine:
            if client in self.excluded:
                self.excluded.discard(client)
                log.info("client %d readmitted: mean cosine %.3f with its task's median update over %d replies, "
                         "back above update-mean-cosine = %g", client, total / count, count, self.mean_cosine)
            return None
        reason = (f"client {client}'s updates point against the round on average: mean cosine {total / count:.3f} "
                  f"with their task's median update over {count} replies, below update-mean-cosine = "
                  f"{self.mean_cosine:g}; its replies are excluded until the mean is back above it")
        if client not in self.excluded:
            log.warning("%s", reason)
        self.excluded.add(client)
        return reason

    def screen(self, r: ScreenRound) -> None:
        """Every compared reply's cosine is recorded, those excluded by the screens before included."""
        for i in r.compared:
            cosine = r.judged(i)
            reason = self.add(r.clients[i], cosine) if cosine is not None else None
            if reason is not None and i not in r.out.excluded:
                r.out.excluded[i] = (DIRECTION, reason)

    def to_dict(self) -> dict[str, list[float]]:
        return {str(k): [v[0], v[1], float(k in self.excluded)] for k, v in sorted(self.sums.items())}

    def load(self, state: Mapping[str, Sequence[float]]) -> None:
        self.sums = {int(k): (float(v[0]), int(v[1])) for k, v in state.items()}
        self.excluded = {int(k) for k, v in state.items() if len(v) > 2 and v[2]}
