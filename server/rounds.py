"""One training round: messages out, replies in, aggregation, and its typed record.

A round is retried with freshly sampled clients when too few replies are usable
(``round-retries``); what every attempt cost is accounted in the round's record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from ..common.node.startup import PHASES, metric_name
from ..common.records import CONFIG, METRICS, as_float, as_int
from ..strategies.platform.outcome import RoundOutcome
from ..strategies.platform.replies import PLAN_METRICS
from ..strategies.platform.rounds import Accepted, without_forged
from ..strategies.platform.strategy import PromptStrategy
from .messaging import message_bytes, send_and_receive, unanswered

log = logging.getLogger("promptfcl")


class RoundFailed(RuntimeError):
    """A round got too few usable replies even after its retries."""


@dataclass
class RoundRecord:
    """What one round did (results.json's ``rounds``, and the checkpoint's)."""

    task: int
    round: int
    server_round: int
    accuracy: float | None  # None: not evaluated this round (evaluate-every), or not yet (eval_pending)
    task_accuracies: list[float] | None
    bytes_s2c: int
    bytes_c2s: int
    client_seconds: float
    client_seconds_max: float
    client_process_seconds_max: float
    # deployment: median time a client process spent before training, and per start-up phase
    # over the fresh processes of the round (common/node/startup.py; empty when warm)
    client_overhead_seconds: float
    client_startup: dict[str, float]
    client_device_peak_mb: float
    server_seconds: float
    round_seconds: float
    eval_seconds: float
    attempts: int
    clients_sampled: int
    client_tasks: list[int]  # the task each client of the (last) attempt trained
    placement: list[dict[str, Any]]  # where each client of the (last) attempt trained
    clients_aggregated: int
    # accepted replies' update norms (what update-norm-factor compares): their spread shows how far
    # honest clients differ, and so how tight the factor can be
    update_norms: list[float]
    reply_shares: list[float]  # each accepted reply's share of the round's weight
    examples: int  # training samples behind the aggregate
    rejected: list[dict[str, Any]]
    train_loss: float
    strategy_metrics: dict[str, Any]  # the method's own figures (consolidation time, loss terms, ...)
    evaluation: dict[str, Any] = field(default_factory=dict)  # federated evaluation: nodes, failures, bytes
    eval_pending: bool = False  # evaluated with the next round's training (evaluate-with-train)
    epsilon: float | None = None  # differential privacy: the guarantee after this round
    private: bool = False  # whether ``epsilon`` applies (dp.* on)
    # each accepted reply's cosine with its task's median update (None: fewer than 3 on its task),
    # defended or not: how far honest clients disagree, and so how tight update-min-cosine can be
    update_cosines: list[float | None] = field(default_factory=list)
    # defended runs: replies each defence excluded ("norm-filter", "direction", "struck-out": its
    # client's strikes reached update-strikes) or clipped ("clip")
    defences: dict[str, int] = field(default_factory=dict)
    # per uploaded statistics array: its largest row scale over the round's lower median (what
    # stats-bound compares), defended or not
    stats_ratios: dict[str, float] = field(default_factory=dict)
    # each accepted reply's node, with its registered name where Flower says, and its client id
    # (aligned with reply_shares, update_norms and update_cosines: a client's cosines over the run)
    reply_nodes: list[str] = field(default_factory=list)
    reply_clients: list[int] = field(default_factory=list)
    # each attempt's sampling rate, sampled / population at sampling time (population = nodes: the
    # nodes connected then): what differential privacy's accountant composes
    sample_rates: list[float] = field(default_factory=list)
    # nodes with a memory budget or their own backbone precision: each accepted reply's node and what
    # it chose (micro-batch, checkpointing, backbone bits) and used (peak resident MB); client/memory.py
    memory_plans: list[dict[str, Any]] = field(default_factory=list)
    # a task's last round, where the method has a task-end exchange (LoRM's Gram pass): its clients,
    # answers, bytes (also in bytes_s2c / bytes_c2s), seconds and rejections; absent otherwise
    task_end_exchange: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("evaluation", "eval_pending", "epsilon", "private", "task_end_exchange")}
        if self.task_end_exchange:
            out["task_end_exchange"] = self.task_end_exchange
        out.update(self.evaluation)
        if self.eval_pending:
            out["eval_pending"] = True
        if self.private:
            out["epsilon"] = self.epsilon
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoundRecord:
        names = {f.name for f in fields(cls)}
        core = {k: v for k, v in d.items() if k in names and k not in ("evaluation", "private")}
        evaluation = {k: v for k, v in d.items() if k not in names}
        return cls(**core, evaluation=evaluation, private="epsilon" in d)


@dataclass
class Attempts:
    """What a round's attempts cost and received, accumulated."""

    bytes_s2c: int = 0
    bytes_c2s: int = 0
    sampled: int = 0
    server_seconds: float = 0.0
    round_seconds: float = 0.0
    client_secs: list[float] = field(default_factory=list)
    process_secs: list[float] = field(default_factory=list)
    device_peaks: list[float] = field(default_factory=list)  # clients on CUDA: peak memory allocated, MB
    overheads: list[float] = field(default_factory=list)
    startup_phases: dict[str, list[float]] = field(default_factory=dict)
    rejected: list[dict[str, Any]] = field(default_factory=list)
    sample_rates: list[float] = field(default_factory=list)  # each attempt's, as it sampled
    plans: list[dict[str, Any]] = field(default_factory=list)  # budgeted nodes' memory plans (accepted replies)
    count: int = 0  # attempts made

    def read_replies(self, used: list[MetricRecord]) -> None:
        """The accepted replies' metrics (they have passed the checks of every field)."""
        self.client_secs += [as_float(m["train-seconds"]) for m in used]
        # deployment: a message's whole cost on a node (fresh process: imports, data, backbone)
        self.process_secs += [as_float(m.get("process-seconds", 0.0)) for m in used]
        # a fresh process (every deployed message; an actor's first in simulation): its time before
        # the first training step, and per phase (common/node/startup.py)
        fresh = [m for m in used if metric_name("imports") in m and "process-seconds" in m]
        self.overheads += [as_float(m["process-seconds"]) - as_float(m["train-seconds"])
                           - as_float(m.get("evaluation-seconds", 0.0))  # evaluate-with-train: work, not start-up
                           + as_float(m.get(metric_name("query_cache"), 0.0))  # read inside training, yet start-up
                           for m in fresh]
        for name in PHASES:
            self.startup_phases.setdefault(name, []).extend(as_float(m[metric_name(name)]) for m in fresh
                                                            if metric_name(name) in m)
        self.device_peaks += [as_float(m.get("device-peak-mb", 0.0)) for m in used]


def train_round(grid: Any, strategy: PromptStrategy, arrays: ArrayRecord, task: int, round_: int, server_round: int,
                before_aggregation: Any = None, *, out_dir: str) -> tuple[RoundOutcome, Attempts, list]:
    """Configure, send, receive and aggregate one round, retrying with fresh clients while too few
    replies are usable. ``before_aggregation(messages, replies)`` sees each attempt's exchange
    (the federated evaluator reads the counts train replies carry; it may also mark the messages
    before they go, through ``before_aggregation.ask(messages)``).

    Returns the last attempt's outcome (its arrays and metrics set), what the attempts cost, and
    the last attempt's messages.

    Raises
    ------
    RoundFailed
        Every attempt had fewer than ``min-replies`` usable replies (the last checkpoint is intact).
    """
    robustness = strategy.robustness
    spent = Attempts()
    for attempt in range(robustness.round_retries + 1):
        spent.count = attempt + 1
        t0 = time.perf_counter()
        config = ConfigRecord({"task": task, "round": round_, "attempt": attempt})
        exchange, waited = list(strategy.configure_exchange(server_round, arrays, config, grid)), 0.0
        if exchange:  # a step before training (Powder's measuring exchange); its bytes are the round's
            tx = time.perf_counter()
            answers = without_forged(send_and_receive(grid, exchange, robustness.round_timeout), exchange,
                                     f"round {server_round} exchange")
            waited = time.perf_counter() - tx
            strategy.aggregate_exchange(server_round, answers)
            spent.bytes_s2c += message_bytes(exchange)
            spent.bytes_c2s += message_bytes([m for m in answers if not m.has_error()])
        messages = list(strategy.configure_train(server_round, arrays, config, grid))
        if before_aggregation is not None:
            before_aggregation.ask(messages)
        t1 = time.perf_counter()
        replies = without_forged(send_and_receive(grid, messages, robustness.round_timeout), messages,
                                 f"round {server_round}")
        t2 = time.perf_counter()
        if before_aggregation is not None:
            before_aggregation.collect(messages, replies)
        # counted as received: aggregation may rewrite a reply (a clip, a method completing a partial one)
        received = message_bytes([m for m in replies if not m.has_error()])
        outcome = strategy.aggregate_round(server_round, replies)
        t3 = time.perf_counter()
        spent.sample_rates.append(outcome.sample_rate)  # what the sampling of this attempt's clients set
        spent.bytes_s2c += message_bytes(messages)
        spent.bytes_c2s += received
        spent.sampled += len(messages)
        spent.server_seconds += (t1 - t0 - waited) + (t3 - t2)
        spent.round_seconds += t3 - t0
        used = [a.content.metric_records[METRICS] for a in outcome.accepted] if outcome.aggregated else []
        spent.read_replies(used)
        if outcome.aggregated:
            spent.plans = memory_plans(outcome.accepted)
        spent.rejected += [strategy.named({"node": int(n), "reason": r, "attempt": attempt})
                           for n, r in outcome.rejected]
        spent.rejected += [strategy.named({"node": int(m.metadata.dst_node_id), "attempt": attempt,
                                           "reason": "no reply before round-timeout"})
                           for m in unanswered(messages, replies)]
        if outcome.aggregated:
            return outcome, spent, messages
        log.warning("round %d attempt %d: too few usable replies (%d of %d)%s", server_round, attempt + 1,
                    len(outcome.accepted), len(messages),
                    "; retrying with fresh clients" if attempt < robustness.round_retries else "")
    raise RoundFailed(
        f"round {server_round} (task {task + 1}, round {round_ + 1}) had fewer than min-replies = "
        f"{robustness.min_replies} usable replies in {robustness.round_retries + 1} attempts; the last checkpoint "
        f"in {out_dir} is intact. Reasons: {sorted({r['reason'][:120] for r in spent.rejected})[:5]}")


def task_end_exchange(grid: Any, strategy: PromptStrategy, arrays: ArrayRecord, task: int, server_round: int,
                      clients: Sequence[int]) -> dict[str, Any]:
    """The method's task-end exchange (``uses_task_end_exchange``; strategies/platform/exchange.py): QUERY
    messages to ``clients`` (those that trained ``task``) with ``arrays`` (the task's last aggregate),
    their answers checked and handed to the method, before its ``on_task_end``. What it cost and
    received, for the task's last round's record (empty where the method has none)."""
    t0 = time.perf_counter()
    messages = list(strategy.configure_task_end_exchange(server_round, task, arrays, clients, grid))
    if not messages:
        return {}
    answers = without_forged(send_and_receive(grid, messages, strategy.robustness.round_timeout), messages,
                             f"task {task + 1} end exchange")
    strategy.aggregate_exchange(server_round, answers)
    accepted, excluded, bounded = strategy.exchange_outcome
    rejected = [strategy.named({"node": int(n), "reason": r}) for n, r in excluded]
    rejected += [strategy.named({"node": int(m.metadata.dst_node_id), "reason": "no reply before round-timeout"})
                 for m in unanswered(messages, answers)]
    return {"clients": len(messages), "answers": accepted,
            "bytes_s2c": message_bytes(messages), "bytes_c2s": message_bytes([m for m in answers if not m.has_error()]),
            "seconds": time.perf_counter() - t0, "stats_bounded": bounded, "rejected": rejected}


def memory_plans(accepted: Sequence[Accepted]) -> list[dict[str, Any]]:
    """Each accepted reply's memory plan, with its node, where the node reports one (client/memory.py)."""
    plans = []
    for reply in accepted:
        metrics = reply.content.metric_records[METRICS]
        chosen = {key: metrics[key] for key in PLAN_METRICS if key in metrics}
        if chosen:
            plans.append({"node": reply.sent.node, **chosen})
    return plans


def round_record(task: int, round_: int, server_round: int, outcome: RoundOutcome, spent: Attempts,
                 messages: list) -> RoundRecord:
    """The round's record from what its attempts spent and its outcome (not evaluated yet)."""
    agg = outcome.metrics
    assert agg is not None, "a round's record is made of an aggregated outcome (train_round)"
    return RoundRecord(
        task=task, round=round_, server_round=server_round, accuracy=None, task_accuracies=None,
        bytes_s2c=spent.bytes_s2c, bytes_c2s=spent.bytes_c2s,
        client_seconds=float(np.mean(spent.client_secs)) if spent.client_secs else 0.0,
        client_seconds_max=float(np.max(spent.client_secs)) if spent.client_secs else 0.0,
        client_process_seconds_max=float(np.max(spent.process_secs)) if spent.process_secs else 0.0,
        client_overhead_seconds=float(np.median(spent.overheads)) if spent.overheads else 0.0,
        client_startup={k: float(np.median(v)) for k, v in spent.startup_phases.items() if v},
        client_device_peak_mb=float(np.max(spent.device_peaks)) if spent.device_peaks else 0.0,
        server_seconds=spent.server_seconds, round_seconds=spent.round_seconds, eval_seconds=0.0,
        attempts=spent.count, clients_sampled=spent.sampled,
        client_tasks=[int(m.content[CONFIG]["task"]) for m in messages if CONFIG in m.content.config_records],
        placement=[outcome.placement_of(m) for m in messages],
        clients_aggregated=as_int(agg["clients"]),
        update_norms=[float(v) for v in outcome.update_norms],
        reply_shares=list(outcome.shares),
        reply_nodes=list(outcome.nodes),
        reply_clients=[int(c) for c in outcome.clients],
        update_cosines=[None if c is None else round(float(c), 4) for c in outcome.update_cosines],
        defences=dict(outcome.defences),
        stats_ratios=dict(outcome.stats_ratios),
        sample_rates=list(spent.sample_rates),
        memory_plans=spent.plans,
        examples=as_int(agg["num-examples"]),
        rejected=spent.rejected,
        train_loss=as_float(agg["train-loss"]),
        strategy_metrics={k: v for k, v in agg.items() if k not in ("num-examples", "clients", "train-loss")},
    )
