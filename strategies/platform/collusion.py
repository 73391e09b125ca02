"""The colluding attacks of the robust-aggregation literature, as pure functions over updates.

Each takes the updates the attackers know (``known``: rows of a 2-D array, one flattened update
per client) and returns the one malicious update every hostile client sends:

* :func:`alie`: "A little is enough" (Baruch et al., NeurIPS 2019, Section 3): mean - z x std,
  coordinate-wise, z from the paper's formula for n clients of which m are hostile (:func:`alie_z`);
* :func:`ipm`: inner-product manipulation ("Fall of empires", Xie et al., UAI 2020, Section 4):
  -epsilon x the mean, whose inner product with the honest mean is negative;
* :func:`mimic`: "Byzantine-robust learning on heterogeneous datasets via bucketing"
  (Karimireddy et al., ICLR 2022, Section 4 / Appendix: the mimic attack): every hostile client
  copies one honest client, the one furthest along the honest updates' top principal direction
  (the paper picks it by that direction over its first rounds; here each round's own);
* :func:`min_max` and :func:`min_sum`: "Manipulating the Byzantine" (Shejwalkar and Houmansadr,
  NDSS 2021, Section IV, Algorithm 1): mean + gamma x p with p = -std, gamma the largest (by
  bisection) whose update stays within the honest updates' largest pairwise distance (min-max)
  or whose sum of squared distances stays within the largest honest one (min-sum).

Label flipping (the data, not the update: :func:`flipped_labels`) is the client's own: a hostile
client trains on its images with its task's classes reversed (``LocalLearner.flip_labels``).

The server applies them in a simulation with fault injection (:mod:`.attack_policy`), where the
colluders' honest updates exist; deployed nodes cannot collude this way (the run is refused).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import numpy as np

#: the fault kinds computed from the colluders' updates at aggregation time (:mod:`.attack_policy`)
COLLUDING_ATTACKS = ("alie", "ipm", "mimic", "min-max", "min-sum")


def alie_z(n: int, m: int) -> float:
    """ALIE's z (Baruch et al. 2019, Section 3): s = floor(n / 2 + 1) - m clients must be won over,
    z = Phi^-1((n - s) / n); 0 where that is not above the median (too few clients). Where the
    colluders already hold the majority (s <= 0) one honest client is still to win (s = 1): the
    paper's bound then no longer limits z, and the smallest non-trivial one is taken."""
    s = max(1, math.floor(n / 2 + 1) - m)
    p = (n - s) / n if n > 0 else 0.5
    return max(0.0, NormalDist().inv_cdf(p)) if 0.0 < p < 1.0 else 0.0


def alie(known: np.ndarray, z: float) -> np.ndarray:
    """mean - z x std of ``known``, coordinate-wise."""
    return known.mean(axis=0) - z * known.std(axis=0)


def ipm(known: np.ndarray, epsilon: float) -> np.ndarray:
    """-epsilon x the mean of ``known``."""
    return -epsilon * known.mean(axis=0)


def mimic(known: np.ndarray) -> np.ndarray:
    """A copy of the update of ``known`` with the largest projection on their top principal direction."""
    if len(known) < 2:
        return known[0].copy()
    centred = known - known.mean(axis=0)
    # the top right-singular vector of the centred updates: the direction of their largest variance
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    return known[int(np.argmax(np.abs(centred @ vt[0])))].copy()


def _pairwise_sq(known: np.ndarray) -> np.ndarray:
    sq = np.einsum("ij,ij->i", known, known)
    return np.maximum(sq[:, None] + sq[None, :] - 2.0 * known @ known.T, 0.0)


def _sq_to(point: np.ndarray, known: np.ndarray) -> np.ndarray:
    diff = known - point
    return np.einsum("ij,ij->i", diff, diff)


def largest_gamma(fits: Callable[[float], bool], tol: float = 1e-4, start: float = 10.0) -> float:
    """The largest gamma >= 0 with ``fits(gamma)`` (which holds at 0 and fails past some gamma),
    by doubling then bisection (Algorithm 1's search) to a relative ``tol``."""
    if not fits(0.0):
        return 0.0
    low, high = 0.0, start
    while fits(high):
        low, high = high, 2.0 * high
        if high > 1e12:
            return low
    while high - low > tol * max(high, 1e-12):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def min_max(known: np.ndarray) -> tuple[np.ndarray, float]:
    """The min-max update and its gamma: max_i ||mal - g_i|| <= max_ij ||g_i - g_j||."""
    mean, direction = known.mean(axis=0), -known.std(axis=0)
    bound = float(_pairwise_sq(known).max())
    gamma = largest_gamma(lambda g: float(_sq_to(mean + g * direction, known).max()) <= bound)
    return mean + gamma * direction, gamma


def min_sum(known: np.ndarray) -> tuple[np.ndarray, float]:
    """The min-sum update and its gamma: sum_i ||mal - g_i||^2 <= max_i sum_j ||g_i - g_j||^2."""
    mean, direction = known.mean(axis=0), -known.std(axis=0)
    bound = float(_pairwise_sq(known).sum(axis=1).max())
    gamma = largest_gamma(lambda g: float(_sq_to(mean + g * direction, known).sum()) <= bound)
    return mean + gamma * direction, gamma


def flipped_labels(labels: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """``labels`` with the task's ``classes`` reversed (classes[i] -> classes[-1 - i]), the
    label-flipping attack's data; a label outside ``classes`` is kept."""
    labels, classes = np.asarray(labels), np.asarray(classes)
    pos = np.searchsorted(classes, labels)
    inside = (pos < len(classes)) & (classes[np.minimum(pos, len(classes) - 1)] == labels)
    out = labels.copy()
    out[inside] = classes[::-1][pos[inside]]
    return out


def malicious_update(kind: str, known: np.ndarray, clients: int, hostile: int, z: float = 0.0,
                     epsilon: float = 0.5) -> np.ndarray:
    """The update the hostile clients send for attack ``kind``, from the updates they know
    (``known``), in a round of ``clients`` replies of which ``hostile`` are theirs (ALIE's z
    from them unless ``z`` > 0; IPM's ``epsilon``)."""
    known = np.asarray(known, dtype=np.float64)
    if kind == "alie":
        return alie(known, z if z > 0 else alie_z(clients, hostile))
    if kind == "ipm":
        return ipm(known, epsilon)
    if kind == "mimic":
        return mimic(known)
    if kind == "min-max":
        return min_max(known)[0]
    if kind == "min-sum":
        return min_sum(known)[0]
    raise ValueError(f"unknown colluding attack {kind!r}; one of {COLLUDING_ATTACKS}")


__all__ = ["COLLUDING_ATTACKS", "alie", "alie_z", "flipped_labels", "ipm", "largest_gamma", "malicious_update",
           "mimic", "min_max", "min_sum"]
