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
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from ...common.config.experiment import DataSection, FederationSection, RobustnessSection, RunSection
from ...common.node.identity import grid_names, node_label
from ...common.records import as_int
from .rounds import Sent, SentRound

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


class Sampling:
    """The platform's sampling and messages (``PromptStrategy`` mixes it in): who trains in a round,
    each client's config, and the round's messages made by a method's payload hook."""

    run: RunSection
    data: DataSection
    federation: FederationSection
    robustness: RobustnessSection
    config_digest: str
    num_classes: int
    schedule: Any
    _schedule_slots: dict[int, int]
    _nodes_ready: bool
    _warned_few_nodes: bool
    #: population = "nodes": each connected node's registered name (or key fingerprint), where
    #: Flower's NodeInfo says (deployment), for logs and records
    _node_names: dict[int, str]

    @property
    def clients_per_round(self) -> int:
        return self.federation.sampled_per_round

    @property
    def population_size(self) -> int:
        """How many clients a round samples from (centralised: the one client with all data)."""
        return 1 if self.federation.centralised else self.federation.num_clients

    @property
    def sample_rate(self) -> float:
        """The share of the population one round trains without drop-outs (the nominal sampling
        rate q; each round's own is its outcome's ``sample_rate``)."""
        return min(1.0, self.clients_per_round / self.population_size)

    def sample_clients(self, task: int, round_: int, attempt: int = 0) -> list[int]:
        return sample_clients(self.run.seed, self.population_size, self.clients_per_round, task, round_,
                                       attempt)

    def sample_nodes(self, nodes: list[int], task: int, round_: int, attempt: int = 0) -> list[int]:
        return sample_nodes(self.run.seed, nodes, self.clients_per_round, task, round_, attempt)

    def connected_nodes(self, grid: Grid, minimum: int, timeout: float) -> list[int]:
        nodes = connected_nodes(grid, minimum, timeout)
        if self.federation.population == "nodes":  # a node connected now may be new: learn its registered name
            self._node_names.update(grid_names(grid))
        return nodes

    def node_label(self, node_id: int) -> str:
        """``node <id>`` with its registered name or key fingerprint where known (common/node/identity.py)."""
        return node_label(int(node_id), self._node_names.get(int(node_id), ""))

    def named(self, entry: dict[str, Any]) -> dict[str, Any]:
        """A record of ``entry["node"]`` (a rejection, a failed evaluation) with its registered ``name``."""
        name = self._node_names.get(int(entry["node"]))
        return {**entry, "name": name} if name else entry

    def _clients(self, config: ConfigRecord, grid: Grid) -> tuple[list[tuple[int, int, int]], float]:
        """(client id, node id, schedule slot) of each client of this round, and the sampling's rate:
        sampled / population, where with population = "nodes" the population is the nodes connected
        at sampling time, so a node that dropped out raises it (differential privacy's accountant
        composes each round at its own rate, server/results.py)."""
        task, round_, attempt = as_int(config["task"]), as_int(config["round"]), as_int(config.get("attempt", 0))
        if self.federation.population == "nodes":  # every connected node is one client with its own data
            # before the first round, wait for the whole population; later, for enough to aggregate
            minimum = self.federation.num_clients if not self._nodes_ready else self.robustness.min_replies
            nodes = self.connected_nodes(grid, minimum, self.robustness.round_timeout)
            self._nodes_ready = True
            sampled = self.sample_nodes(nodes, task, round_, attempt)
            # a node's place in the sorted connected ids is its turn in the task schedule
            return [(node_client_id(n), n, nodes.index(n)) for n in sampled], len(sampled) / len(nodes)
        clients = self.sample_clients(task, round_, attempt)
        rate = len(clients) / self.population_size
        nodes = sorted(grid.get_node_ids())
        if not nodes:
            raise RuntimeError("no Flower nodes are connected")
        if len(nodes) < len(clients) and not self._warned_few_nodes:
            log.warning("%d clients per round but %d Flower nodes: nodes play several clients in turn "
                        "(start more SuperNodes / num-supernodes for parallelism)", len(clients), len(nodes))
            self._warned_few_nodes = True
        return [(client, nodes[i % len(nodes)], client) for i, client in enumerate(clients)], rate

    def _send(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid,
              make: Callable[[Sent, ArrayRecord], RecordDict | None], kind: str,
              targets: tuple[list[tuple[int, int, int]], float] | None = None) -> SentRound:
        """The round's messages: each sampled client's config, then the method's content for it.
        ``targets``: (client id, node id, slot) of each client and their rate, where not the round's
        sample (a task-end exchange)."""
        clients, rate = self._clients(config, grid) if targets is None else targets
        out = SentRound(sample_rate=rate)
        for client, node, slot in clients:
            client_config = self._client_config(config, client, slot, server_round)
            sent = Sent(client, as_int(client_config["task"]), as_int(client_config["round"]),
                        slot % self.schedule.num_clients, client_config)
            content = make(sent, arrays)
            if content is None:
                out.skipped += 1
                continue
            sent.message = Message(content=content, message_type=kind, dst_node_id=node)
            out.sent.append(sent)
        return out

    def _client_config(self, config: ConfigRecord, client_id: int, slot: int, server_round: int) -> ConfigRecord:
        """The round's config for one client: its id, and its own task when tasks arrive asynchronously."""
        client_config = ConfigRecord(dict(config))
        client_config["client-id"] = client_id
        client_config["server-round"] = server_round
        client_config["config-digest"] = self.config_digest
        turn = slot % self.schedule.num_clients
        self._schedule_slots[client_id] = turn
        if not self.schedule.synchronous:
            client_config["task"], client_config["round"] = self.schedule.assignment(turn, server_round - 1)
        if self.data.task_generator == "random":  # a deployed node plays the schedule's client of its turn
            client_config["schedule-slot"] = turn
        if self.federation.population == "nodes":
            client_config["num-classes"] = self.num_classes
        return client_config

    # ------------------------------------------------------------------ schedule helpers for methods
    def client_position(self, client_id: int, round_index: int) -> int:
        """The task ``client_id`` is on in ``round_index`` (0-based), by the schedule."""
        slot = self._schedule_slots.get(client_id, client_id % self.schedule.num_clients)
        return self.schedule.position(slot, round_index)

    def tasks_in_flight(self, round_index: int) -> range:
        """The tasks some client of the population is on in ``round_index`` (slowest to newest)."""
        return range(self.schedule.position(self.schedule.slowest_client, round_index),
                     self.schedule.newest_task(round_index) + 1)

