"""Bounded influence of the statistics clients upload: the platform's, for every method.

HGP's Gaussians, FPPL's prototypes and Powder's correlation vectors travel in records beside the
model. A well-formed forgery (a class mean scaled or shifted, a covariance inflated, a count
moved) passes every record check. A method declares what each array of such a record is
(:class:`Statistics`: vectors, second moments, counts) and the platform bounds them before the
method sees them (``stats-bound`` = b > 0, only where the run is defended; common/config/trust.py), so a
new method's statistics are bounded without it doing anything:

* a **vector** row (a class mean, a prototype, an alpha) whose norm is above b x the lower median
  row norm of that array over the round's replies is scaled down to it;
* a **second moment** row (a covariance) whose scale (trace) is above b x the lower median scale
  of the same class's rows that estimate one (count >= 2; from two replies or more: a class one
  client reports is its own reference) is scaled down to it: classes differ in their spread (up
  to 10x among the offline benchmark's digits), the clients of one class do not;
* a **count** is cut to the reply's own ``num-examples`` (what the platform checked or capped).

A vector's reference is pooled over the round's rows: label skew makes honest clients' counts
of a class differ by 100x, but it changes neither the scale of a class mean of one backbone's
features nor a within-class variance, so honest rows stay inside the bound (a row is never
rewritten unless it lies b times beyond the typical one). Counts are
never compared across clients, so a method's weighting of honest clients is its own. A hostile
minority of replies cannot move a lower median, so a forged row carries at most b times the
weight of a typical honest one. At least two replies must carry the array (one is its own
reference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from ...common.records import arrays_of, from_array_record, to_array_record
from .replies import lower_median
from .rounds import Accepted

#: how a second-moment array holds one covariance per row
PACKED_TRIU, DIAGONAL, FACTOR = "packed-triu", "diagonal", "factor"


@dataclass(frozen=True)
class Statistics:
    """What a record of uploaded statistics holds, array by array.

    Parameters
    ----------
    vectors : tuple of str
        Arrays of one vector per row (class means, prototypes, alphas).
    second_moments : mapping of str to str
        Arrays of one covariance per row, and how it is held: ``"packed-triu"`` (its upper
        triangle, row-major), ``"diagonal"`` (its diagonal) or ``"factor"`` (F with cov = F F^T).
    counts : tuple of str
        Arrays of one count per row of the reply's own training examples (so none above its
        ``num-examples``); the first also tells which rows estimate a second moment (count >= 2).
    keys : str, optional
        The array of each row's id (its class): a second moment is judged among the rows of its
        id only.
    """

    vectors: tuple[str, ...] = ()
    second_moments: Mapping[str, str] = field(default_factory=dict)
    counts: tuple[str, ...] = ()
    keys: str | None = None


@dataclass(frozen=True)
class StatisticsBound:
    """``bound`` > 0: bound the statistics of a round's replies (module docstring); 0: off."""

    bound: float = 0.0

    @property
    def active(self) -> bool:
        return self.bound > 0

    def apply(self, replies: Sequence[Accepted], specs: Mapping[str, Statistics], ratios: dict[str, float]) -> int:
        """The declared statistics (``specs``: record name -> what it holds) of ``replies`` bounded
        in place; returns the rows changed. Each array's largest row scale over its reference goes
        to ``ratios``, bounded or not."""
        changed = 0
        for name, spec in specs.items():
            holders = [a for a in replies if name in a.content.array_records]
            before = [from_array_record(arrays_of(a.content, name)) for a in holders]
            ratios.update(self.ratios(before, spec))
            if not self.active:
                continue
            records, n = self(before, [a.examples for a in holders], spec)
            for a, old, new in zip(holders, before, records):
                if any(new[k] is not old[k] for k in new):  # rewritten only where a row was bounded
                    a.content[name] = to_array_record(new)
            changed += n
        return changed

    def ratios(self, records: Sequence[dict[str, np.ndarray]], spec: Statistics) -> dict[str, float]:
        """Per declared vector and second-moment array, the largest row scale over its reference
        (recorded defended or not: how tight ``stats-bound`` could be)."""
        out = {}
        for name, scale_of, keys in self._arrays(spec):
            _, scales, references = self._references(list(records), name, scale_of, spec, keys)
            ratios = [s / r for ss, rr in zip(scales, references) for s, r in zip(ss, rr) if np.isfinite(r) and r > 0]
            if ratios:
                out[name] = round(float(max(ratios)), 3)
        return out

    def __call__(self, records: Sequence[dict[str, np.ndarray]], examples: Sequence[int],
                 spec: Statistics) -> tuple[list[dict[str, np.ndarray]], int]:
        """``records`` (one per reply, arrays by name) bounded, and how many rows were changed.

        Unchanged rows keep their exact values (an honest round is computed as without the bound).
        """
        out = [dict(r) for r in records]
        if not self.active:
            return out, 0
        changed = 0
        for name in spec.counts:
            for record, n in zip(out, examples):
                if name in record and (np.asarray(record[name]) > n).any():
                    changed += int((np.asarray(record[name]) > n).sum())
                    record[name] = np.minimum(record[name], n).astype(np.asarray(record[name]).dtype)
        for name, scale_of, keys in self._arrays(spec):
            power = 0.5 if spec.second_moments.get(name) == FACTOR else 1.0
            holders, scales, references = self._references(out, name, scale_of, spec, keys)
            for record, scale, reference in zip(holders, scales, references):
                limit = self.bound * reference
                over = scale > limit  # never where there is no reference (limit inf)
                if over.any():
                    # only the rows over their limit are scaled (scale > limit > 0 there): a row whose
                    # scale is zero or negative (a noisy DP covariance's trace) is never divided by
                    values = np.asarray(record[name])
                    factor = (limit[over] / scale[over]) ** power
                    bounded = values.copy()
                    rows = values[over].astype(np.float64)
                    bounded[over] = (rows * factor.reshape((-1,) + (1,) * (rows.ndim - 1))).astype(values.dtype)
                    record[name] = bounded
                    changed += int(over.sum())
        return out, changed

    @staticmethod
    def _arrays(spec: Statistics) -> list[tuple[str, Callable[[np.ndarray], np.ndarray], str | None]]:
        """(array, its row scale, the ids its reference is grouped by): vectors pooled over the
        round, second moments per id (a class's within-class variance is its own)."""
        out: list[tuple[str, Callable[[np.ndarray], np.ndarray], str | None]] = \
            [(n, _norms, None) for n in spec.vectors]
        for name, layout in spec.second_moments.items():
            out.append((name, partial(_traces, layout=layout), spec.keys))
        return out

    @staticmethod
    def _references(records: Sequence[dict[str, np.ndarray]], name: str, scale_of: Callable[[np.ndarray], np.ndarray],
                    spec: Statistics, keys: str | None) -> tuple[list[dict[str, np.ndarray]], list[np.ndarray],
                                                                 list[np.ndarray]]:
        """The holders of ``name``, each one's row scales, and each row's reference: the lower
        median scale of the rows it is judged among (every row of the round, or the rows of its
        id with ``keys``), over rows from at least two replies and, with counts, of at least 2
        samples (one sample estimates no covariance); inf where there is no such reference or it
        is not positive (noisy DP covariances can have negative traces)."""
        holders = [r for r in records if name in r and np.asarray(r[name]).size]
        scales = [scale_of(np.asarray(r[name], dtype=np.float64).reshape(len(r[name]), -1)) for r in holders]
        counts = spec.counts[0] if spec.counts and spec.second_moments.get(name) else None
        groups: dict[object, list[tuple[int, float]]] = {}
        ids = []
        for h, (record, scale) in enumerate(zip(holders, scales)):
            row_ids = np.asarray(record[keys]).tolist() if keys and keys in record and \
                len(record[keys]) == len(scale) else [None] * len(scale)
            usable = np.asarray(record[counts]) >= 2 if counts and counts in record and \
                len(record[counts]) == len(scale) else np.ones(len(scale), dtype=bool)
            ids.append(row_ids)
            for key, value, ok in zip(row_ids, scale.tolist(), usable.tolist()):
                if ok:
                    groups.setdefault(key, []).append((h, value))
        reference = {key: lower_median([v for _, v in rows]) for key, rows in groups.items()
                     if len({h for h, _ in rows}) >= 2}
        references = [np.array([reference.get(k, np.inf) if reference.get(k, 0) > 0 else np.inf for k in row_ids])
                      for row_ids in ids]
        return holders, scales, references


def _norms(rows: np.ndarray) -> np.ndarray:
    return np.sqrt(np.square(rows).sum(axis=1))


def _traces(rows: np.ndarray, layout: str) -> np.ndarray:
    """Each row's covariance trace (``rows``: (k, m) float64, one covariance per row in ``layout``)."""
    if layout == DIAGONAL:
        return rows.sum(axis=1)
    if layout == FACTOR:
        return np.square(rows).sum(axis=1)
    if layout == PACKED_TRIU:
        dim = int(round((np.sqrt(8 * rows.shape[1] + 1) - 1) / 2))  # m = D (D + 1) / 2
        row, col = np.triu_indices(dim)
        return rows[:, row == col].sum(axis=1)
    raise ValueError(f"unknown second-moment layout {layout!r}")
