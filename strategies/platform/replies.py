"""What a client reply may contain, and how accepted replies are combined.

Any client may be broken or hostile, so the server checks every field of every reply
before using it (``PromptStrategy.check_reply`` calls the checks here) and bounds what one
reply can do to the model:

* metrics: every field of the ``metrics`` record has a declared type and range
  (:data:`REPLY_METRICS`); a missing, mistyped, non-finite or out-of-range field, or one
  that is not declared, excludes the reply;
* update norms: a reply whose update (its arrays minus what it was sent) is more than
  ``update-norm-factor`` times the round's lower median update norm, or above
  ``max-update-norm``, is excluded (the lower median is an honest reply's norm while fewer
  than half of the replies are hostile, and with two replies the smaller one);
* directions: with ``update-min-cosine`` above -1, an update whose cosine with the round's
  coordinate-wise median update is below it is excluded (:func:`direction_outliers`);
* weights: with ``population = "nodes"`` (counts that the server cannot verify) no reply
  gets more than ``max-client-weight`` of a round's weight once 3 or more replies arrive;
* combination: sample-weighted mean (FedAvg), or coordinate-wise median or trimmed mean
  (``aggregation``), the latter two with Flower's own aggregation functions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...common.config.experiment import AGGREGATIONS
from ...common.node.startup import PHASES, metric_name


@dataclass(frozen=True)
class MetricSpec:
    """One field of a reply's metrics record: its type and the range it must lie in."""

    kind: type  # int or float (a float field takes an int too)
    required: bool = True
    low: float = -math.inf
    high: float = math.inf

    def check(self, name: str, value: Any) -> str | None:
        """Why ``value`` is not a valid ``name`` (None: it is)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                (self.kind is int and not isinstance(value, int)):
            return f"metric {name!r} must be a single {self.kind.__name__}, got {type(value).__name__}"
        if not math.isfinite(value):
            return f"metric {name!r} is not finite ({value})"
        if not self.low <= value <= self.high:
            return f"metric {name!r} = {value} out of range [{self.low}, {self.high}]"
        return None


#: what a message's process cost (deployment): its age at the reply, and a fresh process's
#: seconds per start-up phase (common/node/startup.py); train and evaluation replies carry them
PROCESS_METRICS: dict[str, MetricSpec] = {
    "process-seconds": MetricSpec(float, required=False, low=0),
    **{metric_name(p): MetricSpec(float, required=False, low=0) for p in PHASES},
}
#: population = nodes: the data a node declares it holds (the server bounds its counts by it)
DECLARED_SIZES: dict[str, MetricSpec] = {
    "train-size": MetricSpec(int, required=False, low=0),
    "test-size": MetricSpec(int, required=False, low=0),
}

#: a node with a memory budget or its own backbone precision: what it chose (client/memory.py)
PLAN_METRICS: dict[str, MetricSpec] = {
    "memory-budget-mb": MetricSpec(float, required=False, low=0),
    "held-mb": MetricSpec(float, required=False, low=0),  # what the process held when it planned
    "micro-batch": MetricSpec(int, required=False, low=0),
    "checkpointed-blocks": MetricSpec(int, required=False, low=0),
    "backbone-bits": MetricSpec(int, required=False, low=8, high=32),
    "peak-rss-mb": MetricSpec(float, required=False, low=0),
    "over-budget-mb": MetricSpec(float, required=False, low=0),  # the peak above the budget, where it passed it
    "backbone-mapped-mb": MetricSpec(float, required=False, low=0),
}

#: the metrics record of a train reply (strategies/platform/learner.py, client/app.py)
REPLY_METRICS: dict[str, MetricSpec] = {
    "num-examples": MetricSpec(int, low=0),
    "train-loss": MetricSpec(float),
    "train-seconds": MetricSpec(float, low=0),
    "setup-seconds": MetricSpec(float, required=False, low=0),  # deployment: process start to training
    # evaluate-with-train: time the node spent evaluating the received model before training
    "evaluation-seconds": MetricSpec(float, required=False, low=0),
    "device-peak-mb": MetricSpec(float, required=False, low=0),  # clients on CUDA
    **PROCESS_METRICS,
    **DECLARED_SIZES,
    **PLAN_METRICS,
}


def check_metrics(record: Mapping[str, Any], specs: Mapping[str, MetricSpec]) -> str | None:
    """Why a metrics record does not follow ``specs`` (None: it does)."""
    unknown = sorted(set(record.keys()) - set(specs))
    if unknown:
        return f"undeclared metrics {unknown[:4]}"
    for name, spec in specs.items():
        if name not in record:
            if spec.required:
                return f"metric {name!r} missing"
            continue
        reason = spec.check(name, record[name])
        if reason is not None:
            return reason
    return None


#: elements of one array read at a time where the server combines or compares replies: a round's
#: temporaries are a few chunks, not a float64 copy of every reply (ServerApp memory, common/node/footprint.py)
CHUNK = 1 << 20


def chunks(size: int) -> list[slice]:
    """Flat slices of at most :data:`CHUNK` elements covering ``size``."""
    return [slice(start, min(start + CHUNK, size)) for start in range(0, size, CHUNK)] or [slice(0, 0)]


@dataclass(frozen=True)
class Update(Mapping[str, np.ndarray]):
    """``reply - start`` per array, computed in float64 when read, never all at once: the screen
    reads every reply's update several times (norm, cosine), a chunk at a time (:meth:`part`)."""

    reply: Mapping[str, np.ndarray]
    start: Mapping[str, np.ndarray] | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        return self.part(name, slice(None)).reshape(np.shape(self.reply[name]))

    def __iter__(self) -> Any:
        return iter(self.reply)

    def __len__(self) -> int:
        return len(self.reply)

    def __contains__(self, name: object) -> bool:
        return name in self.reply

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self.reply[name]))

    def size(self, name: str) -> int:
        return int(np.size(self.reply[name]))

    def part(self, name: str, rows: slice) -> np.ndarray:
        """Flat elements ``rows`` of array ``name``'s update, float64."""
        value = np.ravel(self.reply[name])[rows].astype(np.float64)
        if self.start is not None:
            value -= np.ravel(self.start[name])[rows]
        return value


def as_update(value: Mapping[str, np.ndarray]) -> Update:
    return value if isinstance(value, Update) else Update(value)


def update_norm(reply: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray] | None) -> float:
    """L2 norm of ``reply - start`` over all arrays (of ``reply`` itself when ``start`` is None)."""
    update = Update(reply, start) if start is not None else as_update(reply)
    total = 0.0
    for name in update:
        for rows in chunks(update.size(name)):
            part = update.part(name, rows)
            total += float(part @ part)
    return math.sqrt(total)


def update_of(reply: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray] | None) -> Update:
    """``reply - start`` per array, in float64 (``reply`` itself when ``start`` is None), computed when read."""
    return Update(reply, start)


def lower_median(values: Sequence[float]) -> float:
    """The ceil(n/2)-th smallest value (0 for none): a hostile minority cannot move it."""
    return float(np.sort(np.asarray(values, dtype=np.float64))[(len(values) - 1) // 2]) if len(values) else 0.0


def clipped_update(reply: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray] | None,
                   scale: float) -> dict[str, np.ndarray]:
    """``start + scale x (reply - start)`` per array (``scale x reply`` when ``start`` is None), in
    the reply's dtypes: the update shortened, its direction kept."""
    out = {}
    for name, value in reply.items():
        value = np.asarray(value)
        origin = np.zeros(1) if start is None else np.asarray(start[name], dtype=np.float64)
        out[name] = (origin + scale * (value.astype(np.float64) - origin)).astype(value.dtype)
    return out


def norm_outliers(norms: Sequence[float], factor: float, ceiling: float) -> list[str | None]:
    """For each norm, why it is an outlier (None: it is not).

    ``factor`` > 0: above ``factor`` times the lower median of all the norms (the
    ceil(n/2)-th smallest: a hostile minority cannot move it, and of two replies it is the
    smaller); ``ceiling`` > 0: above ``ceiling``.
    """
    reference = lower_median(norms)
    out: list[str | None] = []
    for n in norms:
        if ceiling > 0 and n > ceiling:
            out.append(f"update norm {n:.3g} above max-update-norm = {ceiling:g}")
        elif factor > 0 and len(norms) > 1 and n > factor * reference:
            out.append(f"update norm {n:.3g} above update-norm-factor = {factor:g} x the round's lower median "
                       f"{reference:.3g}")
        else:
            out.append(None)
    return out


def median_cosines(updates: Sequence[Mapping[str, np.ndarray]]) -> list[float | None]:
    """Each update's cosine with the coordinate-wise median of ``updates`` (None for all: fewer
    than 3, or no array that every update holds with one shape; a zero update reads 1).

    Only arrays that every update holds with one shape are compared (clients on other task
    slices); the median of two is their mean, so fewer than 3 updates are never judged. Read a
    chunk of every update at a time (dot products and norms summed over the chunks).
    """
    lazy = [as_update(u) for u in updates]
    names = [n for n in lazy[0] if all(n in u and u.shape(n) == lazy[0].shape(n) for u in lazy)] if lazy else []
    if len(updates) < 3 or not names:
        return [None] * len(updates)
    dots, norms, ref_sq = np.zeros(len(lazy)), np.zeros(len(lazy)), 0.0
    for name in names:
        for rows in chunks(lazy[0].size(name)):
            flat = np.stack([u.part(name, rows) for u in lazy])
            reference = np.median(flat, axis=0)
            dots += flat @ reference
            norms += np.einsum("ij,ij->i", flat, flat)
            ref_sq += float(reference @ reference)
    ref_norm = math.sqrt(ref_sq)
    return [float(d) / (math.sqrt(n) * ref_norm) if n > 0 and ref_norm > 0 else 1.0 for d, n in zip(dots, norms)]


def direction_outliers(updates: Sequence[Mapping[str, np.ndarray]], min_cosine: float) -> list[str | None]:
    """For each update, why it points against the round (None: it does not): its cosine with the
    coordinate-wise median of all the round's updates is below ``min_cosine`` (:func:`median_cosines`).

    The median update is an honest one's direction while fewer than half of the replies are
    hostile, so a reversed update (a sign flip, whatever its length) reads a negative cosine.
    """
    return [None if c is None or c >= min_cosine else
            f"update points against the round: cosine {c:.3f} with the median update, below "
            f"update-min-cosine = {min_cosine:g}" for c in median_cosines(updates)]


def capped_weights(counts: Sequence[float] | np.ndarray, cap: float) -> np.ndarray:
    """Normalised weights proportional to ``counts`` with none above ``cap`` (excess shared
    among the others in proportion); unchanged when no weight exceeds ``cap`` or a cap
    cannot be met (fewer than 1 / cap replies)."""
    w = np.asarray(counts, dtype=np.float64)
    w = w / w.sum()
    if cap <= 0 or cap >= 1 or len(w) * cap < 1 or (w <= cap).all():
        return w
    capped = np.zeros(len(w), dtype=bool)
    while True:
        over = (w > cap + 1e-12) & ~capped
        if not over.any():
            return w
        capped |= over
        free = 1.0 - cap * capped.sum()
        rest = w[~capped]
        w = np.where(capped, cap, w * free / rest.sum() if rest.sum() > 0 else 0.0)


def combine(values: Sequence[np.ndarray], weights: np.ndarray, mode: str = "mean", trim: float = 0.2) -> np.ndarray:
    """One array from the replies' arrays: weighted mean, or coordinate-wise median or
    trimmed mean (unweighted, Flower's ``aggregate_median`` / ``aggregate_trimmed_avg``),
    computed in float64 and cast back to the first array's dtype, a chunk of elements at a time
    (each element's arithmetic is the whole array's: the result is the same)."""
    if mode not in AGGREGATIONS or mode in ("krum", "multikrum", "bulyan"):  # those: aggregation.Combiner
        raise ValueError(f"unknown coordinate-wise aggregation {mode!r}; one of mean, median, trimmed-mean")
    first = np.asarray(values[0])
    flat = [np.ravel(np.asarray(v)) for v in values]
    out = np.empty(first.size, dtype=first.dtype)
    if mode == "mean":
        w = np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        for rows in chunks(first.size):
            acc = np.zeros(rows.stop - rows.start, dtype=np.float64)
            for wi, v in zip(w, flat):
                acc += wi * np.asarray(v[rows], dtype=np.float64)
            out[rows] = acc
        return out.reshape(first.shape)
    from ...common.flower_internals import internal  # Flower's legacy helpers, moving to flwr.compat

    aggregate = internal("aggregate_median") if mode == "median" else internal("aggregate_trimmed_avg")
    for rows in chunks(first.size):
        layers = [([np.asarray(v[rows], dtype=np.float64)], 1) for v in flat]
        out[rows] = np.asarray((aggregate(layers) if mode == "median" else aggregate(layers, trim))[0])
    return out.reshape(first.shape)
