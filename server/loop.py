"""The server's run: N tasks x R rounds of Flower message exchange, evaluation and accounting.

Like Flower's ``Strategy.start`` loop, but aware of the task schedule: it calls the
strategy's task hooks, evaluates after every round, fills the accuracy matrix,
and measures bytes (from the records actually sent) and time per round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from common import metrics
from common.config import ExperimentConfig
from common.evaluation import accuracies, correct_counts
from common.records import METRICS, payload_bytes, to_array_record, to_torch
from common.runtime import Runtime, get_runtime
from strategies import strategy_class
from strategies.base import PromptStrategy

log = logging.getLogger("promptfcl")


@dataclass
class RunState:
    """Everything the run has produced so far."""

    accuracy_matrix: np.ndarray
    rounds: list[dict[str, Any]] = field(default_factory=list)


class CentralEvaluator:
    """Evaluates global parameters on the server's test data (simulation's usual setting)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime

    def __call__(self, arrays: ArrayRecord, task: int) -> np.ndarray:
        self.rt.model.load_trainable_state(to_torch(arrays))
        correct, total = correct_counts(self.rt, task)
        return accuracies(correct, total)


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


def run_experiment(grid: Grid, cfg: ExperimentConfig) -> dict[str, Any]:
    """Run the whole task stream; return the results dictionary (see server.report)."""
    started = time.perf_counter()
    method = strategy_class(cfg.strategy)
    runtime = get_runtime(cfg, method.prompt_class)
    log.info("backbone: %s", runtime.weights_source)
    data = runtime.data
    log.info("data: %s, %d classes in %d tasks, %d train / %d test images",
             data.name, data.num_classes, cfg.num_tasks, len(data.train), len(data.test))
    strategy: PromptStrategy = method(cfg, data.num_classes, cfg.method_options(cfg.strategy))
    strategy.summary()
    evaluate = CentralEvaluator(runtime)
    arrays = to_array_record(runtime.model.trainable_state())
    state = RunState(metrics.empty_matrix(cfg.num_tasks))

    server_round = 0
    for task in range(cfg.num_tasks):
        arrays = strategy.on_task_start(task, arrays)
        for round_ in range(cfg.rounds_per_task):
            server_round += 1
            t0 = time.perf_counter()
            messages = list(strategy.configure_train(
                server_round, arrays, ConfigRecord({"task": task, "round": round_}), grid))
            t1 = time.perf_counter()
            replies = list(grid.send_and_receive(messages, timeout=cfg.round_timeout))
            t2 = time.perf_counter()
            new_arrays, agg = strategy.aggregate_train(server_round, replies)
            if new_arrays is not None:
                arrays = new_arrays
            t3 = time.perf_counter()
            task_acc = evaluate(arrays, task)
            t4 = time.perf_counter()

            ok = [m for m in replies if not m.has_error()]
            client_secs = [float(m.content[METRICS]["train-seconds"]) for m in ok if METRICS in m.content.metric_records]
            record = {
                "task": task,
                "round": round_,
                "server_round": server_round,
                "accuracy": float(np.nanmean(task_acc)),
                "task_accuracies": [float(a) for a in task_acc],
                "bytes_s2c": _bytes(messages),
                "bytes_c2s": _bytes(ok),
                "client_seconds": float(np.mean(client_secs)) if client_secs else 0.0,
                "client_seconds_max": float(np.max(client_secs)) if client_secs else 0.0,
                "server_seconds": (t1 - t0) + (t3 - t2),
                "round_seconds": t3 - t0,
                "eval_seconds": t4 - t3,
                "clients_sampled": len(messages),
                "clients_aggregated": int(agg["clients"]) if agg is not None else 0,
                "rejected": [{"node": int(n), "reason": r} for n, r in strategy.rejected],
                "train_loss": float(agg["train-loss"]) if agg is not None else None,
            }
            state.rounds.append(record)
            log.info(
                "task %d/%d round %d/%d | acc %5.1f%% (tasks %s) | S2C %s C2S %s | client %.2fs server %.3fs",
                task + 1, cfg.num_tasks, round_ + 1, cfg.rounds_per_task, record["accuracy"],
                " ".join(f"{a:.0f}" for a in task_acc), _human(record["bytes_s2c"]),
                _human(record["bytes_c2s"]), record["client_seconds"], record["server_seconds"],
            )
        end_arrays = strategy.on_task_end(task, arrays)
        if end_arrays is not arrays:
            arrays = end_arrays
            task_acc = evaluate(arrays, task)
        state.accuracy_matrix[: task + 1, task] = task_acc
        summary = metrics.summary(state.accuracy_matrix, upto=task)
        log.info("after task %d: A_t %.2f, AIA %.2f, forgetting %.2f", task + 1,
                 summary["final_average_accuracy"], summary["average_incremental_accuracy"],
                 summary["average_forgetting"])

    return build_results(cfg, runtime, state, arrays, time.perf_counter() - started)


def build_results(cfg: ExperimentConfig, runtime: Runtime, state: RunState, arrays: ArrayRecord,
                  seconds: float) -> dict[str, Any]:
    acc = state.accuracy_matrix
    n_params = sum(int(np.prod(arrays[k].shape)) for k in arrays.keys())
    rounds = state.rounds
    total_s2c = sum(r["bytes_s2c"] for r in rounds)
    total_c2s = sum(r["bytes_c2s"] for r in rounds)
    return {
        "config": cfg.to_dict(),
        "backbone": runtime.weights_source,
        "dataset": {
            "name": runtime.data.name,
            "num_classes": runtime.data.num_classes,
            "class_order_names": runtime.data.class_names,
            "train_size": len(runtime.data.train),
            "test_size": len(runtime.data.test),
            "fingerprint": runtime.data.fingerprint,
        },
        "accuracy_matrix": [[None if np.isnan(v) else float(v) for v in row] for row in acc],
        **metrics.summary(acc),
        "average_accuracy_per_task": [float(v) for v in metrics.average_accuracies(acc)],
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


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
