"""Hostile-client defences on model updates: policies the platform applies to a round's replies.

They apply only where the run is defended (``defences``, common/config/trust.py): a simulation of this
project's own clients computes each paper's aggregation untouched. Each screen is one class, in
the order the platform applies them to the replies that passed the record checks:

* :class:`NormFilter` excludes an update whose norm is above ``factor`` x the round's lower
  median update norm (``update-norm-factor``) or above ``ceiling`` (``max-update-norm``);
* :class:`DirectionCheck` flags an update whose cosine with the coordinate-wise median update
  of the replies on its task is below ``min_cosine`` (``update-min-cosine``), and excludes one
  whose cosine is below 0 while it is longer than ``reversed_norm`` x the lower median norm on its
  task (``update-reversed-norm``): a reversed update reads a negative cosine whatever its length;
* :class:`UpdateClip` scales an update longer than ``factor`` x the lower median norm of the
  replies on its task that the norm filter kept (``update-clip``) down to that length, its
  direction kept; a reply on more samples than the task's lower median count is allowed
  sqrt(n / that count) more (``update-clip-by-count``: an honest update's norm grows with its
  local steps). Like the direction check it compares replies that trained the same rows: a
  client alone on its task (random tasks, asynchronous arrival) is not clipped, as the
  single-task reference of Powder's transfer metrics (server/transfer.py) is not.

The lower median norm and count a task's replies are measured against (the clip's, the long
reply's and the reversed reply's reference) are the lower of those of the replies the norm
filter kept in this round and those read with the task's kept replies of its previous rounds
(:class:`NormHistory`, ``update-norm-rounds``): at Dirichlet 0.1 a task's round can have three
replies, two of them hostile, and a round read alone then sets its own reference.

A client's cosines are also kept over the run (:class:`DirectionHistory`,
``update-mean-cosine``): one whose replies point against their task's median update on average,
judged from its ``update-mean-cosine-after``-th reply on, is excluded while its mean stays below
the threshold (its replies are still judged, and kept again once the mean is back above). A
reversed update of ordinary length reads cosines that swing with the round and often stays above
any per-round threshold honest clients also cross; its mean does not. An honest client holding a
task's minority class can point against the round for a few replies: it is left out while its
mean is below, not for the rest of the run (the measurements: docs/reliability.md).

Every reply the norm filter or the direction check flags (excluded, or pointing against the
round) is a strike against its client, kept for the run in :class:`Strikes` (``update-strikes``),
and so is a reply longer than ``strike_norm`` x its task's lower median, times the clip's count
allowance, which is also excluded (``update-strike-norm``: above honest replies, where
``update-clip`` sits inside their tail; a clip alone is no strike). A client whose strikes reach
the limit is excluded from then on, the reply that reached it included. An honest label-skewed
client disagrees with the round now and then, a hostile one in most rounds: so a lone
disagreement is recorded, not punished, and a hostile client's second strike ends its part in
the run.

The lower median (the ceil(n/2)-th smallest) and the coordinate-wise median are honest values
while fewer than half of the replies are hostile. :class:`UpdateScreen` runs the screens and
returns a :class:`Screening`: what each reply became, why, and each reply's cosine (recorded in
every round, defended or not, so a reader sees how far honest clients disagree). The platform
applies it (``UpdateScreen.apply``) among the run's policies (strategies/platform/policies.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ...common.records import ARRAYS, array_views, arrays_of, to_array_record
from .replies import clipped_update, lower_median, median_cosines, norm_outliers, update_norm, update_of
from .rounds import Accepted, Sent

log = logging.getLogger("promptfcl")

NORM_FILTER, DIRECTION, CLIP, STRUCK_OUT = "norm-filter", "direction", "clip", "struck-out"


@dataclass(frozen=True)
class NormFilter:
    """Exclude updates above ``factor`` x the lower median norm (0: off) or above ``ceiling`` (0: off)."""

    factor: float = 0.0
    ceiling: float = 0.0

    @property
    def active(self) -> bool:
        return self.factor > 0 or self.ceiling > 0

    def __call__(self, norms: Sequence[float]) -> list[str | None]:
        return norm_outliers(norms, self.factor, self.ceiling) if self.active else [None] * len(norms)


@dataclass(frozen=True)
class DirectionCheck:
    """Updates pointing against their task's median update: a cosine below ``min_cosine`` (-1: off)
    is flagged (a strike; excluded at once where strikes are off), a cosine below 0 with a norm
    above ``reversed_norm`` x the lower median norm of the task's replies (0: off) is excluded.

    Honest label-skewed updates disagree with the median too, but not strongly and long at once
    (docs/reliability.md): a reversed update that is also scaled up is what poisoning sends.
    """

    min_cosine: float = -1.0
    reversed_norm: float = 0.0

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


@dataclass
class Strikes:
    """Each client's strikes over the run: replies the norm filter or the direction check flagged.

    A client whose strikes reach ``limit`` (``update-strikes``) is excluded from then on; 0: off,
    nothing is counted and a direction flag excludes its reply at once. Kept in the checkpoint.
    """

    limit: int = 0
    counts: dict[int, int] = field(default_factory=dict)  # client id -> strikes so far

    def struck_out(self, client: int) -> bool:
        return self.limit > 0 and self.counts.get(client, 0) >= self.limit

    def add(self, client: int) -> bool:
        """Record a strike; whether the client is now struck out (never where strikes are off)."""
        if self.limit <= 0:
            return False
        self.counts[client] = self.counts.get(client, 0) + 1
        if self.counts[client] == self.limit:
            log.warning("client %d struck out: %d of its updates were too long or pointed against the round "
                        "(update-strikes = %d); its replies are excluded from now on",
                        client, self.limit, self.limit)
        return self.struck_out(client)

    def to_dict(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.counts.items())}

    def load(self, counts: Mapping[str, int]) -> None:
        self.counts = {int(k): int(v) for k, v in counts.items()}


@dataclass
class DirectionHistory:
    """Each client's cosines with its task's median update over the run; a client whose mean is below
    ``mean_cosine`` (-1: off) once ``after`` of its replies were judged is excluded while it stays
    below. Kept in the checkpoint, like :class:`Strikes`."""

    mean_cosine: float = -1.0
    after: int = 3
    sums: dict[int, tuple[float, int]] = field(default_factory=dict)  # client id -> (sum of cosines, replies)
    excluded: set[int] = field(default_factory=set)  # clients whose mean is below the threshold now

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

    def to_dict(self) -> dict[str, list[float]]:
        return {str(k): [v[0], v[1], float(k in self.excluded)] for k, v in sorted(self.sums.items())}

    def load(self, state: Mapping[str, Sequence[float]]) -> None:
        self.sums = {int(k): (float(v[0]), int(v[1])) for k, v in state.items()}
        self.excluded = {int(k) for k, v in state.items() if len(v) > 2 and v[2]}


@dataclass
class NormHistory:
    """The norms and sample counts of each task's kept replies over its last ``rounds`` rounds
    (``update-norm-rounds``): a round's reference norm (and count) is the lower of the round's own
    and the one read over these with the round's replies. Read over one round alone, a round where
    most replies on a task are hostile sets its own reference (at Dirichlet 0.1 a task's round can
    have 3 replies, 2 of them hostile); pooled, it stays honest while fewer than half of the pooled
    replies are hostile. The lower of the two, because honest norms shrink over a task's rounds
    (PILoRA's by 10x): pooled alone, a later round's 10x reply would read as ordinary. Kept in the
    checkpoint, like :class:`Strikes`."""

    rounds: int = 1
    kept: dict[int, list[list[tuple[float, float]]]] = field(default_factory=dict)  # task -> rounds of (norm, n)

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

    def to_dict(self) -> dict[str, list[list[list[float]]]]:
        return {str(t): [[[n, c] for n, c in r] for r in v] for t, v in sorted(self.kept.items())}

    def load(self, state: Mapping[str, Sequence[Sequence[Sequence[float]]]]) -> None:
        self.kept = {int(t): [[(float(n), float(c)) for n, c in r] for r in v] for t, v in state.items()}


@dataclass(frozen=True)
class UpdateClip:
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


@dataclass
class Screening:
    """What the defences made of a round's updates (indices into the screened list)."""

    excluded: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (defence, reason)
    scales: dict[int, float] = field(default_factory=dict)  # index of a kept update -> its multiplier (< 1)
    cosines: list[float | None] = field(default_factory=list)  # each update's cosine with its task's median

    def counts(self) -> dict[str, int]:
        """Replies excluded by each defence and clipped, for the round's record."""
        out = {NORM_FILTER: 0, DIRECTION: 0, CLIP: len(self.scales), STRUCK_OUT: 0}
        for defence, _ in self.excluded.values():
            out[defence] += 1
        return out


@dataclass(frozen=True)
class UpdateScreen:
    """The run's update defences, applied in order (all inactive where the run is not defended)."""

    norm_filter: NormFilter = NormFilter()
    direction: DirectionCheck = DirectionCheck()
    clip: UpdateClip = UpdateClip()
    strikes: Strikes = field(default_factory=Strikes)  # the run's history (mutable: screening updates it)
    history: DirectionHistory = field(default_factory=DirectionHistory)  # the run's cosines per client (mutable)
    norm_history: NormHistory = field(default_factory=NormHistory)  # each task's recent kept norms (mutable)
    # an update longer than this x its task's lower median (x its count allowance) is excluded, a strike (0: off)
    strike_norm: float = 0.0

    @property
    def active(self) -> bool:
        return self.norm_filter.active or self.direction.active or self.clip.active or self.history.active \
            or self.strike_norm > 0

    def __call__(self, updates: Sequence[Mapping[str, np.ndarray]], norms: Sequence[float],
                 tasks: Sequence[int], clients: Sequence[int] | None = None,
                 counts: Sequence[float] | None = None) -> Screening:
        """Screen one round's updates (``clients``: each update's client, for the strikes;
        ``counts``: each update's sample count, for the clip)."""
        strikes = self.strikes
        clients = clients if clients is not None else list(range(len(updates)))
        out = Screening(cosines=[None] * len(updates))
        for i, client in enumerate(clients):
            if strikes.struck_out(client):
                out.excluded[i] = (STRUCK_OUT, f"client {client} struck out earlier in the run "
                                               f"(update-strikes = {strikes.limit})")
        live = [i for i in range(len(updates)) if i not in out.excluded]
        for i, cosine in zip(live, _cosines([updates[i] for i in live], [tasks[i] for i in live])):
            out.cosines[i] = cosine

        def strike(i: int, defence: str, reason: str, excludes: bool) -> None:
            if strikes.add(clients[i]) and not excludes:
                out.excluded[i] = (STRUCK_OUT, f"{reason}; client {clients[i]}'s strike {strikes.limit} "
                                               f"(update-strikes = {strikes.limit})")
            elif excludes:
                out.excluded[i] = (defence, reason)

        for i, reason in zip(live, self.norm_filter([norms[i] for i in live])):
            if reason is not None:
                strike(i, NORM_FILTER, reason, True)
        kept = [i for i in live if i not in out.excluded]
        # each task's reference norm is read from what the norm filter kept, before the direction
        # check: what that check leaves may be a hostile majority (honest label-skewed updates can
        # disagree more than two attackers do)
        samples = list(counts) if counts is not None else [0.0] * len(updates)  # 0: unknown, no allowance
        medians = {task: self.norm_history.reference(task, [(norms[i], samples[i]) for i in kept if tasks[i] == task])
                   for task in set(tasks)}
        references = {task: norm for task, (norm, _) in medians.items()}
        sizes = {task: count for task, (_, count) in medians.items()}
        # the clip's count allowance: the long-reply bound grows with it too
        allowance = {i: self.clip.allowance(samples[i], sizes[tasks[i]]) for i in kept}
        cosines = out.cosines if len(kept) >= 3 else [None] * len(updates)
        for i, flag in zip(kept, self.direction([cosines[i] for i in kept], [norms[i] for i in kept],
                                                [references[tasks[i]] for i in kept])):
            if flag is not None:  # without a strike history a flag excludes at once
                strike(i, DIRECTION, flag[0], flag[1] or strikes.limit <= 0)
            if i not in out.excluded and self.strike_norm > 0 \
                    and norms[i] > self.strike_norm * references[tasks[i]] * allowance[i]:
                reason = (f"update norm {norms[i]:.3g} above update-strike-norm = {self.strike_norm:g} x its task's "
                          f"lower median {references[tasks[i]]:.3g}"
                          + (f" x {allowance[i]:.3g} for its sample count" if allowance[i] > 1 else ""))
                if flag is None:
                    strike(i, NORM_FILTER, reason, True)
                else:  # one strike per reply: the direction check's flag was this reply's
                    out.excluded[i] = (NORM_FILTER, reason)
        for i in kept:
            cosine = cosines[i]
            reason = self.history.add(clients[i], cosine) if cosine is not None else None
            if reason is not None and i not in out.excluded:
                out.excluded[i] = (DIRECTION, reason)
        kept = [i for i in kept if i not in out.excluded]
        for group in _task_groups([tasks[i] for i in kept]):  # norms compared among replies on one task
            members = [kept[j] for j in group]
            task = tasks[members[0]]
            for i, scale in zip(members, self.clip.scales([norms[i] for i in members], references[task],
                                                          [samples[i] for i in members], sizes[task])):
                if scale < 1.0:
                    out.scales[i] = scale
        for task in set(tasks):
            self.norm_history.add(task, [(norms[i] * out.scales.get(i, 1.0), samples[i]) for i in kept
                                         if tasks[i] == task])
        return out

    def apply(self, replies: Sequence[Accepted], start_of: Callable[[Sent], Mapping[str, np.ndarray] | None]
              ) -> tuple[list[Accepted], list[tuple[Accepted, str]], dict[str, int]]:
        """Screen a round's replies that passed the record checks, as the platform does.

        Each reply's update is measured from what ``start_of`` says its message started from (once,
        for every screen); each reply gets its ``update_norm`` and ``cosine``, and a clipped one its
        shortened arrays (its direction kept). Returns the replies kept, those excluded with why,
        and the replies each defence excluded or clipped.
        """
        # each update read from the reply's own bytes when needed (no decoded or float64 copy of every reply)
        updates = [update_of(array_views(arrays_of(a.content)), start_of(a.sent)) for a in replies]
        norms = [update_norm(u, None) for u in updates]
        screening = self(updates, norms, [a.task for a in replies], [a.sent.client for a in replies],
                         [a.examples for a in replies])
        kept, excluded = [], []
        for i, a in enumerate(replies):
            a.update_norm, a.cosine = norms[i], screening.cosines[i]
            if i in screening.excluded:
                excluded.append((a, screening.excluded[i][1]))
                continue
            if i in screening.scales:  # norm bounding: shortened, its direction kept
                a.content[ARRAYS] = to_array_record(clipped_update(
                    array_views(arrays_of(a.content)), start_of(a.sent), screening.scales[i]))
                a.update_norm = norms[i] * screening.scales[i]
            kept.append(a)
        return kept, excluded, screening.counts()


def _lower_medians(replies: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The lower median norm and the lower median count of (norm, count) pairs."""
    return lower_median([n for n, _ in replies]), lower_median([c for _, c in replies])


def _task_groups(tasks: Sequence[int]) -> list[list[int]]:
    return [[i for i, t in enumerate(tasks) if t == task] for task in sorted(set(tasks))]


def _cosines(updates: Sequence[Mapping[str, np.ndarray]], tasks: Sequence[int]) -> list[float | None]:
    """Each update's cosine with the coordinate-wise median update of its task (None: fewer than 3 on it)."""
    out: list[float | None] = [None] * len(updates)
    for group in _task_groups(tasks):
        for i, cosine in zip(group, median_cosines([updates[i] for i in group])):
            out[i] = None if cosine is None or not math.isfinite(cosine) else cosine
    return out


def update_screen(defended: bool, dp_noise: float, *, norm_factor: float = 0.0, max_norm: float = 0.0,
                  clip: float = 0.0, clip_by_count: bool = False, strike_norm: float = 0.0,
                  min_cosine: float = -1.0, reversed_norm: float = 0.0,
                  strikes: int = 0, mean_cosine: float = -1.0, mean_after: int = 3,
                  norm_rounds: int = 1) -> UpdateScreen:
    """The run's screen: every defence off where the run is not ``defended``; the direction checks
    off under client-side DP noise (``dp_noise`` > 0 hides an honest update's direction: it reads a
    cosine near 0), with a log line. Each keyword is one run-config key's value (``update-norm-factor``,
    ``max-update-norm``, ``update-clip``, ``update-clip-by-count``, ``update-strike-norm``, ``update-min-cosine``,
    ``update-reversed-norm``, ``update-strikes``, ``update-mean-cosine``, ``update-mean-cosine-after``,
    ``update-norm-rounds``);
    its default leaves that defence off."""
    if not defended:
        return UpdateScreen()
    if (min_cosine > -1 or reversed_norm > 0 or mean_cosine > -1) and dp_noise > 0:
        log.info("the direction checks (update-min-cosine, update-reversed-norm, update-mean-cosine) are not "
                 "applied: with dp.noise-multiplier > 0 the clients' noise hides their updates' directions")
        min_cosine, reversed_norm, mean_cosine = -1.0, 0.0, -1.0
    return UpdateScreen(NormFilter(norm_factor, max_norm), DirectionCheck(min_cosine, reversed_norm),
                        UpdateClip(clip, clip_by_count),
                        Strikes(strikes), DirectionHistory(mean_cosine, mean_after), NormHistory(norm_rounds),
                        strike_norm)
