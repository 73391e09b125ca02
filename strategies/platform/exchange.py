"""The platform's exchanges: QUERY messages that train nothing, answered by the method's learner.

One mechanism serves two moments (``PromptStrategy`` mixes this in; both are sealed):

* before a round's training, to the round's sampled clients (``uses_exchange``: Powder's
  measuring step), with the round's config;
* at a task's end (``uses_task_end_exchange``), after the task's last round is aggregated and
  before ``on_task_end`` and the evaluation of what it returns, to the clients whose replies the
  task's rounds accepted (the server loop names them: server/run.py), with the config of the
  task's last round and ``exchange = "task-end"`` (LoRM's task-end Gram pass, the authors'
  extra round). ``exchange_phase`` tells the method's hooks which one it is answering.

Every answer is matched to its message and checked by the method (``check_exchange``); a
task-end answer is also checked as a train reply's counts are (its metrics, ``num-examples``
against what the client holds or declared, its size) and weighed by the run's weighting, since
the method sums what it carries as it sums a round's. The declared statistics of every answer
are bounded where the run is defended (``statistics``), then the good answers go to
``use_exchange``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from ...common.records import METRICS, as_int, metrics_of
from .checks import SampleBounds, count_and_size_problem
from .policies import RunPolicies
from .replies import DECLARED_SIZES, MetricSpec, check_metrics
from .rounds import Accepted, Sent, SentRound
from .sampling import node_client_id
from .statistics import Statistics

log = logging.getLogger("promptfcl")

#: the config key of a task-end exchange's messages, and its value
EXCHANGE, TASK_END = "exchange", "task-end"
#: the phases ``exchange_phase`` takes
ROUND = "round"
#: the metrics a task-end answer carries: the samples its statistics are of (and a node's declared sizes)
TASK_END_METRICS = {"num-examples": MetricSpec(int, low=0), **DECLARED_SIZES}


class Exchanges:
    """The platform's exchanges (module docstring); the hooks they call are ``PromptStrategy``'s."""

    policies: RunPolicies
    bounds: SampleBounds
    statistics: dict[str, Statistics]
    robustness: Any
    federation: Any
    round_arrays: ArrayRecord | None
    exchange_phase: str
    _exchange_accepted = 0  # answers of the last exchange handed to ``use_exchange``
    _exchange_round: SentRound
    _exchange_rejected: list[tuple[int, str]]
    _exchange_bounded: int
    _exchange_ratios: dict[str, float]
    _schedule_slots: dict[int, int]
    # PromptStrategy's hooks and Sampling's helpers
    uses_exchange: Callable[[], bool]
    uses_task_end_exchange: Callable[[], bool]
    round_start: Callable[..., None]
    exchange_payload: Callable[[Sent, ArrayRecord], RecordDict | None]
    check_exchange: Callable[[Message, Sent], str | None]
    use_exchange: Callable[[int, list[Accepted]], None]
    _send: Callable[..., SentRound]
    _safely: Callable[..., str | None]
    node_label: Callable[[int], str]
    connected_nodes: Callable[[Grid, int, float], list[int]]

    @property
    def exchange_outcome(self) -> tuple[int, list[tuple[int, str]], int]:
        """The last exchange's answers handed to ``use_exchange``, the (node id, reason) of those left
        out, and the statistics rows the run's bound changed (defended runs)."""
        return self._exchange_accepted, list(self._exchange_rejected), self._exchange_bounded

    def _reset_exchange(self, phase: str) -> None:
        self._exchange_round, self._exchange_rejected, self._exchange_bounded = SentRound(), [], 0
        self._exchange_ratios = {}  # a round without an exchange reports none, not the last one's
        self.exchange_phase = phase

    def configure_exchange(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """The exchange before training (QUERY messages to the round's sampled clients), if the method has one."""
        self._reset_exchange(ROUND)
        if not self.uses_exchange():
            return []
        self.round_arrays = arrays
        self.round_start(server_round, as_int(config["task"]), as_int(config["round"]), arrays)
        self._exchange_round = self._send(server_round, arrays, config, grid, self.exchange_payload, MessageType.QUERY)
        return self._exchange_round.messages

    def configure_task_end_exchange(self, server_round: int, task: int, arrays: ArrayRecord, clients: Sequence[int],
                                    grid: Grid) -> list[Message]:
        """The task-end exchange (QUERY messages to ``clients``, those that trained ``task``), if the
        method has one; ``arrays``: the task's last aggregate, before ``on_task_end``."""
        self._reset_exchange(TASK_END)
        if not self.uses_task_end_exchange() or not clients:
            return []
        self.round_arrays = arrays
        round_ = self.federation.rounds_per_task - 1
        config = ConfigRecord({"task": task, "round": round_, "attempt": 0, EXCHANGE: TASK_END})
        self.round_start(server_round, task, round_, arrays)
        self._exchange_round = self._send(server_round, arrays, config, grid, self.exchange_payload, MessageType.QUERY,
                                          targets=self._task_end_targets(clients, grid))
        return self._exchange_round.messages

    def _task_end_targets(self, clients: Sequence[int], grid: Grid) -> tuple[list[tuple[int, int, int]], float]:
        """(client id, node id, schedule slot) of each of ``clients`` still reachable, and the share of
        them reached. Virtual clients are spread over the connected nodes in turn, as a round spreads
        them; with ``population = "nodes"`` a client is its node, and a node gone is skipped (logged)."""
        if self.federation.population == "nodes":
            nodes = self.connected_nodes(grid, self.robustness.min_replies, self.robustness.round_timeout)
            by_client = {node_client_id(n): n for n in nodes}
            gone = [c for c in clients if c not in by_client]
            if gone:
                log.warning("task-end exchange: %d of the task's %d clients are no longer connected", len(gone),
                            len(clients))
            chosen = [(c, by_client[c], nodes.index(by_client[c])) for c in clients if c in by_client]
            return chosen, len(chosen) / max(len(clients), 1)
        nodes = sorted(grid.get_node_ids())
        if not nodes:
            raise RuntimeError("no Flower nodes are connected")
        return [(c, nodes[i % len(nodes)], self._schedule_slots.get(c, c)) for i, c in enumerate(clients)], 1.0

    def aggregate_exchange(self, server_round: int, replies: list[Message]) -> None:
        """Check the exchange's answers (``check_exchange``; a task-end answer's counts as a train
        reply's), weigh a task-end exchange's by the run's weighting, bound their statistics, and hand
        the good ones to ``use_exchange``."""
        answers = []
        for reply in replies:
            sent = self._exchange_round.match(reply)
            if reply.has_error():
                reason: str | None = f"client error: {reply.error.reason}"
            elif sent is None:
                reason = "cannot tell which message this reply answers (no matching message sent this round)"
            else:
                reason = self._safely(self._task_end_problem, reply, sent) if self.exchange_phase == TASK_END else None
                reason = reason or self._safely(self.check_exchange, reply, sent)
            if reason is None and sent is not None:
                answers.append(Accepted(sent, reply))
                continue
            node = self._exchange_round.sender(reply)
            self._exchange_rejected.append((node, f"exchange: {reason}"))
            log.warning("exchange reply from %s excluded: %s", self.node_label(node), reason)
        if self.exchange_phase == TASK_END:
            for a, w in zip(answers, self.policies.weighting([a.examples for a in answers])):
                a.weight = float(w)
        self._exchange_accepted = len(answers)
        self._exchange_ratios = {}
        self._exchange_bounded = self.policies.stats_bound.apply(answers, self.statistics, self._exchange_ratios)
        self.use_exchange(server_round, answers)

    def _task_end_problem(self, reply: Message, sent: Sent) -> str | None:
        """Why a task-end answer's counts cannot be right (None: they can): a metrics record of the
        samples, some samples, no more than the client holds (or its node declared), within the
        run's reply size."""
        if METRICS not in reply.content.metric_records:
            return "missing 'metrics' record"
        reason = check_metrics(reply.content[METRICS], TASK_END_METRICS)
        if reason is not None:
            return reason
        n = as_int(metrics_of(reply.content)["num-examples"])
        if n == 0:
            return "nothing computed (num-examples 0)"
        return count_and_size_problem(reply, sent, n, self.bounds, self.robustness.max_reply_bytes)
