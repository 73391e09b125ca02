"""Who trains in a round: seeded samples of virtual clients, or of connected Flower nodes.

Clients are a *virtual population* in simulation: the server samples client ids (a pure
function of seed, task and round) and tells each Flower node which client it plays, so the
per-round cost does not depend on the population size. With ``population = "nodes"``
(deployment, deploy/README.md) every connected node is one client with its own data, sampled
with the same seeded draw over the sorted node ids.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

log = logging.getLogger("promptfcl")


class NodeSource(Protocol):
    """The one thing sampling asks a Flower grid."""

    def get_node_ids(self): ...  # noqa: ANN201 (Flower's Grid returns an iterable of ints)


def sample_clients(seed: int, population: int, per_round: int, task: int, round_: int,
                   attempt: int = 0) -> list[int]:
    """Client ids for (task, round): seeded, independent of history and of node ids.

    ``attempt`` > 0 draws afresh when a round is retried after too few usable replies.
    """
    rng = np.random.default_rng([seed, task, round_, attempt, 0x5A3])
    return sorted(rng.choice(population, size=per_round, replace=False).tolist())


def sample_nodes(seed: int, nodes: list[int], per_round: int, task: int, round_: int,
                 attempt: int = 0) -> list[int]:
    """``per_round`` of the connected ``nodes`` (all if fewer), seeded by (seed, task, round)."""
    rng = np.random.default_rng([seed, task, round_, attempt, 0x5A3])
    k = min(per_round, len(nodes))
    return [nodes[i] for i in sorted(rng.choice(len(nodes), size=k, replace=False).tolist())]


def connected_nodes(grid: NodeSource, minimum: int, timeout: float) -> list[int]:
    """Sorted ids of the connected nodes, waiting up to ``timeout`` s for ``minimum`` of them.

    Raises
    ------
    RuntimeError
        Fewer than ``minimum`` nodes connected in time (it says how many came).
    """
    started = last_log = time.monotonic()
    while True:
        nodes = sorted(int(n) for n in grid.get_node_ids())
        if len(nodes) >= minimum:
            return nodes
        now = time.monotonic()
        if now - started > timeout:
            raise RuntimeError(
                f"only {len(nodes)} of the {minimum} nodes the run needs connected within {timeout:.0f} s; "
                "start more SuperNodes (or lower num-clients / min-replies)")
        if now - last_log > 10 or now == started:
            log.info("waiting for nodes: %d of %d connected", len(nodes), minimum)
            last_log = now
        time.sleep(1.0)


def node_client_id(node_id: int) -> int:
    """A Flower node id (uint64) as a non-negative int64 client id (its low 62 bits)."""
    return int(node_id) & ((1 << 62) - 1)
