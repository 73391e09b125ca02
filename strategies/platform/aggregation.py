"""How accepted replies become one model: their weights, and how their arrays combine.

Two policies every method's aggregation goes through, chosen once from the run config
(:func:`aggregation_policies`, by the platform's constructor), so no method weighs or combines
replies its own way:

* **weighting**: sample counts (FedAvg), each capped at ``max-client-weight`` of the round
  where counts cannot be verified or clients are not trusted (``population = "nodes"``, or a
  defended simulation: "defended" means "untrusted"; from 2 replies on);
* **combining**: the weighted mean, or the coordinate-wise median or trimmed mean, or Krum,
  Multi-Krum or Bulyan (``aggregation``) with Flower's own aggregation functions.

:func:`aggregate_per_task` applies them per task slice (clients on different tasks in one
round, asynchronous arrival and random tasks); :func:`average_replies` is the platform's default
``aggregate``, a method's arrays reach it through the hooks ``averaging_weights`` and
``averaged_over_all`` (strategies/platform/strategy.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord

from ...common.config.experiment import AGGREGATIONS
from ...common.data.tasks import TaskLayout
from ...common.records import array_view, array_views, to_array_record
from .byzantine import SELECTIONS, assumed_malicious, select, select_whole
from .replies import capped_weights, combine


@dataclass(frozen=True)
class Weighting:
    """Aggregation weights from the replies' sample counts; ``cap`` > 0: none above that share of
    the round (from 2 replies on). Uncapped weights are the counts themselves, so FedAvg's
    arithmetic is exactly what it always was."""

    cap: float = 0.0

    def __call__(self, counts: Sequence[int]) -> np.ndarray:
        weights = np.asarray(counts, dtype=np.float64)
        if self.cap > 0 and len(weights) >= 2 and weights.max() > self.cap * weights.sum():
            return capped_weights(weights, self.cap)
        return weights


@dataclass(frozen=True)
class Combiner:
    """One array from the replies' arrays: ``mode`` "mean" (weighted), "median" or "trimmed-mean"
    (coordinate-wise, unweighted, ``trim`` cut at each end), or Flower's "krum", "multikrum" and
    "bulyan" (strategies/platform/byzantine.py) assuming ``byzantine`` malicious replies (0: the
    run's ``hostile_share`` of them)."""

    mode: str = "mean"
    trim: float = 0.2
    byzantine: int = 0
    hostile_share: float = 0.0

    def __call__(self, values: Sequence[np.ndarray], weights: np.ndarray) -> np.ndarray:
        if self.mode in SELECTIONS:
            return select(values, weights, self.mode, assumed_malicious(self.byzantine, self.hostile_share,
                                                                        len(values)))
        return combine(values, weights, self.mode, self.trim)


def aggregation_policies(aggregation: str, trim_fraction: float, client_weight_cap: float,
                         byzantine: int = 0, hostile_share: float = 0.0) -> tuple[Weighting, Combiner]:
    """The run's weighting and combining (``aggregation``, ``trim-fraction``, ``byzantine-clients``
    or else ``hostile_share``): counts capped at ``client_weight_cap`` of the round (the run's
    ``max-client-weight`` where the server cannot check them or the run is defended; 0: uncapped)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; one of {AGGREGATIONS}")
    return Weighting(client_weight_cap), Combiner(aggregation, trim_fraction, byzantine, hostile_share)


def combine_records(records: list[ArrayRecord], weights: np.ndarray, combiner: Combiner = Combiner()) -> ArrayRecord:
    """Every array of ``records`` combined across them (``combiner``)."""
    return to_array_record({name: combiner([array_view(r[name]) for r in records], weights)
                            for name in records[0].keys()})


def weighted_average(records: list[ArrayRecord], weights: np.ndarray) -> ArrayRecord:
    """Sum_i w_i x_i / Sum_i w_i per array, accumulated in float64, cast back to the input dtype."""
    return combine_records(records, weights)


def average_replies(records: Sequence[ArrayRecord], tasks: Sequence[int], weights: np.ndarray, per_task: str,
                    base: ArrayRecord | None, layout: TaskLayout, combiner: Combiner,
                    over_all: Callable[[str], bool] | None = None) -> ArrayRecord:
    """The replies' arrays (``records``, trained on ``tasks``) combined with ``weights``.

    Per task slice and head rows over the replies that trained each (``per_task`` "always", or
    "in-flight" with several tasks in the round; ``base``: the arrays the round started from), so
    a slice trained only by clients that are ahead is not diluted; else every array over every
    reply. With several tasks, the arrays ``over_all`` names are combined over every reply anyway
    (every reply trained all of them: HePCo's whole-pool training).
    """
    several = len(set(tasks)) > 1
    by_task = (per_task == "always" or (per_task == "in-flight" and several)) and base is not None
    if combiner.mode in SELECTIONS:
        shared_names = {name for name in records[0].keys() if over_all is not None and several and over_all(name)}
        return to_array_record(select_per_owner_set(layout, base if by_task else None, records, tasks, weights,
                                                    combiner, shared_names))
    if by_task and base is not None:
        updates = [(t, array_views(r), float(w)) for t, r, w in zip(tasks, records, weights)]
        out = to_array_record(aggregate_per_task(layout, array_views(base), updates, combiner))
    else:
        out = combine_records(list(records), weights, combiner)
    shared = [name for name in records[0].keys() if over_all(name)] if over_all is not None and several else []
    if not shared:
        return out
    state = array_views(out)
    state.update({name: combiner([array_view(r[name]) for r in records], weights) for name in shared})
    return to_array_record(state)


def select_per_owner_set(layout: TaskLayout, base: ArrayRecord | None, records: Sequence[ArrayRecord],
                         tasks: Sequence[int], weights: np.ndarray, combiner: Combiner,
                         shared: set[str]) -> dict[str, np.ndarray]:
    """Flower's selecting aggregators (Krum, Multi-Krum, Bulyan) choose whole replies: the rows
    are grouped by the set of replies that trained them (with ``base``: each task's rows of the
    task-structured arrays; the other arrays, those in ``shared`` and, without ``base``, every
    array: all replies), and each set is one selection over everything it trained in common;
    rows nobody trained keep ``base``."""
    arrays = [array_views(r) for r in records]
    n = len(arrays)
    everyone = (True,) * n
    out: dict[str, np.ndarray] = {}
    pieces: dict[tuple[bool, ...], list[tuple[str, np.ndarray | None]]] = {}
    rows: np.ndarray | None
    for name in records[0].keys():
        value = np.asarray(array_view(base[name])) if base is not None else np.asarray(arrays[0][name])
        if base is None or name in shared or layout.task_rows(name, value, 0) is None:
            pieces.setdefault(everyone, []).append((name, None))
            continue
        owners = np.zeros((value.shape[0], n), dtype=bool)
        for i, task in enumerate(tasks):
            owners[layout.task_rows(name, value, int(task)), i] = True
        out[name] = value.copy()
        for pattern in np.unique(owners[owners.any(axis=1)], axis=0):
            rows = np.flatnonzero((owners == pattern).all(axis=1))
            pieces.setdefault(tuple(bool(x) for x in pattern), []).append((name, rows))
    for pattern, parts in pieces.items():
        idx = [i for i, on in enumerate(pattern) if on]
        f = assumed_malicious(combiner.byzantine, combiner.hostile_share, len(idx))
        chosen = select_whole([[np.asarray(arrays[i][name]) if rows is None else np.asarray(arrays[i][name])[rows]
                                for name, rows in parts] for i in idx],
                              np.asarray(weights, dtype=np.float64)[idx], combiner.mode, f)
        for (name, rows), value in zip(parts, chosen):
            if rows is None:
                out[name] = value
            else:
                out[name][rows] = value.astype(out[name].dtype)
    return out


def aggregate_per_task(
    layout: TaskLayout,
    base: Mapping[str, np.ndarray],
    updates: Sequence[tuple[int, Mapping[str, np.ndarray], float]],
    combiner: Combiner = Combiner(),
) -> dict[str, np.ndarray]:
    """FedAvg per task slice, all tasks of the round in parallel.

    Parameters
    ----------
    layout : TaskLayout
        Locates a task's rows (``TaskLayout.task_rows``): its slice of every prompt array,
        its classes' rows of every head array.
    base : dict
        The server's arrays this round started from (values of rows nobody trained).
    updates : list of (task, arrays, weight)
        Each accepted reply: the task its client trained, its arrays, its weight.
    combiner : Combiner, optional
        The run's combining rule (default: the weighted mean).

    Each row is the weighted average over the replies whose task owns it, so a head row shared
    by two tasks (random tasks of overlapping classes) averages both. Any array that is not
    task-structured is combined over all replies. With a median or trimmed-mean combiner, each
    row is instead the coordinate-wise median (trimmed mean, Krum, ...) over the replies whose task owns it.
    """
    all_weights = np.array([w for _, _, w in updates], dtype=np.float64)
    out: dict[str, np.ndarray] = {}
    for name, value in base.items():
        value = np.asarray(value)
        if layout.task_rows(name, value, 0) is None:  # not task-structured: every reply
            out[name] = np.asarray(combiner([a[name] for _, a, _ in updates], all_weights)).astype(value.dtype)
            continue
        if combiner.mode != "mean":
            out[name] = _robust_per_row(layout, name, value, updates, combiner)
            continue
        total = np.zeros(value.shape, dtype=np.float64)
        weight = np.zeros(value.shape[0], dtype=np.float64)
        for task, arrays, w in updates:
            rows = layout.task_rows(name, value, int(task))
            total[rows] += float(w) * np.asarray(np.asarray(arrays[name])[rows], dtype=np.float64)
            weight[rows] += float(w)
        trained = weight > 0
        merged = value.copy()
        per_row = weight[trained].reshape((-1,) + (1,) * (value.ndim - 1))
        merged[trained] = (total[trained] / per_row).astype(value.dtype)
        out[name] = merged
    return out


def _robust_per_row(
    layout: TaskLayout,
    name: str,
    value: np.ndarray,
    updates: Sequence[tuple[int, Mapping[str, np.ndarray], float]],
    combiner: Combiner,
) -> np.ndarray:
    """Median / trimmed mean per row over the replies whose task owns the row (rows grouped by
    the set of replies that trained them); untrained rows keep ``value``."""
    owners = np.zeros((value.shape[0], len(updates)), dtype=bool)
    for i, (task, _, _) in enumerate(updates):
        owners[layout.task_rows(name, value, int(task)), i] = True
    merged = value.copy()
    for pattern in np.unique(owners[owners.any(axis=1)], axis=0):
        rows = np.flatnonzero((owners == pattern).all(axis=1))
        idx = np.flatnonzero(pattern).tolist()
        merged[rows] = combiner(
            [np.asarray(updates[i][1][name])[rows] for i in idx], np.array([updates[i][2] for i in idx])
        )
    return merged
