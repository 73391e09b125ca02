"""The server's run: N tasks x R rounds of Flower message exchange, evaluation and accounting.

Like Flower's ``Strategy.start`` loop, but aware of the task schedule: it calls the
strategy's task hooks, evaluates after every round, fills the accuracy matrix,
and measures bytes (from the records actually sent) and time per round.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from promptfcl.common import metrics
from promptfcl.common.config import ConfigError, ExperimentConfig
from promptfcl.common.data import client_indices
from promptfcl.common.evaluation import accuracies, correct_counts, pooled_counts
from promptfcl.common.privacy import privacy_options, privacy_report
from promptfcl.common.startup import PHASES, metric_name
from promptfcl.common.records import (ARRAYS, CONFIG, EVALUATE_TASK, EVALUATION, METRICS, POOL_PREFIX, from_array_record,
                            payload_bytes, to_array_record, to_torch)
from promptfcl.common.model import initial_trainable_state
from promptfcl.common.runtime import Runtime, get_runtime
from promptfcl.server import checkpoint
from promptfcl.strategies.registry import build_strategy, strategy_class
from promptfcl.strategies.platform.strategy import PromptStrategy
from promptfcl.strategies.platform.replies import DECLARED_SIZES, PROCESS_METRICS, MetricSpec, capped_weights

log = logging.getLogger("promptfcl")


@dataclass
class RunState:
    """Everything the run has produced so far."""

    accuracy_matrix: np.ndarray
    rounds: list[dict[str, Any]] = field(default_factory=list)


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

    index: int  # the round's record in ``RunState.rounds``
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
                    not same_arrays(m.content[ARRAYS], carried.arrays):
                continue
            config = ConfigRecord(dict(m.content[CONFIG]))  # this message's own copy
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
            record = reply.content[EVALUATION]
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
        from flwr.app import MessageType

        cfg = self.strategy.cfg
        done = set(carried) | {f["node"] for f in carried_failed}
        # with counts in hand, no node need be waited for
        nodes = [n for n in self.strategy.connected_nodes(self.grid, 0 if carried else 1, cfg.round_timeout)
                 if n not in done]
        config = ConfigRecord({"task": task, "config-digest": cfg.digest(),
                               "num-classes": self.strategy.num_classes})
        views = self.strategy.evaluation_pools(arrays, task)  # each task through its own slices (Powder)
        if views is not None:
            arrays = views[0]
            config.update({f"{POOL_PREFIX}{scored}": [int(s) for s in pool] for scored, pool in views[1].items()})
        content = RecordDict({ARRAYS: arrays, CONFIG: config})
        messages = [Message(content=content, message_type=MessageType.EVALUATE, dst_node_id=n) for n in nodes]
        replies = send_and_receive(self.grid, messages, cfg.round_timeout) if messages else []
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
                overheads.append(float(m["process-seconds"]))
        failed += [{"node": int(m.metadata.dst_node_id), "reason": "no evaluation reply before round-timeout"}
                   for m in unanswered(messages, replies)]
        for f in failed:
            log.warning("evaluation on node %s left out: %s", f["node"], f["reason"])
        ordered = [counts[n] for n in sorted(counts)]  # by node id, however the counts came
        total = np.sum([t for _, t in ordered], axis=0) if ordered else np.zeros(task + 1, np.int64)
        self.last_total = int(total.sum())
        self.last_record = {
            "eval_nodes": len(ordered),
            "eval_carried": len(carried),  # nodes whose counts came with their train reply
            "eval_failed": failed,
            "eval_bytes_s2c": _bytes(messages),
            # evaluate messages only: counts carried by train replies are in that round's bytes_c2s
            "eval_bytes_c2s": _bytes([m for m in replies if not m.has_error()]),
            "eval_test_size": self.last_total,
            # evaluate messages to fresh processes: process start to reply, median
            "eval_process_seconds": float(np.median(overheads)) if overheads else 0.0,
        }
        if not ordered:
            log.warning("no node returned evaluation counts for task %d", task + 1)
            return accuracies(np.zeros(task + 1, np.int64), np.zeros(task + 1, np.int64))
        return pooled_accuracies(ordered, cfg.max_client_weight)


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


def unanswered(messages: list[Message], replies: list[Message]) -> list[Message]:
    """The messages no reply answers (by message id, which Flower's grids set when sending)."""
    answered = {r.metadata.reply_to_message_id for r in replies}
    return [m for m in messages if m.metadata.message_id not in answered]


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
    return check_eval_metrics(content[METRICS], task, strategy, node)


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
    if strategy.cfg.population == "nodes":
        # random tasks share classes, so a held-out image counts once per task holding its class
        held_out = int(t.max()) if strategy.cfg.task_generator == "random" else int(t.sum())
        reason = strategy.bounds.check_declared(node, m, test_total=held_out)
        if reason is not None:
            return reason
    return c, t


def _bytes(messages: list[Message]) -> int:
    """Total payload of ``messages``; shared contents are measured once, counted per message."""
    sizes: dict[int, int] = {}
    total = 0
    for m in messages:
        key = id(m.content)
        if key not in sizes:
            sizes[key] = payload_bytes(m.content)
        total += sizes[key]
    return total


class RoundFailed(RuntimeError):
    """A round got too few usable replies even after its retries."""


def run_experiment(grid: Grid, cfg: ExperimentConfig) -> dict[str, Any]:
    """Run (or resume) the whole task stream; return the results dictionary (see server.report)."""
    started = time.perf_counter()
    method = strategy_class(cfg.strategy)
    runtime: Runtime | None = None
    evaluate: CentralEvaluator | FederatedEvaluator
    if cfg.evaluation == "federated":
        # Deployment: the server holds neither data nor backbone; nodes evaluate (see deploy/README.md).
        log.info("federated evaluation: %d classes in %d tasks; the nodes hold the data and the backbone",
                 cfg.num_classes, cfg.num_tasks)
        strategy: PromptStrategy = build_strategy(cfg, cfg.num_classes)
        evaluate = FederatedEvaluator(grid, strategy)
        arrays = to_array_record(initial_trainable_state(cfg, method.prompt_class))
    else:
        runtime = get_runtime(cfg, method.prompt_class)
        log.info("backbone: %s", runtime.weights_source)
        data = runtime.data
        log.info("data: %s, %d classes in %d tasks, %d train / %d test images",
                 data.name, data.num_classes, cfg.num_tasks, len(data.train), len(data.test))
        if cfg.num_classes and cfg.num_classes != data.num_classes:
            raise ConfigError(f"num-classes = {cfg.num_classes} but {data.name} has {data.num_classes} classes")
        strategy = build_strategy(cfg, data.num_classes)
        if cfg.population == "virtual":  # the server knows what each virtual client holds: counts are checked
            strategy.bounds.max_examples = len(data.train)
            labels = data.train.labels
            strategy.bounds.examples_of = lambda client, task, round_: len(
                client_indices(labels, cfg, data.num_classes, client, task, round_))
        evaluate = CentralEvaluator(runtime, strategy)
        arrays = to_array_record(runtime.model.trainable_state())
    strategy.summary()
    state = RunState(metrics.empty_matrix(cfg.num_tasks))

    # Where to start: the beginning, or just after the last checkpointed round.
    schedule = strategy.schedule
    steps = schedule.steps()  # (nominal task, round within it) of every round
    server_round, elapsed_before, pending_task_end = 0, 0.0, None
    carried: CarriedEvaluation | None = None  # a round evaluated with the next one's training
    saved = checkpoint.load(cfg.out_dir)
    if saved is not None and not cfg.resume:
        raise ConfigError(
            f"{cfg.out_dir} already holds a checkpoint (task {saved.task + 1}, round {saved.round + 1}); "
            "continue it with resume=true (simulation: `promptfcl resume DIR`; deployment: deploy/submit-run.sh "
            "... --set resume=true) or choose another out-dir"
        )
    if cfg.resume:
        if saved is None:
            raise ConfigError(f"resume=true but {cfg.out_dir} holds no checkpoint")
        checkpoint.check_compatible(saved, cfg)
        arrays = to_array_record(saved.arrays)
        strategy.load_state_dict(saved.strategy_state)
        strategy.load_platform_state(getattr(saved, "platform_state", {}))
        state = RunState(saved.accuracy_matrix.copy(), list(saved.rounds))
        checkpoint.restore_rng(saved.rng)
        server_round, elapsed_before = saved.server_round, saved.elapsed_seconds
        if not saved.task_finished:  # stopped between a task's last round and its end step
            pending_task_end = schedule.task_ending(server_round - 1)
        if state.rounds and state.rounds[-1].get("eval_pending"):  # its evaluation rides on the next round
            carried = CarriedEvaluation(len(state.rounds) - 1, int(state.rounds[-1]["task"]), arrays)
        log.info("resuming after task %d round %d (server round %d)", saved.task + 1, saved.round + 1, server_round)

    def save(task: int, round_: int, finished: bool) -> None:
        checkpoint.save(checkpoint.Checkpoint(
            config=cfg.to_dict(), task=task, round=round_, server_round=server_round, task_finished=finished,
            arrays=from_array_record(arrays), strategy_state=strategy.state_dict(),
            platform_state=strategy.platform_state(),
            accuracy_matrix=state.accuracy_matrix.copy(), rounds=list(state.rounds), rng=checkpoint.capture_rng(),
            elapsed_seconds=elapsed_before + time.perf_counter() - started,
        ), cfg.out_dir)

    def end_task(task: int) -> None:
        """The strategy's task-end step, then the task's accuracy-matrix column."""
        nonlocal arrays
        end_arrays = strategy.on_task_end(task, arrays)
        task_acc = np.array(state.rounds[-1]["task_accuracies"])
        if end_arrays is not arrays:
            arrays = end_arrays
            task_acc = evaluate(arrays, task)
        state.accuracy_matrix[: task + 1, task] = task_acc
        save(task, cfg.rounds_per_task - 1, finished=True)
        summary = metrics.summary(state.accuracy_matrix, upto=task)
        log.info("after task %d: A_t %.2f, AIA %.2f, forgetting %.2f", task + 1,
                 summary["final_average_accuracy"], summary["average_incremental_accuracy"],
                 summary["average_forgetting"])

    def complete(carried: CarriedEvaluation) -> None:
        """Fill the carried round's record with its accuracies, now that its counts are in."""
        assert isinstance(evaluate, FederatedEvaluator)
        t = time.perf_counter()
        task_acc = evaluate.complete(carried)
        record = state.rounds[carried.index]
        record.pop("eval_pending", None)
        record.update({"accuracy": float(np.nanmean(task_acc)), "task_accuracies": [float(a) for a in task_acc],
                       "eval_seconds": time.perf_counter() - t, **evaluate.last_record})
        log.info("server round %d: acc %5.1f%% (tasks %s), %d of %d nodes evaluated it with their training",
                 record["server_round"], record["accuracy"], " ".join(f"{a:.0f}" for a in task_acc),
                 record["eval_carried"], record["eval_nodes"])

    if pending_task_end is not None:
        end_task(pending_task_end)
    if carried is not None and not (cfg.evaluate_with_train and isinstance(evaluate, FederatedEvaluator)):
        complete(carried)  # resumed with evaluate-with-train off: by evaluate messages
        carried = None
    placement_logged = False
    # Rounds follow the schedule's steps: on the stream, task j ends after round (j+1)R, where
    # the accuracy matrix takes column j; with asynchronous arrival each client gets its own
    # task, and a task's slice is initialised in the round its first client reaches it. With
    # random tasks the nominal task is the newest one started, and no task ends for everyone.
    # max-rounds: a smoke test or benchmark stops early, keeping its checkpoint to resume from
    last = min(len(steps), cfg.max_rounds) if cfg.max_rounds else len(steps)
    for index in range(server_round, last):
        task, round_ = steps[index]
        server_round = index + 1
        for new_task in schedule.tasks_starting(index):
            arrays = strategy.on_task_start(new_task, arrays)
        ending = schedule.task_ending(index)
        # evaluate-every: skipped rounds only; a task's end (its accuracy-matrix column) and
        # the run's last round are always evaluated
        evaluate_now = server_round % cfg.evaluate_every == 0 or ending is not None or index == last - 1
        # evaluate-with-train: a round within a task is evaluated by the next round's train messages
        carry = (cfg.evaluate_with_train and isinstance(evaluate, FederatedEvaluator) and ending is None
                 and index < last - 1)
        arrays, record = run_round(grid, strategy, evaluate, arrays, task, round_, server_round, evaluate_now,
                                   carry, carried, complete)
        state.rounds.append(record)
        carried = CarriedEvaluation(len(state.rounds) - 1, task, arrays) if record.get("eval_pending") else None
        privacy = privacy_so_far(cfg, strategy, state.rounds)
        if privacy["enabled"]:  # the guarantee after every round (None: no noise, no guarantee)
            record["epsilon"] = privacy["epsilon"]
        on_tasks = sorted(set(record["client_tasks"]))
        clients_on = f" (clients on tasks {','.join(str(t + 1) for t in on_tasks)})"
        log.info(
            "%s | %s %s | S2C %s C2S %s | client %.2fs server %.3fs%s%s",
            f"round {server_round}/{len(steps)}{clients_on}" if cfg.task_generator == "random" else
            f"task {task + 1}/{cfg.num_tasks} round {round_ + 1}/{cfg.rounds_per_task}"
            + ("" if on_tasks == [task] else clients_on),
            "acc     -" if record["accuracy"] is None else f"acc {record['accuracy']:5.1f}%",
            "evaluated with the next round" if record.get("eval_pending") else
            "not evaluated" if record["task_accuracies"] is None else
            "(tasks " + " ".join(f"{a:.0f}" for a in record["task_accuracies"]) + ")", _human(record["bytes_s2c"]),
            _human(record["bytes_c2s"]), record["client_seconds"], record["server_seconds"],
            f" | {len(record['rejected'])} replies excluded" if record["rejected"] else "",
            "" if not privacy["enabled"] else " | eps so far " + (
                "inf (no noise)" if privacy["epsilon"] is None else f"{privacy['epsilon']:.3g}"),
        )
        if not placement_logged:  # once per process: where the clients actually trained
            log_placement(record["placement"])
            placement_logged = True
        save(task, round_, finished=False)
        if ending is not None:
            end_task(ending)

    if carried is not None:  # resumed with max-rounds at the saved round: no next round to carry it
        complete(carried)
        save(int(state.rounds[-1]["task"]), int(state.rounds[-1]["round"]), finished=False)
    results = build_results(cfg, runtime, state, arrays, elapsed_before + time.perf_counter() - started, evaluate)
    results["privacy"] = privacy_so_far(cfg, strategy, state.rounds)
    if last < len(steps):
        log.info("max-rounds = %d: stopped after round %d of %d; the checkpoint stays (continue with "
                 "`promptfcl resume %s --set max-rounds=0`)", cfg.max_rounds, last, len(steps), cfg.out_dir)
        results["stopped_after_round"] = last
        if cfg.task_generator == "random":  # section 5.1's metrics need the whole run
            results.update({"accuracy_matrix": None, "average_accuracy_per_task": None,
                            "final_average_accuracy": None, "average_incremental_accuracy": None,
                            "average_forgetting": None})
        return results
    if not schedule.synchronous:
        from promptfcl.server.transfer import client_accuracy_by_round

        results["client_accuracy_by_round"] = client_accuracy_by_round(schedule, state.rounds, cfg.num_tasks)
    if cfg.task_generator == "random":  # Powder's benchmark: section 5.1's metrics replace the matrix's
        from promptfcl.server.transfer import asynchronous_results, single_task_accuracies

        single = single_task_accuracies(cfg, schedule) if runtime is not None else None
        results["asynchronous"] = asynchronous_results(cfg, schedule, state.rounds, single)
        results.update({"final_average_accuracy": results["asynchronous"]["final_accuracy"],
                        "average_incremental_accuracy": results["asynchronous"]["average_incremental_accuracy"],
                        "average_forgetting": results["asynchronous"]["forgetting_measure"],
                        "accuracy_matrix": None, "average_accuracy_per_task": None})
    return results


def finish(cfg: ExperimentConfig, results: dict[str, Any]) -> None:
    """After results are written: the checkpoint has served its purpose (unless the run stopped early,
    or ``keep-checkpoint`` keeps it for ``promptfcl audit``)."""
    if results.get("stopped_after_round") is not None or cfg.keep_checkpoint:
        return
    path = Path(cfg.out_dir) / checkpoint.FILENAME
    if path.exists():
        path.unlink()


#: seconds between two pulls for replies; Flower's deployment grid waits 3 s between pulls, so
#: a reply that arrives just after one sits idle for up to 3 s, twice per round (train and
#: evaluation). A pull is one small request to the SuperLink.
PULL_INTERVAL_SECONDS = 0.2


def send_and_receive(grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
    """``Grid.send_and_receive`` with a short wait between pulls (``PULL_INTERVAL_SECONDS``):
    push the messages, then pull until every one has its reply or ``timeout`` seconds pass.
    Replies come back in the order their messages were sent, whatever order they arrived in,
    so that aggregation (a floating-point sum) is the same in every run."""
    ids = list(grid.push_messages(messages))
    pending = set(ids)
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    while pending:
        got = list(grid.pull_messages(pending))
        replies += got
        pending -= {m.metadata.reply_to_message_id for m in got}
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(PULL_INTERVAL_SECONDS)
    order = {message_id: i for i, message_id in enumerate(ids)}
    return sorted(replies, key=lambda m: order.get(m.metadata.reply_to_message_id, len(order)))


def run_round(grid: Grid, strategy: PromptStrategy, evaluate: CentralEvaluator | FederatedEvaluator,
              arrays: ArrayRecord, task: int, round_: int, server_round: int,
              evaluate_now: bool = True, carry: bool = False, carried: CarriedEvaluation | None = None,
              complete_carried: Callable[[CarriedEvaluation], None] | None = None
              ) -> tuple[ArrayRecord, dict[str, Any]]:
    """One training round (retried with fresh clients if too few replies are usable) and, unless
    ``evaluate_now`` is False (``evaluate-every``), its evaluation: now, or with ``carry``, by the
    next round's train messages where they can (the record is then ``eval_pending``).
    ``carried``: the previous round's evaluation, which this round's train messages carry;
    ``complete_carried`` finishes it after training, before this round's own evaluation."""
    cfg = strategy.cfg
    bytes_s2c = bytes_c2s = sampled = 0
    server_seconds = round_seconds = 0.0
    client_secs: list[float] = []
    process_secs: list[float] = []
    device_peaks: list[float] = []  # clients on CUDA: peak memory allocated on the device, MB
    overheads: list[float] = []
    startup_phases: dict[str, list[float]] = {}
    rejected: list[dict[str, Any]] = []
    client_tasks: list[int] = []
    placement: list[dict[str, Any]] = []
    for attempt in range(cfg.round_retries + 1):
        t0 = time.perf_counter()
        config = ConfigRecord({"task": task, "round": round_, "attempt": attempt})
        exchange, waited = list(strategy.configure_exchange(server_round, arrays, config, grid)), 0.0
        if exchange:  # a step before training (Powder's measuring exchange); its bytes are the round's
            tx = time.perf_counter()
            answers = send_and_receive(grid, exchange, cfg.round_timeout)
            waited = time.perf_counter() - tx
            strategy.aggregate_exchange(server_round, answers)
            bytes_s2c += _bytes(exchange)
            bytes_c2s += _bytes([m for m in answers if not m.has_error()])
        messages = list(strategy.configure_train(server_round, arrays, config, grid))
        if carried is not None:
            evaluate.ask(messages, carried)  # type: ignore[union-attr]  (only federated evaluation carries)
        t1 = time.perf_counter()
        replies = send_and_receive(grid, messages, cfg.round_timeout)
        t2 = time.perf_counter()
        if carried is not None:
            evaluate.collect(messages, replies, carried)  # type: ignore[union-attr]
        new_arrays, agg = strategy.aggregate_train(server_round, replies)
        t3 = time.perf_counter()
        ok = [m for m in replies if not m.has_error()]
        bytes_s2c += _bytes(messages)
        bytes_c2s += _bytes(ok)
        sampled += len(messages)
        client_tasks = [int(m.content[CONFIG]["task"]) for m in messages if CONFIG in m.content.config_records]
        placement = [strategy.placement_of(m) for m in messages]  # the (last) attempt's clients
        server_seconds += (t1 - t0 - waited) + (t3 - t2)
        round_seconds += t3 - t0
        # only accepted replies' metrics are read: they have passed the checks of every field
        used = [m.content[METRICS] for m in [a.reply for a in strategy.accepted]] if new_arrays is not None else []
        client_secs += [float(m["train-seconds"]) for m in used]
        # deployment: a message's whole cost on a node (fresh process: imports, data, backbone)
        process_secs += [float(m.get("process-seconds", 0.0)) for m in used]
        # a fresh process (every deployed message; an actor's first in simulation): its time before
        # the first training step, and per phase (common/startup.py)
        fresh = [m for m in used if metric_name("imports") in m and "process-seconds" in m]
        overheads += [float(m["process-seconds"]) - float(m["train-seconds"])
                      - float(m.get("evaluation-seconds", 0.0))  # evaluate-with-train: work, not start-up
                      + float(m.get(metric_name("query_cache"), 0.0))  # read inside training, yet start-up
                      for m in fresh]
        for name in PHASES:
            startup_phases.setdefault(name, []).extend(float(m[metric_name(name)]) for m in fresh
                                                       if metric_name(name) in m)
        device_peaks += [float(m.get("device-peak-mb", 0.0)) for m in used]
        rejected += [{"node": int(n), "reason": r, "attempt": attempt} for n, r in strategy.rejected]
        rejected += [{"node": int(m.metadata.dst_node_id), "reason": "no reply before round-timeout",
                      "attempt": attempt} for m in unanswered(messages, replies)]
        if new_arrays is not None:
            break
        log.warning("round %d attempt %d: too few usable replies (%d of %d)%s", server_round, attempt + 1,
                    len([a.reply for a in strategy.accepted]), len(messages),
                    "; retrying with fresh clients" if attempt < cfg.round_retries else "")
    else:
        raise RoundFailed(
            f"round {server_round} (task {task + 1}, round {round_ + 1}) had fewer than min-replies = "
            f"{cfg.min_replies} usable replies in {cfg.round_retries + 1} attempts; the last checkpoint "
            f"in {cfg.out_dir} is intact. Reasons: {sorted({r['reason'][:120] for r in rejected})[:5]}"
        )
    if carried is not None and complete_carried is not None:
        complete_carried(carried)  # rounds are evaluated in order
    t4 = time.perf_counter()
    # a strategy scoring tasks through their own slices sends evaluate messages other arrays
    pending = evaluate_now and carry and strategy.evaluation_pools(new_arrays, task) is None
    task_acc = evaluate(new_arrays, task) if evaluate_now and not pending else None
    record = {
        "task": task,
        "round": round_,
        "server_round": server_round,
        # None: not evaluated this round (evaluate-every)
        "accuracy": None if task_acc is None else float(np.nanmean(task_acc)),
        "task_accuracies": None if task_acc is None else [float(a) for a in task_acc],
        "bytes_s2c": bytes_s2c,
        "bytes_c2s": bytes_c2s,
        "client_seconds": float(np.mean(client_secs)) if client_secs else 0.0,
        "client_seconds_max": float(np.max(client_secs)) if client_secs else 0.0,
        "client_process_seconds_max": float(np.max(process_secs)) if process_secs else 0.0,
        # deployment: median time a client process spent before training, and per start-up
        # phase over the fresh processes of the round (common/startup.py; empty when warm)
        "client_overhead_seconds": float(np.median(overheads)) if overheads else 0.0,
        "client_startup": {k: float(np.median(v)) for k, v in startup_phases.items() if v},
        "client_device_peak_mb": float(np.max(device_peaks)) if device_peaks else 0.0,
        "server_seconds": server_seconds,
        "round_seconds": round_seconds,
        "eval_seconds": time.perf_counter() - t4,
        "attempts": attempt + 1,
        "clients_sampled": sampled,
        "client_tasks": client_tasks,  # the task each client of the (last) attempt trained
        "placement": placement,  # where each client of the (last) attempt trained
        "clients_aggregated": int(agg["clients"]),
        # accepted replies' update norms (what update-norm-factor compares); their spread shows
        # how far honest clients differ, and so how tight the factor can be
        "update_norms": [float(v) for v in strategy.update_norms],
        "reply_shares": list(strategy.reply_shares),  # each accepted reply's share of the round's weight
        "examples": int(agg["num-examples"]),  # training samples behind the aggregate
        "rejected": rejected,
        "train_loss": float(agg["train-loss"]),
        # anything else the strategy reports (consolidation time, loss terms, ...)
        "strategy_metrics": {k: v for k, v in agg.items() if k not in ("num-examples", "clients", "train-loss")},
        **(evaluate.last_record if evaluate_now and not pending else {}),  # federated: nodes, failures, bytes
    }
    if pending:
        record["eval_pending"] = True  # evaluated with the next round's training (evaluate-with-train)
    return new_arrays, record


def privacy_so_far(cfg: ExperimentConfig, strategy: PromptStrategy, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """results.json's ``privacy`` after ``rounds`` (common/privacy.py): every training attempt
    is one step of the sampled Gaussian mechanism (a retried round's clients uploaded too)."""
    opts = privacy_options(cfg)
    if not opts.enabled:  # called after every round: nothing to count
        return privacy_report(opts, strategy.sample_rate, 0)
    steps = sum(int(r["attempts"]) for r in rounds)
    return privacy_report(opts, strategy.sample_rate, steps, most_uploads(rounds))


def most_uploads(rounds: list[dict[str, Any]]) -> int:
    """Uploads of the client sampled most often: what the server (which knows the sample) sees of
    one client. Rounds record the last attempt's clients; an earlier attempt counts for everyone."""
    from collections import Counter

    counts: Counter[int] = Counter()
    retries = 0
    for record in rounds:
        counts.update({int(p["client"]) for p in record.get("placement", []) if p.get("client") is not None})
        retries += int(record["attempts"]) - 1
    return max(counts.values(), default=0) + retries


def build_results(cfg: ExperimentConfig, runtime: Runtime | None, state: RunState, arrays: ArrayRecord,
                  seconds: float, evaluate: CentralEvaluator | FederatedEvaluator | None = None) -> dict[str, Any]:
    acc = state.accuracy_matrix
    n_params = sum(int(np.prod(arrays[k].shape)) for k in arrays.keys())
    rounds = state.rounds
    total_s2c = sum(r["bytes_s2c"] for r in rounds)
    total_c2s = sum(r["bytes_c2s"] for r in rounds)
    if runtime is not None:
        backbone = runtime.weights_source
        dataset = {
            "name": runtime.data.name,
            "num_classes": runtime.data.num_classes,
            "class_order_names": runtime.data.class_names,
            "train_size": len(runtime.data.train),
            "test_size": len(runtime.data.test),
            "fingerprint": runtime.data.fingerprint,
        }
    else:  # federated evaluation: what the server knows of the nodes' data
        from promptfcl.common.data import class_order

        names = cfg.class_name_list
        backbone = f"{cfg.backbone} with weights {cfg.weights!r}, held by the nodes (not by the server)"
        dataset = {
            "name": "the nodes' own data (federated evaluation)",
            "num_classes": cfg.num_classes,
            "class_order_names": [names[c] for c in class_order(cfg.num_classes, cfg.seed)] if names else None,
            "train_size": None,
            "test_size": getattr(evaluate, "last_total", None),  # held-out samples in the last evaluation
            "fingerprint": None,
        }
    random_tasks = cfg.task_generator == "random"  # no task ends for everyone: no accuracy matrix
    return {
        "config": cfg.to_dict(),
        "config_digest": cfg.digest(),  # what every node's reply echoes (placement): the same run config
        "backbone": backbone,
        "dataset": dataset,
        "accuracy_matrix": [[None if np.isnan(v) else float(v) for v in row] for row in acc],
        **(summary_so_far(acc) if not random_tasks else {}),
        "average_accuracy_per_task": None if random_tasks or np.isnan(acc[0, 0]) else
        [float(v) for v in metrics.average_accuracies(acc, finished_tasks(acc) - 1)],
        "rounds": rounds,
        "communication": {
            "trainable_parameters": n_params,
            "bytes_s2c_total": total_s2c,
            "bytes_c2s_total": total_c2s,
            "bytes_s2c_per_round": total_s2c / max(len(rounds), 1),
            "bytes_c2s_per_round": total_c2s / max(len(rounds), 1),
            "bytes_per_client_exchange": (total_s2c + total_c2s) / max(sum(r["clients_sampled"] for r in rounds), 1) / 2,
        },
        "timing": {
            "total_seconds": seconds,
            "client_seconds_per_round": float(np.mean([r["client_seconds"] for r in rounds])),
            "server_seconds_per_round": float(np.mean([r["server_seconds"] for r in rounds])),
            "round_seconds_mean": float(np.mean([r["round_seconds"] for r in rounds])),
        },
    }


def log_placement(placement: list[dict[str, Any]]) -> None:
    """One line: on which devices and nodes this round's clients trained."""
    from collections import Counter

    devices = Counter(str(p["device"]) for p in placement if p["device"] is not None)
    nodes = {p["node"] for p in placement if p["node"] is not None}
    visible = Counter(repr(p["cuda_visible_devices"]) for p in placement if p["device"] is not None)
    log.info("clients trained on %s, on %d node(s); CUDA_VISIBLE_DEVICES %s",
             ", ".join(f"{d} x{n}" for d, n in devices.items()) or "unknown devices", len(nodes),
             ", ".join(f"{v} x{n}" for v, n in visible.items()) or "unknown")


def finished_tasks(acc: np.ndarray) -> int:
    """How many tasks have their accuracy-matrix column (all of them unless the run stopped early)."""
    return int(sum(not np.isnan(acc[t, t]) for t in range(acc.shape[0])))


def summary_so_far(acc: np.ndarray) -> dict[str, float | None]:
    """A_N, AIA and forgetting over the finished tasks (None before the first task ends)."""
    done = finished_tasks(acc)
    if done == 0:
        return {"final_average_accuracy": None, "average_incremental_accuracy": None, "average_forgetting": None}
    return metrics.summary(acc, upto=done - 1)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
