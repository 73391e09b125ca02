"""Powder's transfer metrics ("Federated Continual Learning via Prompt-based Dual Knowledge
Transfer", Powder, section 5.1) for runs with random tasks.

Forward and combined transfer compare each task's accuracy in the federated run with
"single task training": the same model trained on that task alone. The reference here is
FedAvg-Prompt's client (CODA-P, cross-entropy over the task's classes) on the task's data,
on the task's client, for as many rounds as the task lasted in the run, starting from the
initial parameters with only the task's own prompt slice (every other slice zero, so it
contributes nothing). The slice holds as many components as the method trains for a task
(``PromptStrategy.reference_components``: one task's slice; Powder: its local pool of k
slices), so a method is not credited with transfer that is only a larger prompt. Otherwise it
depends on the data, the schedule and the training settings, and methods with the same
prompt capacity are measured against the same figures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

import numpy as np
from flwr.app import RecordDict

from ..common import metrics
from ..common.config.experiment import RESULT_NEUTRAL_KEYS, ExperimentConfig
from ..common.data.schedule import RandomTaskSchedule
from ..common.files import write_atomic
from ..common.model.evaluation import accuracies, correct_counts
from ..common.model.prompted import CodaPrompt, initial_trainable_state
from ..common.model.runtime import get_runtime, model_spec
from ..common.model.weights import cache_dir
from ..common.records import ARRAYS, from_array_record, to_array_record, to_torch
from ..strategies.fedavg.strategy import FedAvgStrategy
from ..strategies.platform.learner import LocalLearner

log = logging.getLogger("promptfcl")

#: part of the reference cache's key: raise it when the reference's training or scoring changes
REFERENCE_VERSION = 1


def single_task_accuracies(cfg: ExperimentConfig, schedule: RandomTaskSchedule,
                           components: int | None = None, tokens: str | None = None) -> np.ndarray:
    """Accuracy (%) of every task trained alone for its duration in the run, with ``components``
    prompt components (default: one task's slice of the run's pool) and, with prompt-tuning and
    ``prompt-tokens = "auto"``, the run's method's token handling ``tokens`` (Powder accumulates:
    its reference must too, not CODA-P's truncation).

    Cached on disk (``<cache>/single-task/``) by everything it depends on (the
    configuration without the method, the data's and the backbone's identity), so the
    methods of one comparison train the reference once.
    """

    started = time.perf_counter()
    if tokens is not None and cfg.model.prompt_tokens == "auto" and cfg.model.prompt_mode == "prompt":
        cfg = cfg.replace(prompt_tokens=tokens)  # the method's own, resolved (and in the cache key)
    if components is not None and components != cfg.model.pool_size // cfg.data.num_tasks:
        cfg = cfg.replace(pool_size=components * cfg.data.num_tasks)  # slices of that size
    rt = get_runtime(cfg, CodaPrompt)
    relevant = {k: v for k, v in cfg.to_dict().items()
                if k not in RESULT_NEUTRAL_KEYS and k != "strategy" and "." not in k}
    key = hashlib.sha1(json.dumps([REFERENCE_VERSION, relevant, rt.data.fingerprint, rt.weights_source], sort_keys=True)
                       .encode()).hexdigest()[:16]
    path = cache_dir() / "single-task" / f"{key}.json"
    try:
        cached = json.loads(path.read_text())
        if len(cached) == cfg.data.num_tasks:
            log.info("single-task reference from %s", path)
            return np.asarray(cached, dtype=np.float64)
    except (OSError, ValueError):
        pass  # absent or unreadable: train it
    learner = LocalLearner.of(cfg, rt)
    initial = to_array_record(initial_trainable_state(model_spec(cfg, rt.data.num_classes), CodaPrompt))
    fresh = FedAvgStrategy.of(cfg, rt.data.num_classes)
    per_task = cfg.model.pool_size // cfg.data.num_tasks
    out = np.full(cfg.data.num_tasks, np.nan)
    for task in range(cfg.data.num_tasks):
        state = from_array_record(fresh.on_task_start(task, initial))
        for name, value in state.items():
            if name.startswith("prompt.") and value.shape[0] == cfg.model.pool_size:
                value[: task * per_task] = 0.0  # earlier slices silent: the task alone
        arrays = to_array_record(state)
        for round_ in range(schedule.finish(task) - schedule.start(task) + 1):
            reply = learner.fit(RecordDict({ARRAYS: arrays}), task, round_, schedule.owner(task))
            arrays = reply.array_records[ARRAYS]
        rt.model.load_trainable_state(to_torch(arrays))
        out[task] = accuracies(*correct_counts(rt, task))[task]
    log.info("single-task reference: %s (%.1f s)", " ".join(f"{a:.0f}" for a in out),
             time.perf_counter() - started)
    text = json.dumps([float(v) for v in out]).encode()
    write_atomic(path, lambda fh: fh.write(text))
    return out


def asynchronous_results(schedule: RandomTaskSchedule, rounds: list[dict[str, Any]],
                         single_task: np.ndarray | None) -> dict[str, Any]:
    """Section 5.1's metrics and the per-task timeline of ``schedule``'s run for results.json."""
    acc = task_accuracy_by_round(rounds, schedule.num_tasks)
    finish = np.array([schedule.finish(g) for g in range(schedule.num_tasks)])
    evaluation_rounds = sorted({r - 1 for r in schedule.switch_rounds} | {schedule.total_rounds - 1})
    out: dict[str, Any] = metrics.asynchronous_summary(acc, finish, evaluation_rounds, single_task)
    out.update({
        "evaluation_rounds": [r + 1 for r in evaluation_rounds],
        "single_task_accuracy": None if single_task is None else [float(v) for v in single_task],
        "tasks": [{"client": schedule.owner(g), "first_round": schedule.start(g) + 1,
                   "last_round": int(finish[g]) + 1} for g in range(schedule.num_tasks)],
    })
    return out


def task_accuracy_by_round(rounds: list[dict[str, Any]], num_tasks: int) -> np.ndarray:
    """(tasks, rounds) accuracies from the round records (NaN where a task was not evaluated)."""
    acc = np.full((num_tasks, len(rounds)), np.nan)
    for r, record in enumerate(rounds):
        values = record["task_accuracies"]
        acc[: len(values), r] = values
    return acc


def client_accuracy_by_round(schedule: Any, rounds: list[dict[str, Any]], num_tasks: int) -> list[list[float | None]]:
    """For every client and round: the mean accuracy over the tasks it has learnt or is learning."""
    acc = task_accuracy_by_round(rounds, num_tasks)
    out = []
    for client in range(schedule.num_clients):
        row = []
        for r in range(len(rounds)):
            values = acc[schedule.client_tasks(client, r), r]
            values = values[~np.isnan(values)]
            row.append(float(values.mean()) if len(values) else None)
        out.append(row)
    return out
