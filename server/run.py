"""The server's run: N tasks x R rounds of Flower message exchange, evaluation and accounting.

Like Flower's ``Strategy.start`` loop, but aware of the task schedule: an :class:`ExperimentRun`
calls the strategy's task hooks, trains each round (:mod:`promptfcl.server.rounds`), evaluates
it when its :class:`EvaluationPlan` says (now, with the next round's training, or not at all),
fills the accuracy matrix, checkpoints after every round and resumes from the last checkpoint.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from ..common import metrics
from ..common.config.experiment import ConfigError, ExperimentConfig
from ..common.data.partitions import client_indices, drawn_shares, partition_summary
from ..common.data.splits import FILE_NAME as SPLITS_FILE
from ..common.data.splits import read_splits, write_splits
from ..common.data.tasks import class_order
from ..common.model.prompted import initial_trainable_state
from ..common.model.runtime import Runtime, get_runtime, model_spec
from ..common.node.memory_plan import return_freed_memory
from ..common.privacy import privacy_options
from ..common.records import array_views, to_array_record
from ..strategies.platform.checks import HeldSamples
from ..strategies.platform.run_memory import check_server_memory
from ..strategies.platform.strategy import PromptStrategy
from ..strategies.registry import build_strategy, strategy_class
from . import checkpoint
from .evaluation import CarriedEvaluation, CentralEvaluator, FederatedEvaluator
from .progress import RunTrackers
from .results import SUMMARY_KEYS, build_results, human_bytes, log_placement, privacy_so_far
from .rounds import RoundRecord, round_record, task_end_exchange, train_round
from .transfer import asynchronous_results, client_accuracy_by_round, single_task_accuracies

log = logging.getLogger("promptfcl")

NOW, CARRIED, SKIP = "now", "with the next round's training", "skip"


@dataclass(frozen=True)
class EvaluationPlan:
    """When each round is evaluated: every ``evaluate-every``-th round, each task's last round and the
    run's last round. With federated evaluation and ``evaluate-with-train``, a round within a task is
    evaluated by the next round's train messages (the nodes sampled for it evaluate the arrays they
    receive before training) instead of evaluate messages of its own, unless the method scores each
    task through its own prompt slices (those arrays are not the ones the train messages carry)."""

    every: int
    carry: bool  # federated evaluation with evaluate-with-train
    last: int  # index of the run's last round (0-based)

    def decide(self, index: int, task_ends: bool, own_slices: bool) -> str:
        """How round ``index`` (0-based) is evaluated; ``own_slices``: the method scores each task
        through its own slices."""
        if not ((index + 1) % self.every == 0 or task_ends or index == self.last):
            return SKIP
        if self.carry and not task_ends and index < self.last and not own_slices:
            return CARRIED
        return NOW


class CarriedAsk:
    """The federated evaluator's part in a round whose train messages carry the previous round's evaluation."""

    def __init__(self, evaluator: FederatedEvaluator, carried: CarriedEvaluation) -> None:
        self.evaluator, self.carried = evaluator, carried

    def ask(self, messages: list[Message]) -> None:
        self.evaluator.ask(messages, self.carried)

    def collect(self, messages: list[Message], replies: list[Message]) -> None:
        self.evaluator.collect(messages, replies, self.carried)


class ExperimentRun:
    """One run of the task stream on a Flower grid: set up (or resumed), then :meth:`run`."""

    def __init__(self, grid: Grid, cfg: ExperimentConfig) -> None:
        self.grid, self.cfg = grid, cfg
        # a round's temporaries (replies inflated chunk by chunk, the aggregate being built) go back to
        # the kernel when freed, instead of staying in the heap as the next round's high-water mark
        return_freed_memory()
        self.started = time.perf_counter()
        self.runtime: Runtime | None = None
        self.evaluator: CentralEvaluator | FederatedEvaluator
        self.strategy, arrays = self._set_up()
        self.arrays: ArrayRecord = arrays
        self.matrix = metrics.empty_matrix(cfg.data.num_tasks)
        self.rounds: list[RoundRecord] = []
        self.server_round, self.elapsed_before = 0, 0.0
        self.carried: CarriedEvaluation | None = None  # a round evaluated with the next one's training
        self.schedule = self.strategy.schedule
        self.steps = self.schedule.steps()  # (nominal task, round within it) of every round
        self.last = min(len(self.steps), cfg.output.max_rounds) if cfg.output.max_rounds else len(self.steps)
        self.plan = EvaluationPlan(cfg.evaluation.evaluate_every, cfg.evaluation.evaluate_with_train
                                   and cfg.evaluation.evaluation == "federated",
                                   self.last - 1)
        self._resume()
        self._write_splits()
        # rounds.jsonl, accuracy_matrix.csv, the optional tracker and the ETA, from here on
        self.trackers = RunTrackers(cfg.output.out_dir, cfg.output.tracker, self.last, done=self.server_round,
                                    config=cfg.to_dict())

    # ------------------------------------------------------------------ setting up
    def _set_up(self) -> tuple[PromptStrategy, ArrayRecord]:
        cfg = self.cfg
        # before any model is built: a run's sizes may multiply into more memory than the machine has
        check_server_memory(cfg)
        method = strategy_class(cfg.run.strategy)
        if cfg.evaluation.evaluation == "federated":
            # Deployment: the server holds neither data nor backbone; nodes evaluate (see deploy/README.md).
            log.info("federated evaluation: %d classes in %d tasks; the nodes hold the data and the backbone",
                     cfg.data.num_classes, cfg.data.num_tasks)
            strategy: PromptStrategy = build_strategy(cfg, cfg.data.num_classes)
            self.evaluator = FederatedEvaluator(self.grid, strategy)
            initial = initial_trainable_state(model_spec(cfg, cfg.data.num_classes), method.prompt_class)
            return strategy, to_array_record(initial)
        runtime = self.runtime = get_runtime(cfg, method.prompt_class)
        log.info("backbone: %s", runtime.weights_source)
        data = runtime.data
        log.info("data: %s, %d classes in %d tasks, %d train / %d test images",
                 data.name, data.num_classes, cfg.data.num_tasks, len(data.train), len(data.test))
        if cfg.data.num_classes and cfg.data.num_classes != data.num_classes:
            raise ConfigError(f"num-classes = {cfg.data.num_classes} but {data.name} has {data.num_classes} classes")
        held = None  # the server knows what each virtual client holds: counts are checked
        if cfg.federation.population == "virtual":
            labels, layout, partition = data.train.labels, runtime.layout, runtime.partition
            log.info("%s", partition_summary(labels, layout, partition))  # refuses what it cannot make
            held = HeldSamples(len(data.train), lambda client, task, round_: len(
                client_indices(labels, layout, partition, client, task, round_)))
        strategy = build_strategy(cfg, data.num_classes, runtime, held)
        self.evaluator = CentralEvaluator(runtime, strategy)
        return strategy, to_array_record(runtime.model.trainable_state())

    def _resume(self) -> None:
        """Continue just after the last checkpointed round (``resume``), or refuse to overwrite one."""
        cfg = self.cfg
        saved = checkpoint.load(cfg.output.out_dir)
        if saved is not None and not cfg.output.resume:
            raise ConfigError(
                f"{cfg.output.out_dir} already holds a checkpoint (task {saved.task + 1}, round {saved.round + 1}); "
                "continue it with resume=true (simulation: `promptfcl resume DIR`; deployment: deploy/submit-run.sh "
                "... --set resume=true) or choose another out-dir")
        self.pending_task_end: int | None = None
        if not cfg.output.resume:
            return
        if saved is None:
            raise ConfigError(f"resume=true but {cfg.output.out_dir} holds no checkpoint")
        checkpoint.check_compatible(saved, cfg.to_dict())
        self.arrays = to_array_record(saved.arrays)
        self.strategy.load_state_dict(saved.strategy_state)
        self.strategy.load_platform_state(getattr(saved, "platform_state", {}))
        self.matrix = saved.accuracy_matrix.copy()
        self.rounds = [RoundRecord.from_dict(r) for r in saved.rounds]
        checkpoint.restore_rng(saved.rng)
        self.server_round, self.elapsed_before = saved.server_round, saved.elapsed_seconds
        if not saved.task_finished:  # stopped between a task's last round and its end step
            self.pending_task_end = self.schedule.task_ending(self.server_round - 1)
        if self.rounds and self.rounds[-1].eval_pending:  # its evaluation rides on the next round
            self.carried = CarriedEvaluation(len(self.rounds) - 1, self.rounds[-1].task, self.arrays)
        log.info("resuming after task %d round %d (server round %d)", saved.task + 1, saved.round + 1,
                 self.server_round)

    def _write_splits(self) -> None:
        """splits.npz beside results.json: the class order and every client's share per task
        (common/data/splits.py), written before the first round so a crashed run has it too."""
        if self.runtime is None:  # the nodes hold the data: each node draws from its own
            return
        data, cfg = self.runtime.data, self.cfg
        if cfg.data.splits:  # exactly what this run reuses
            reused = read_splits(cfg.data.splits)
            data_seed, order, shares = reused.data_seed, reused.class_order, reused.shares
        else:
            data_seed, order = cfg.run.seed, class_order(data.num_classes, cfg.run.seed)
            shares = drawn_shares(data.train.labels, self.runtime.layout, self.runtime.partition)
        write_splits(Path(cfg.output.out_dir) / SPLITS_FILE, data_seed, order, data.train.labels, shares, cfg.to_dict())

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        """Every remaining round; the results dictionary (see server/report.py)."""
        try:
            results = self._run()
            self.trackers.finish(results)
            return results
        finally:
            self.trackers.close()

    def _run(self) -> dict[str, Any]:
        self.strategy.summary()
        if self.pending_task_end is not None:
            self.end_task(self.pending_task_end)
        if self.carried is not None and not (self.plan.carry and isinstance(self.evaluator, FederatedEvaluator)):
            self.complete(self.carried)  # resumed with evaluate-with-train off: by evaluate messages
            self.carried = None
        placement_logged = False
        # Rounds follow the schedule's steps: on the stream, task j ends after round (j+1)R, where the
        # accuracy matrix takes column j; with asynchronous arrival each client gets its own task, and
        # a task's slice is initialised in the round its first client reaches it. With random tasks
        # the nominal task is the newest one started, and no task ends for everyone.
        for index in range(self.server_round, self.last):
            record = self.run_round(index)
            if not placement_logged:  # once per process: where the clients actually trained
                log_placement(record.placement)
                placement_logged = True
        if self.carried is not None:  # resumed with max-rounds at the saved round: no next round to carry it
            self.complete(self.carried)
            self.save(self.rounds[-1].task, self.rounds[-1].round, finished=False)
        return self.results()

    def run_round(self, index: int) -> RoundRecord:
        """Round ``index`` (0-based): its task starts, training, evaluation as planned, checkpoint, task end."""
        cfg, strategy = self.cfg, self.strategy
        task, round_ = self.steps[index]
        self.server_round = index + 1
        for new_task in self.schedule.tasks_starting(index):
            self.arrays = strategy.on_task_start(new_task, self.arrays)
        ending = self.schedule.task_ending(index)
        carried = self.carried
        ask = CarriedAsk(self.evaluator, carried) if carried is not None else None  # type: ignore[arg-type]
        outcome, spent, messages = train_round(self.grid, strategy, self.arrays, task, round_, self.server_round, ask,
                                              out_dir=cfg.output.out_dir)
        record = round_record(task, round_, self.server_round, outcome, spent, messages)
        new_arrays = outcome.arrays
        assert new_arrays is not None  # train_round returns an aggregated round or raises RoundFailed
        del outcome, messages  # the round's replies are recorded: freed before evaluation and the checkpoint
        if carried is not None:
            self.complete(carried)  # rounds are evaluated in order
        self.arrays = new_arrays
        how = self.plan.decide(index, ending is not None, strategy.evaluation_pools(new_arrays, task) is not None)
        if how == NOW:
            t = time.perf_counter()
            self.score(record, self.evaluator(new_arrays, task))
            record.eval_seconds = time.perf_counter() - t
            record.evaluation = dict(self.evaluator.last_record)  # federated: nodes, failures, bytes
        record.eval_pending = how == CARRIED
        self.rounds.append(record)
        self.carried = CarriedEvaluation(len(self.rounds) - 1, task, self.arrays) if how == CARRIED else None
        privacy = privacy_so_far(privacy_options(cfg), strategy, self.rounds)
        if privacy["enabled"]:  # the guarantee after every round (None: no noise, no guarantee)
            record.private, record.epsilon = True, privacy["epsilon"]
        self.log_round(record, privacy)
        if not record.eval_pending:  # final now; a carried round is written when its accuracies arrive
            self.trackers.round(record.to_dict())
        self.save(task, round_, finished=False)
        if ending is not None:
            self.end_task(ending)
        return record

    @staticmethod
    def score(record: RoundRecord, task_acc: np.ndarray) -> None:
        record.accuracy = float(np.nanmean(task_acc))
        record.task_accuracies = [float(a) for a in task_acc]

    def complete(self, carried: CarriedEvaluation) -> None:
        """Fill the carried round's record with its accuracies, now that its counts are in."""
        assert isinstance(self.evaluator, FederatedEvaluator)
        t = time.perf_counter()
        task_acc = self.evaluator.complete(carried)
        record = self.rounds[carried.index]
        record.eval_pending = False
        self.score(record, task_acc)
        record.eval_seconds = time.perf_counter() - t
        record.evaluation = dict(self.evaluator.last_record)
        self.trackers.round(record.to_dict())
        log.info("server round %d: acc %5.1f%% (tasks %s), %d of %d nodes evaluated it with their training",
                 record.server_round, record.accuracy, " ".join(f"{a:.0f}" for a in task_acc),
                 record.evaluation["eval_carried"], record.evaluation["eval_nodes"])

    def end_task(self, task: int) -> None:
        """The method's task-end exchange (if it has one) and step, then the task's accuracy-matrix column."""
        if self.strategy.uses_task_end_exchange():
            self.exchange_at_end(task)
        end_arrays = self.strategy.on_task_end(task, self.arrays)
        task_acc = np.array(self.rounds[-1].task_accuracies)
        if end_arrays is not self.arrays:
            self.arrays = end_arrays
            task_acc = self.evaluator(self.arrays, task)
        self.matrix[: task + 1, task] = task_acc
        self.trackers.task_end(task, self.matrix)
        self.save(task, self.cfg.federation.rounds_per_task - 1, finished=True)
        summary = metrics.summary(self.matrix, upto=task)
        bwt = summary["backward_transfer"]
        log.info("after task %d: A_t %.2f, AIA %.2f, forgetting %.2f, BWT %s", task + 1,
                 summary["final_average_accuracy"], summary["average_incremental_accuracy"],
                 summary["average_forgetting"], "-" if bwt is None else f"{bwt:.2f}")

    def exchange_at_end(self, task: int) -> None:
        """The task-end exchange with the clients whose replies the task's rounds accepted (read from the
        rounds' records, so a run resumed between the task's last round and its end asks the same
        ones); its cost is the task's last round's (that round's checkpoint was saved without it)."""
        record = self.rounds[-1]
        clients = sorted({c for r in self.rounds if r.task == task for c in r.reply_clients})
        spent = task_end_exchange(self.grid, self.strategy, self.arrays, task, self.server_round, clients)
        if not spent:
            return
        record.task_end_exchange = spent
        record.bytes_s2c += spent["bytes_s2c"]
        record.bytes_c2s += spent["bytes_c2s"]
        log.info("task %d end exchange: %d of %d clients answered (S2C %s C2S %s, %.2fs)%s", task + 1,
                 spent["answers"], spent["clients"], human_bytes(spent["bytes_s2c"]), human_bytes(spent["bytes_c2s"]),
                 spent["seconds"], f", {len(spent['rejected'])} excluded" if spent["rejected"] else "")

    def save(self, task: int, round_: int, finished: bool) -> None:
        checkpoint.save(checkpoint.Checkpoint(
            config=self.cfg.to_dict(), task=task, round=round_, server_round=self.server_round,
            task_finished=finished, arrays=array_views(self.arrays), strategy_state=self.strategy.state_dict(),
            platform_state=self.strategy.platform_state(), accuracy_matrix=self.matrix.copy(),
            rounds=[r.to_dict() for r in self.rounds], rng=checkpoint.capture_rng(),
            elapsed_seconds=self.elapsed_before + time.perf_counter() - self.started,
        ), self.cfg.output.out_dir)

    def log_round(self, record: RoundRecord, privacy: dict[str, Any]) -> None:
        cfg = self.cfg
        on_tasks = sorted(set(record.client_tasks))
        clients_on = f" (clients on tasks {','.join(str(t + 1) for t in on_tasks)})"
        log.info(
            "%s | %s %s | S2C %s C2S %s | client %.2fs server %.3fs%s%s | %s",
            f"round {record.server_round}/{len(self.steps)}{clients_on}" if cfg.data.task_generator == "random" else
            f"task {record.task + 1}/{cfg.data.num_tasks} round {record.round + 1}/{cfg.federation.rounds_per_task}"
            + ("" if on_tasks == [record.task] else clients_on),
            "acc     -" if record.accuracy is None else f"acc {record.accuracy:5.1f}%",
            "evaluated with the next round" if record.eval_pending else
            "not evaluated" if record.task_accuracies is None else
            "(tasks " + " ".join(f"{a:.0f}" for a in record.task_accuracies) + ")", human_bytes(record.bytes_s2c),
            human_bytes(record.bytes_c2s), record.client_seconds, record.server_seconds,
            f" | {len(record.rejected)} replies excluded" if record.rejected else "",
            "" if not privacy["enabled"] else " | eps so far " + (
                "inf (no noise)" if privacy["epsilon"] is None else f"{privacy['epsilon']:.3g}") + drop_note(
                record.sample_rates, privacy["sample_rate_nominal"]),
            self.trackers.progress(record.server_round, record.accuracy),
        )

    # ------------------------------------------------------------------ results
    def results(self) -> dict[str, Any]:
        cfg, schedule = self.cfg, self.schedule
        rounds = [r.to_dict() for r in self.rounds]
        results = build_results(cfg, self.runtime, self.matrix, rounds, self.arrays,
                                self.elapsed_before + time.perf_counter() - self.started, self.evaluator)
        results["privacy"] = privacy_so_far(privacy_options(cfg), self.strategy, self.rounds)
        stateful = self.strategy.stateful_parameters(self.arrays)
        if stateful is not None:  # what a paper that counts stateful clients' traffic would count
            results["communication"]["stateful_parameters_per_exchange"] = stateful
        if self.last < len(self.steps):
            log.info("max-rounds = %d: stopped after round %d of %d; the checkpoint stays (continue with "
                     "`promptfcl resume %s --set max-rounds=0`)", cfg.output.max_rounds, self.last, len(self.steps),
                     cfg.output.out_dir)
            results["stopped_after_round"] = self.last
            if cfg.data.task_generator == "random":  # section 5.1's metrics need the whole run
                results.update({"accuracy_matrix": None, "average_accuracy_per_task": None,
                                **dict.fromkeys(SUMMARY_KEYS)})
            return results
        if not schedule.synchronous:
            results["client_accuracy_by_round"] = client_accuracy_by_round(schedule, rounds, cfg.data.num_tasks)
        if cfg.data.task_generator == "random":  # Powder's benchmark: section 5.1's metrics replace the matrix's

            single = (single_task_accuracies(cfg, schedule, self.strategy.reference_components(),
                                             self.strategy.prompt_class.prompt_tokens)
                      if self.runtime is not None else None)
            results["asynchronous"] = asynchronous_results(schedule, rounds, single)
            results.update({"final_average_accuracy": results["asynchronous"]["final_accuracy"],
                            "average_incremental_accuracy": results["asynchronous"]["average_incremental_accuracy"],
                            "average_forgetting": results["asynchronous"]["forgetting_measure"],
                            # Powder's BT: GEM's BWT with each task's own last round as its a_{i,i},
                            # averaged over every task (one that ends with the run adds 0)
                            "backward_transfer": results["asynchronous"]["backward_transfer"],
                            "accuracy_matrix": None, "average_accuracy_per_task": None})
        return results


def drop_note(rates: list[float], nominal: float) -> str:
    """The log's note of a round sampled at another rate than the nominal one: with population =
    "nodes" the rate is sampled / connected, so it moves when nodes leave (or more join)."""
    if all(abs(q - nominal) < 1e-12 for q in rates):
        return ""
    return (f" (sampling rate q {'/'.join(f'{q:.3g}' for q in rates)} this round, not the nominal "
            f"{nominal:.3g}: the connected nodes changed; epsilon counts the real one)")


def run_experiment(grid: Grid, cfg: ExperimentConfig) -> dict[str, Any]:
    """Run (or resume) the whole task stream; return the results dictionary (see server/report.py)."""
    return ExperimentRun(grid, cfg).run()


def finish(out_dir: str, keep_checkpoint: bool, results: dict[str, Any]) -> None:
    """After results are written in ``out_dir``: the checkpoint has served its purpose (unless the
    run stopped early, or ``keep_checkpoint`` keeps it for ``promptfcl audit``)."""
    if results.get("stopped_after_round") is not None or keep_checkpoint:
        return
    path = Path(out_dir) / checkpoint.FILENAME
    if path.exists():
        path.unlink()
