"""Evaluating the global model after a round: centrally, or by the nodes on their own data.

``evaluation = "central"`` (simulation): the server scores the arrays on its copy of the test
data. ``evaluation = "federated"`` (deployment, where the server holds no data): every connected
node evaluates on its held-out data and the server sums the per-task counts it gets back, each
checked against what the node declared (:func:`check_eval_metrics`); with
``evaluate-with-train`` the nodes sampled for the next round return their counts with their
training update instead (:class:`CarriedEvaluation`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from ..common.model.evaluation import accuracies, correct_counts, pooled_counts
from ..common.model.runtime import Runtime
from ..common.node.startup import metric_name
from ..common.records import (
    ARRAYS,
    CONFIG,
    EVALUATE_TASK,
    EVALUATION,
    METRICS,
    POOL_PREFIX,
    arrays_of,
    as_float,
    config_of,
    metrics_of,
    to_torch,
)
from ..strategies.platform.replies import DECLARED_SIZES, PROCESS_METRICS, MetricSpec, capped_weights
from ..strategies.platform.rounds import without_forged
from ..strategies.platform.strategy import PromptStrategy
from .messaging import message_bytes, send_and_receive, unanswered

log = logging.getLogger("promptfcl")


class CentralEvaluator:
    """Evaluates global parameters on the server's test data (simulation's usual setting).

    A strategy may score each task with its own view of the model
    (``PromptStrategy.evaluation_pools``: Powder's top-k local pools on random tasks).
    """

    #: extra fields for the round's record (the federated evaluator fills them)
    last_record: dict[str, Any] = {}

    def __init__(self, runtime: Runtime, strategy: PromptStrategy | None = None) -> None:
        self.rt = runtime
        self.strategy = strategy

    def __call__(self, arrays: ArrayRecord, task: int) -> np.ndarray:
        views = self.strategy.evaluation_pools(arrays, task) if self.strategy is not None else None
        if views is None:
            self.rt.model.load_trainable_state(to_torch(arrays))
            return accuracies(*correct_counts(self.rt, task))
        view_arrays, pools = views
        self.rt.model.load_trainable_state(to_torch(view_arrays))
        return accuracies(*pooled_counts(self.rt, task, pools))


@dataclass
class CarriedEvaluation:
    """A round whose federated evaluation rides on the next round's train messages
    (``evaluate-with-train``): nodes sent exactly these arrays evaluate them before training
    and return the counts with their update; every other node gets an evaluate message."""

    index: int  # the round's record in ``ExperimentRun.rounds``
    task: int
    arrays: ArrayRecord
    asked: dict[int, int] = field(default_factory=dict)  # this attempt: id() of a train message asked -> node
    counts: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # node -> (correct, total)
    failed: list[dict[str, Any]] = field(default_factory=list)


class FederatedEvaluator:
    """Every connected node evaluates the global parameters on its own held-out data.

    ``evaluation = "federated"`` (deployment, where the server holds no test data): one
    EVALUATE message per node carrying the prompt/head arrays; replies carry per-task
    ``correct`` / ``total`` counts, summed over nodes before dividing, so the accuracy is
    that of the union of the nodes' held-out sets. Nodes that fail or time out are left
    out and counted in the round's record. With ``evaluate-with-train``, the counts of the
    nodes sampled for the next round come with their train replies (``ask`` / ``collect`` /
    ``complete``) and only the others get a message.
    """

    def __init__(self, grid: Grid, strategy: PromptStrategy) -> None:
        self.grid = grid
        self.strategy = strategy
        self.last_record: dict[str, Any] = {}
        self.last_total = 0  # held-out samples behind the last evaluation

    def __call__(self, arrays: ArrayRecord, task: int) -> np.ndarray:
        return self._evaluate(arrays, task, {}, [])

    # -- evaluation carried by train messages (evaluate-with-train) ------------------
    def ask(self, messages: list[Message], carried: CarriedEvaluation) -> None:
        """Ask, in their config, the train messages that carry exactly ``carried.arrays`` (and go
        to a node not counted yet) to evaluate them first."""
        carried.asked = {}  # this attempt's messages only (ids of live objects)
        done = set(carried.counts) | {f["node"] for f in carried.failed}
        for m in messages:
            node = int(m.metadata.dst_node_id)
            # a node playing several clients evaluates once; one counted or refused is not asked again
            if node in done or node in carried.asked.values() or ARRAYS not in m.content.array_records or \
                    not same_arrays(arrays_of(m.content), carried.arrays):
                continue
            config = ConfigRecord(dict(config_of(m.content)))  # this message's own copy
            config[EVALUATE_TASK] = carried.task
            m.content[CONFIG] = config
            carried.asked[id(m)] = node

    def collect(self, messages: list[Message], replies: list[Message], carried: CarriedEvaluation) -> None:
        """Read the counts the replies to asked messages carry. A reply without them (an error,
        a node that ignored the request) leaves its node to an evaluate message; malformed
        counts leave the node out, as a malformed evaluate reply does."""
        by_id = {m.metadata.message_id: carried.asked[id(m)] for m in messages if id(m) in carried.asked}
        for reply in replies:
            node = by_id.get(reply.metadata.reply_to_message_id)
            if node is None or reply.has_error() or EVALUATION not in reply.content.metric_records:
                continue
            record = metrics_of(reply.content, EVALUATION)
            try:
                result = check_eval_metrics(record, carried.task, self.strategy, node)
            except Exception as exc:  # nothing a reply holds may stop the run
                result = f"evaluation could not be checked ({type(exc).__name__}: {exc})"
            if isinstance(result, str):
                carried.failed.append({"node": node, "reason": result})
            else:
                carried.counts[node] = result

    def complete(self, carried: CarriedEvaluation) -> np.ndarray:
        """The carried round's accuracies: the counts that came with training, and an evaluate
        message to every other connected node."""
        return self._evaluate(carried.arrays, carried.task, carried.counts, carried.failed)

    def _evaluate(self, arrays: ArrayRecord, task: int, carried: dict[int, tuple[np.ndarray, np.ndarray]],
                  carried_failed: list[dict[str, Any]]) -> np.ndarray:

        done = set(carried) | {f["node"] for f in carried_failed}
        # with counts in hand, no node need be waited for
        nodes = [n for n in self.strategy.connected_nodes(self.grid, 0 if carried else 1,
                                                          self.strategy.robustness.round_timeout)
                 if n not in done]
        config = ConfigRecord({"task": task, "config-digest": self.strategy.config_digest,
                               "num-classes": self.strategy.num_classes})
        views = self.strategy.evaluation_pools(arrays, task)  # each task through its own slices (Powder)
        if views is not None:
            arrays = views[0]
            config.update({f"{POOL_PREFIX}{scored}": [int(s) for s in pool] for scored, pool in views[1].items()})
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        messages = [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=n) for n in nodes]
        replies = without_forged(send_and_receive(self.grid, messages, self.strategy.robustness.round_timeout),
                                 messages,
                                 f"evaluation of task {task + 1}") if messages else []
        sent_to = {m.metadata.message_id: int(m.metadata.dst_node_id) for m in messages if m.metadata.message_id}
        counts = dict(carried)
        failed = list(carried_failed)
        overheads: list[float] = []
        for reply in replies:
            # a dead node's error reply comes from the SuperLink: name the node it was sent to
            node = sent_to.get(reply.metadata.reply_to_message_id, int(reply.metadata.src_node_id))
            try:
                result = _eval_counts(reply, task, self.strategy, node)
            except Exception as exc:  # nothing a reply holds may stop the run
                result = f"reply could not be checked ({type(exc).__name__}: {exc})"
            if isinstance(result, str):
                failed.append({"node": node, "reason": result})
                continue
            counts[node] = result
            m = reply.content[METRICS]
            if metric_name("imports") in m and "process-seconds" in m:  # a fresh process: its start-up
                overheads.append(as_float(m["process-seconds"]))
        failed += [{"node": int(m.metadata.dst_node_id), "reason": "no evaluation reply before round-timeout"}
                   for m in unanswered(messages, replies)]
        failed = [self.strategy.named(f) for f in failed]
        for f in failed:
            log.warning("evaluation on %s left out: %s", self.strategy.node_label(f["node"]), f["reason"])
        ordered = [counts[n] for n in sorted(counts)]  # by node id, however the counts came
        total = np.sum([t for _, t in ordered], axis=0) if ordered else np.zeros(task + 1, np.int64)
        self.last_total = int(total.sum())
        self.last_record = {
            "eval_nodes": len(ordered),
            "eval_carried": len(carried),  # nodes whose counts came with their train reply
            "eval_failed": failed,
            "eval_bytes_s2c": message_bytes(messages),
            # evaluate messages only: counts carried by train replies are in that round's bytes_c2s
            "eval_bytes_c2s": message_bytes([m for m in replies if not m.has_error()]),
            "eval_test_size": self.last_total,
            # evaluate messages to fresh processes: process start to reply, median
            "eval_process_seconds": float(np.median(overheads)) if overheads else 0.0,
        }
        if not ordered:
            log.warning("no node returned evaluation counts for task %d", task + 1)
            return accuracies(np.zeros(task + 1, np.int64), np.zeros(task + 1, np.int64))
        return pooled_accuracies(ordered, self.strategy.robustness.max_client_weight)


def same_arrays(a: ArrayRecord, b: ArrayRecord) -> bool:
    """Whether two array records hold the same names, dtypes, shapes and values."""
    if a is b:
        return True
    if list(a.keys()) != list(b.keys()):
        return False
    for name in a.keys():
        x, y = a[name], b[name]
        if x.dtype != y.dtype or list(x.shape) != list(y.shape) or x.data != y.data:
            return False
    return True


def pooled_accuracies(counts: list[tuple[np.ndarray, np.ndarray]], cap: float) -> np.ndarray:
    """Per task: accuracy over the union of the nodes' held-out samples (sum of correct over
    sum of totals); with 3 or more nodes, no node weighs more than ``cap`` of a task's samples
    (a node inflating its counts cannot decide the figure)."""
    correct = np.sum([c for c, _ in counts], axis=0)
    total = np.sum([t for _, t in counts], axis=0)
    pooled = accuracies(correct, total)
    if len(counts) < 3:
        return pooled
    for task in range(len(total)):
        sizes = np.array([t[task] for _, t in counts], dtype=np.float64)
        if total[task] == 0 or sizes.max() <= cap * sizes.sum():
            continue
        weights = capped_weights(sizes, cap)
        rates = np.array([c[task] / t[task] if t[task] else 0.0 for c, t in counts])
        pooled[task] = 100.0 * float(np.dot(weights, rates))
    return pooled


def _eval_counts(reply: Message, task: int, strategy: PromptStrategy,
                 node: int) -> tuple[np.ndarray, np.ndarray] | str:
    """(correct, total) per task from an evaluation reply, or why it cannot be used.

    ``correct <= total`` per task, ``num-examples`` their sum, and the sum within the test
    size the node declared (its first reply)."""
    if reply.has_error():
        return f"client error: {reply.error.reason}"
    content = reply.content
    if set(content.keys()) != {METRICS} or METRICS not in content.metric_records:
        return f"an evaluation reply holds exactly a 'metrics' record, got {sorted(content.keys())}"
    return check_eval_metrics(metrics_of(content), task, strategy, node)


#: what evaluation counts may hold besides ``correct`` / ``total`` (evaluate replies, and the
#: ``evaluation`` record of a train reply); a fresh process also reports its start-up
EVAL_METRICS: dict[str, MetricSpec] = {"num-examples": MetricSpec(int, low=0), **DECLARED_SIZES, **PROCESS_METRICS}


def check_eval_metrics(m: MetricRecord, task: int, strategy: PromptStrategy,
                       node: int) -> tuple[np.ndarray, np.ndarray] | str:
    """(correct, total) per task from evaluation counts, or why they cannot be used (see
    ``_eval_counts``)."""
    unknown = sorted(set(m.keys()) - set(EVAL_METRICS) - {"correct", "total"})
    if unknown:
        return f"undeclared metrics {unknown[:4]}"
    correct, total = m.get("correct"), m.get("total")
    for name, values in (("correct", correct), ("total", total)):
        if not isinstance(values, list) or len(values) != task + 1 or \
                not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return f"{name} must be {task + 1} non-negative integers (one per task), got {str(values)[:80]}"
    for name, spec in EVAL_METRICS.items():
        if name in m and (reason := spec.check(name, m[name])) is not None:
            return reason
    c, t = np.asarray(correct, dtype=np.int64), np.asarray(total, dtype=np.int64)
    if (c > t).any():
        return "inconsistent counts (correct > total)"
    if m.get("num-examples") != int(t.sum()):
        return f"num-examples {m.get('num-examples')} is not the sum of the totals {int(t.sum())}"
    if strategy.federation.population == "nodes":
        # random tasks share classes, so a held-out image counts once per task holding its class
        held_out = int(t.max()) if strategy.data.task_generator == "random" else int(t.sum())
        reason = strategy.bounds.check_declared(node, m, test_total=held_out)
        if reason is not None:
            return reason
    return c, t
