"""Bounded influence of the statistics clients upload: the platform's, for every method.

HGP's Gaussians, FPPL's prototypes and Powder's correlation vectors travel in records beside the
model. A well-formed forgery (a class mean scaled or shifted, a covariance inflated, a count
moved) passes every record check. A method declares what each array of such a record is
(:class:`Statistics`: vectors, second moments, counts) and the platform bounds them before the
method sees them (``stats-bound`` = b > 0, only where the run is defended; common/trust.py), so a
new method's statistics are bounded without it doing anything:

* a **vector** row (a class mean, a prototype, an alpha) whose norm is above b x the lower median
  row norm of that array over the round's replies is scaled down to it;
* a **second moment** row (a covariance) whose scale (trace) is above b x the lower median scale
  over the rows that estimate one (count >= 2) is scaled down to it;
* a **count** is cut to the reply's own ``num-examples`` (what the platform checked or capped).

Every reference is pooled over the round's rows, not over the reporters of one class: label skew
makes honest clients' counts of a class differ by 100x, but it changes neither the scale of a
class mean of one backbone's features nor a within-class variance, so honest rows stay inside
the bound (a row is never rewritten unless it lies b times beyond the typical one). Counts are
never compared across clients, so a method's weighting of honest clients is its own. A hostile
minority of replies cannot move a lower median, so a forged row carries at most b times the
weight of a typical honest one. At least two replies must carry the array (one is its own
reference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from promptfcl.strategies.platform.replies import lower_median

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
    """

    vectors: tuple[str, ...] = ()
    second_moments: Mapping[str, str] = field(default_factory=dict)
    counts: tuple[str, ...] = ()


@dataclass(frozen=True)
class StatisticsBound:
    """``bound`` > 0: bound the statistics of a round's replies (module docstring); 0: off."""

    bound: float = 0.0

    @property
    def active(self) -> bool:
        return self.bound > 0

    def ratios(self, records: Sequence[dict[str, np.ndarray]], spec: Statistics) -> dict[str, float]:
        """Per declared vector and second-moment array, the largest row scale over the lower median
        of the round's rows (recorded defended or not: how tight ``stats-bound`` could be)."""
        out = {}
        counts = spec.counts[0] if spec.counts else None
        for name, scale_of in [(n, _norms) for n in spec.vectors] + \
                [(n, lambda rows, layout=layout: _traces(rows, layout)) for n, layout in spec.second_moments.items()]:
            scales, pool = self._scales(list(records), name, scale_of, counts if name not in spec.vectors else None)
            reference = lower_median(pool.tolist()) if len(scales) >= 2 else 0.0
            if reference > 0:
                out[name] = round(float(max(s.max() for s in scales)) / reference, 3)
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
        for name in spec.vectors:
            changed += self._bound_rows(out, name, _norms, 1.0)
        counts = spec.counts[0] if spec.counts else None
        for name, layout in spec.second_moments.items():
            power = 0.5 if layout == FACTOR else 1.0
            changed += self._bound_rows(out, name, lambda rows, layout=layout: _traces(rows, layout), power,
                                        counts)
        return out, changed

    def _bound_rows(self, records: list[dict[str, np.ndarray]], name: str, scale_of, power: float,
                    counts: str | None = None) -> int:
        """Rows of ``name`` whose scale is above bound x the lower median scale multiplied by
        (limit / scale) ** ``power``; returns how many."""
        scales, pool = self._scales(records, name, scale_of, counts)
        if len(scales) < 2:
            return 0
        holders = [r for r in records if name in r and np.asarray(r[name]).size]
        limit = self.bound * lower_median(pool.tolist())
        if not limit > 0:  # no reference (or noisy DP covariances with a non-positive median): nothing to judge
            return 0
        changed = 0
        for record, scale in zip(holders, scales):
            over = scale > limit
            if over.any():
                values = np.asarray(record[name])
                factor = np.where(over, (limit / np.maximum(scale, np.finfo(np.float64).tiny)) ** power, 1.0)
                bounded = values.astype(np.float64) * factor.reshape((-1,) + (1,) * (values.ndim - 1))
                record[name] = np.where(over.reshape((-1,) + (1,) * (values.ndim - 1)), bounded, values) \
                    .astype(values.dtype)
                changed += int(over.sum())
        return changed


    @staticmethod
    def _scales(records: Sequence[dict[str, np.ndarray]], name: str, scale_of: Callable[[np.ndarray], np.ndarray],
                counts: str | None) -> tuple[list[np.ndarray], np.ndarray]:
        """Each holder's row scales of ``name``, and the pool the reference is read from (rows
        with ``counts`` >= 2 where a count array is given: a single sample estimates no covariance)."""
        holders = [r for r in records if name in r and np.asarray(r[name]).size]
        scales = [scale_of(np.asarray(r[name], dtype=np.float64).reshape(len(r[name]), -1)) for r in holders]
        pool = np.concatenate([s if counts is None or counts not in r or len(r[counts]) != len(s)
                               else s[np.asarray(r[counts]) >= 2] for r, s in zip(holders, scales)]) \
            if scales else np.zeros(0)
        return scales, pool


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
