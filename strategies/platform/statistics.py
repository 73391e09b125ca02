"""Bounded influence of the statistics clients upload: one method for every method that aggregates them.

HGP's Gaussians, FPPL's prototypes and Powder's correlation vectors are combined per class
(or task) over the clients that report it. A well-formed but forged contribution (a class
mean scaled or shifted, a covariance inflated, a class histogram with a huge count) passes
every record check; ``stats-bound`` = b > 0 bounds what it can do. Among the k contributions
to one statistic (from k >= 3 on: with two, neither can be told from the other):

* each vector's distance from the coordinate-wise median is cut to at most b times the lower
  median of those distances (the vector pulled towards the median, its direction kept);
* each covariance's scale (trace) is cut to at most b times the lower median scale;
* each count is cut to at most b times the lower median count.

A hostile minority moves neither the coordinate-wise median nor a lower median, so one forged
contribution moves the combined statistic by at most about b times what an honest one does.
This is norm bounding (as for model updates, ``update-clip``) applied per statistic.
"""

from __future__ import annotations

import numpy as np

from promptfcl.strategies.platform.replies import lower_median

#: fewest contributions to one statistic that bounding applies to
MIN_CONTRIBUTIONS = 3


def bound_vectors(vectors: np.ndarray, bound: float) -> np.ndarray:
    """(k, ...) contributions with each one's distance from their coordinate-wise median cut to
    ``bound`` x the lower median distance (unchanged with ``bound`` 0 or fewer than 3 rows)."""
    vectors = np.asarray(vectors)
    if bound <= 0 or len(vectors) < MIN_CONTRIBUTIONS:
        return vectors
    values = vectors.astype(np.float64)
    center = np.median(values, axis=0)
    deviation = values - center
    distance = np.sqrt(np.square(deviation.reshape(len(values), -1)).sum(axis=1))
    limit = bound * lower_median(distance)
    scale = np.minimum(1.0, limit / np.maximum(distance, np.finfo(np.float64).tiny))
    return (center + deviation * scale.reshape((-1,) + (1,) * (values.ndim - 1))).astype(vectors.dtype)


def bound_scales(scales: np.ndarray, bound: float) -> np.ndarray:
    """Multipliers in (0, 1] that cut each scale to ``bound`` x the lower median scale (all 1
    with ``bound`` 0, fewer than 3 scales, or a lower median that is not positive: noisy
    covariances under client-side DP can have a negative trace, and a bound read from noise
    would flip or erase the honest ones)."""
    scales = np.asarray(scales, dtype=np.float64)
    if bound <= 0 or len(scales) < MIN_CONTRIBUTIONS:
        return np.ones(len(scales))
    limit = bound * lower_median(scales)
    if not limit > 0:
        return np.ones(len(scales))
    return np.minimum(1.0, limit / np.maximum(scales, np.finfo(np.float64).tiny))


def bound_counts(counts: np.ndarray, bound: float) -> np.ndarray:
    """Counts cut to ``bound`` x their lower median (unchanged with ``bound`` 0 or fewer than 3)."""
    counts = np.asarray(counts)
    return (counts * bound_scales(counts, bound)).astype(np.float64) if bound > 0 and len(counts) >= 3 \
        else counts.astype(np.float64)


def bounded_mean(vectors: np.ndarray, counts: np.ndarray, bound: float) -> np.ndarray:
    """The count-weighted mean of the contributions after bounding both (``bound`` 0: the plain
    count-weighted mean)."""
    weights = bound_counts(counts, bound)
    values = bound_vectors(vectors, bound)
    total, n = np.zeros(values.shape[1:]), 0.0
    for value, weight in zip(values, weights.tolist()):  # in order: with bound 0, exactly the running sum
        total += weight * np.asarray(value, dtype=np.float64)
        n += weight
    return total / n if n > 0 else values.astype(np.float64).mean(axis=0)
