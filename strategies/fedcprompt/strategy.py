"""Fed-CPrompt ("Fed-CPrompt: Contrastive Prompt for Rehearsal-Free Federated Continual Learning",
sections 2-3, Appendices C-D): asynchronous prompt learning + C2L.

Clients run CODA-P (decomposed prompts, task slices of the pool). While a client is on
task m it uses the server's slices of every *other known* task frozen -- past ones
(1..m-1) and future ones (m+1..n, learnt by clients that are ahead) -- and trains its
own slice and the head (eq. 2). Its loss is CE + lambda * C2L (eq. 3-4), see
``learner.py``.

The server averages *per task slice*: for every task m trained this round, slice m of
every prompt array (P, K, A of each prompted block) and the head rows of task m's
classes are the sample-weighted average over the clients that trained m; slices and
head rows nobody trained keep the server's values. When all clients are on the same
task (the platform's synchronous schedule) this equals FedAvg on what they trained.
The task a reply trained is the one the server assigned in that client's message
config (the platform's record of what it sent), never what the client claims.

Wire additions: every train message's config carries ``known-tasks`` (the number of
tasks whose slices the server has initialised), so a client knows which future
slices exist.

Early stopping "in each task using a validation set" (Appendix D), ``early-stopping-scope =
"task"``: each reply carries its client's score of the global model it was sent, on its
held-out share (``val-loss``, its mean cross-entropy, or ``val-correct``, with ``val-total``);
combined per task they are the server's validation of that model. After the task's first
``early-stopping-skip`` scores, one without a gain (a lower loss, a higher accuracy) counts
against ``patience``; at ``patience`` the task stops: its slice and head rows are set to the
last model validated (``early-stopping-keep = "last"``, the authors' code, which keeps its last
averaged model) or to its best one (``"best"``), and its clients get no message for the task's
remaining rounds (a round with no client to train keeps the arrays). A round's score is of the
model the round started from (the code scores each averaged model after its round), so the
stopping round's own update is discarded either way. Held-out samples are not trained on and
do not count in a reply's ``num-examples``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from ...common.records import METRICS, as_int, from_array_record, to_array_record
from ..platform.replies import REPLY_METRICS, MetricSpec
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .options import FedCPromptOptions, held_out_count, improves
from .prompt import FedCPromptPrompt
from .records import KNOWN_TASKS

log = logging.getLogger("promptfcl")

#: a reply's score of the received global model on its held-out share (task-level early stopping):
#: its mean cross-entropy or its correct count (``early-stopping-metric``), and the share's size
VALIDATION_METRICS = {"val-loss": MetricSpec(float, required=False, low=0),
                      "val-correct": MetricSpec(int, required=False, low=0),
                      "val-total": MetricSpec(int, required=False, low=0)}


class FedCPromptStrategy(PromptStrategy):
    """Fed-CPrompt's server: FedAvg per task slice (in parallel over the tasks clients are on).

    Parameters
    ----------
    options : FedCPromptOptions, optional
        ``fedcprompt.*`` options (the clients read the loss options).
    """

    opts: FedCPromptOptions
    per_task = "always"  # slice m and task m's head rows over the clients that trained m, whatever the round
    reply_metrics = {**REPLY_METRICS, **VALIDATION_METRICS}

    def setup(self) -> None:
        self.known_tasks = 0  # task slices initialised so far (0..known_tasks-1)
        # task-level early stopping, per task still running: its scores so far, its best score,
        # that model's rows of the task (every task-structured array; keep = "best" only), scores
        # without a gain; and the tasks stopped
        self.scored: dict[int, int] = {}
        self.best_score: dict[int, float] = {}
        self.best_rows: dict[int, dict[str, np.ndarray]] = {}
        self.stale: dict[int, int] = {}
        self.stopped: set[int] = set()
        self.validation: dict[int, float] = {}  # this round's validation score per task (metrics)

    @property
    def task_scope(self) -> bool:
        return self.opts.early_stopping and self.opts.early_stopping_scope == "task"

    # ------------------------------------------------------------------ hooks
    def trained_examples(self, held: int) -> int:
        """A client trains on its share less the held-out validation samples."""
        return held - held_out_count(held, self.opts.validation_fraction) if self.opts.early_stopping else held

    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        self.known_tasks = max(self.known_tasks, task + 1)
        return super().on_task_start(task, arrays)

    def payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict | None:
        """The arrays, and how many task slices exist (a client uses the known future ones frozen);
        None for a client on a task early stopping has stopped."""
        if sent.task >= self.known_tasks:
            raise RuntimeError(f"client {sent.client} assigned task {sent.task}, whose slice was never initialised "
                               f"(known tasks: {self.known_tasks}); call on_task_start first")
        if sent.task in self.stopped:
            return None
        sent.config[KNOWN_TASKS] = self.known_tasks
        return super().payload(sent, arrays)

    @property
    def score_key(self) -> str:
        """The reply metric holding a client's validation score (``early-stopping-metric``)."""
        return "val-loss" if self.opts.early_stopping_metric == "loss" else "val-correct"

    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """A validation score, where sent, is the run's metric with its share's size, with no more
        correct than scored."""
        metrics = reply.content[METRICS]
        has = {k for k in VALIDATION_METRICS if k in metrics}
        if has and has != {self.score_key, "val-total"}:
            return f"validation fields {sorted(has)}: this run's early stopping reads {self.score_key} with val-total"
        if "val-correct" in has and as_int(metrics["val-correct"]) > as_int(metrics["val-total"]):
            return f"val-correct {as_int(metrics['val-correct'])} exceeds val-total {as_int(metrics['val-total'])}"
        return None

    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """Task-level early stopping: each task's validation of the model this round started from."""
        self.validation = {}
        if not self.task_scope or self.round_arrays is None:
            return arrays
        sent = from_array_record(self.round_arrays)
        state: dict[str, np.ndarray] | None = None
        for task in sorted({a.task for a in accepted} - self.stopped):
            score = self._score([a.content[METRICS] for a in accepted if a.task == task])
            if score is None:
                continue  # no scores (differential privacy, or shares too small to hold any out)
            self.validation[task] = score
            self.scored[task] = self.scored.get(task, 0) + 1
            if self.scored[task] <= self.opts.early_stopping_skip:
                continue  # the code never compares its first round's score
            if task not in self.best_score or improves(self.opts.early_stopping_metric, score, self.best_score[task]):
                self.best_score[task], self.stale[task] = score, 0
                if self.opts.early_stopping_keep == "best":
                    self.best_rows[task] = self._rows(sent, task)
                continue
            self.stale[task] = self.stale.get(task, 0) + 1
            if self.stale[task] >= self.opts.patience:
                kept = self.best_rows.pop(task) if self.opts.early_stopping_keep == "best" else self._rows(sent, task)
                state = from_array_record(arrays) if state is None else state
                for name, rows in kept.items():  # this round's update is discarded
                    state[name][self.layout.task_rows(name, state[name], task)] = rows
                self.stopped.add(task)
                log.info("round %d: task %d stopped early (validation %s %.4g, best %.4g, %d scores without a gain); "
                         "its slice and head rows are its %s model's", server_round, task + 1,
                         self.opts.early_stopping_metric, score, self.best_score[task], self.stale[task],
                         self.opts.early_stopping_keep)
        return arrays if state is None else to_array_record(state)

    def _score(self, metrics: list[Any]) -> float | None:
        """One task's validation from its replies' scores: the mean loss over their held-out samples,
        or the share of them classified right (None: no reply scored any)."""
        mine = [m for m in metrics if "val-total" in m and self.score_key in m]
        total = sum(as_int(m["val-total"]) for m in mine)
        if not total:
            return None
        if self.opts.early_stopping_metric == "loss":
            return sum(float(m["val-loss"]) * as_int(m["val-total"]) for m in mine) / total
        return sum(as_int(m["val-correct"]) for m in mine) / total

    def _rows(self, state: dict[str, np.ndarray], task: int) -> dict[str, np.ndarray]:
        """``task``'s rows of every task-structured array (its slice of each prompt array, its head rows)."""
        out = {}
        for name, value in state.items():
            rows = self.layout.task_rows(name, value, task)
            if rows is not None:
                out[name] = np.array(value[rows], copy=True)
        return out

    def on_task_end(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """The task's early-stopping state is no longer needed (a stopped task stays stopped)."""
        for table in (self.scored, self.best_score, self.best_rows, self.stale):
            table.pop(task, None)
        return arrays

    def round_metrics(self, accepted: list[Accepted]) -> dict[str, float]:
        metrics: dict[str, float] = {"tasks-aggregated": len({a.task for a in accepted})}
        if self.task_scope:
            metrics["tasks-stopped"] = len(self.stopped)
            if self.opts.early_stopping_metric == "loss":
                metrics.update({f"val-loss-task{t + 1}": loss for t, loss in self.validation.items()})
            else:
                metrics.update({f"val-acc-task{t + 1}": 100 * acc for t, acc in self.validation.items()})
        return metrics

    def summary(self) -> None:
        super().summary()
        if self.task_scope and self.privacy.enabled:
            log.info("fedcprompt: task-level early stopping needs the clients' validation scores, which "
                     "differential privacy does not release: every task runs all its rounds")

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"known-tasks": int(self.known_tasks), "stopped": sorted(self.stopped),
                                 "scored": {str(t): v for t, v in self.scored.items()},
                                 "best-score": {str(t): v for t, v in self.best_score.items()},
                                 "stale": {str(t): v for t, v in self.stale.items()}}
        for task, rows in self.best_rows.items():
            for name, value in rows.items():
                state[f"best.{task}.{name}"] = value
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.known_tasks = int(state.get("known-tasks", 0))
        self.stopped = {int(t) for t in state.get("stopped", [])}
        self.scored = {int(t): int(v) for t, v in dict(state.get("scored", {})).items()}
        self.best_score = {int(t): float(v) for t, v in dict(state.get("best-score", {})).items()}
        self.stale = {int(t): int(v) for t, v in dict(state.get("stale", {})).items()}
        self.best_rows = {}
        for key, value in state.items():
            if key.startswith("best."):
                _, task, name = key.split(".", 2)
                self.best_rows.setdefault(int(task), {})[name] = np.asarray(value)


__all__ = ["FedCPromptOptions", "FedCPromptPrompt", "FedCPromptStrategy", "KNOWN_TASKS"]
