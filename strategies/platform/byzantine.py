"""Flower's Byzantine-robust aggregators as combiners: Krum, Multi-Krum and Bulyan.

``aggregation = "krum" | "multikrum" | "bulyan"`` combine a round's replies with Flower's own
functions (``flwr.server.strategy.aggregate``: ``aggregate_krum``, ``aggregate_bulyan``, reached
through common/flower_internals.py), not rewritten; per task row like the median
(strategies/platform/aggregation.py), but a reply is kept or dropped as a whole, over everything
the set of replies it is compared with trained in common (:func:`select_whole`). Their
assumption, f malicious replies among n ("Machine learning with adversaries:
Byzantine tolerant gradient descent", Blanchard et al. 2017, Section 4: Krum needs n > 2f + 2;
"The hidden vulnerability of distributed learning in Byzantium", El Mhamdi et al. 2018,
Section 4: Bulyan n >= 4f + 3) is the run's ``byzantine-clients`` (:func:`assumed_malicious`);
where a row has too few replies for it, the row falls back to the coordinate-wise median,
logged once per (aggregator, n, f) with why. Multi-Krum keeps n - f replies (Blanchard et al.'s
m) and averages them weighted by their sample counts, as Flower's ``aggregate_krum`` does;
Bulyan selects with Krum, as Flower's ``Bulyan`` strategy does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

log = logging.getLogger("promptfcl")

#: the aggregations that select replies by their distances (Flower's)
SELECTIONS = ("krum", "multikrum", "bulyan")
_warned: set[tuple[str, int, int]] = set()


def assumed_malicious(byzantine_clients: int, hostile_share: float, replies: int) -> int:
    """f for a row of ``replies``: ``byzantine_clients`` where set (> 0), else the run's hostile
    share of the population (``fault-clients`` over ``num-clients``, or ``fault-rate``) of the
    row's replies rounded up, at least 1 (the aggregators' minimal assumption)."""
    if byzantine_clients > 0:
        return byzantine_clients
    return max(1, math.ceil(hostile_share * replies - 1e-9))


def minimum_replies(mode: str, f: int) -> int:
    """The fewest replies ``mode`` tolerates ``f`` malicious ones among (Krum: n > 2f + 2; Bulyan: n >= 4f + 3)."""
    return 4 * f + 3 if mode == "bulyan" else 2 * f + 3


def select_whole(replies: Sequence[Sequence[np.ndarray]], weights: np.ndarray, mode: str, f: int) -> list[np.ndarray]:
    """The arrays of ``replies`` (each reply's list of arrays, the same shapes across replies) by
    Flower's ``mode`` aggregator assuming ``f`` malicious ones, choosing whole replies: Flower's
    functions measure a reply's distance over all its arrays together, so a reply is kept or
    dropped as a whole (Krum's and Bulyan's definition), never spliced array by array. Too few
    replies: the coordinate-wise median, logged once. Each array in the first reply's dtype."""
    from ...common.flower_internals import internal  # Flower's legacy helpers, moving to flwr.compat

    first = [np.asarray(v) for v in replies[0]]
    layers = [([np.asarray(v, dtype=np.float64) for v in arrays], float(w)) for arrays, w in zip(replies, weights)]
    n = len(layers)
    if n < minimum_replies(mode, f):
        if (mode, n, f) not in _warned:
            _warned.add((mode, n, f))
            log.info("aggregation %s: %d replies trained these rows, fewer than the %d it needs to tolerate %d "
                     "malicious (byzantine-clients); they are the coordinate-wise median", mode, n,
                     minimum_replies(mode, f), f)
        out = internal("aggregate_median")([(v, 1) for v, _ in layers])
    elif mode == "bulyan":
        krum = internal("aggregate_krum")
        out = internal("aggregate_bulyan")(list(layers), f, krum, to_keep=0)  # a copy: Flower pops from it
    else:
        out = internal("aggregate_krum")(layers, f, n - f if mode == "multikrum" else 0)
    return [np.asarray(o).astype(x.dtype).reshape(x.shape) for o, x in zip(out, first)]


def select(values: Sequence[np.ndarray], weights: np.ndarray, mode: str, f: int) -> np.ndarray:
    """One array from the replies' ``values`` (:func:`select_whole` of a single array)."""
    return select_whole([[v] for v in values], weights, mode, f)[0]


__all__ = ["SELECTIONS", "assumed_malicious", "minimum_replies", "select", "select_whole"]
