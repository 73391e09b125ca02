"""Powder ("Federated Continual Learning via Prompt-based Dual Knowledge Transfer", sections
3-5, Appendices A-B): two-step prompt aggregation driven by task and class correlation,
per-client top-k payloads, dual distillation.

Clients run CODA-style prompts whose pool is split into per-task slices (``CodaPrompt``).
The server keeps

* the global prompt pool P_g (the run's arrays: every task's *raw* slice, and the head);
* the measured average prompt-selection weights alpha of every task (eq. 6) and of every
  class, from which it builds the task correlation matrix G_task and the class correlation
  matrix G_class: ``[G]_nm = max(cos(alpha_n, alpha_m), 0) ** p`` (eq. 7; the clamp keeps an
  even p from turning anti-correlation into correlation). A task or class without a
  measurement has an identity row (correlated with itself only), as eq. 7's initialisation.

Each round:

0. measuring exchange (Algorithm 1, lines 4-10; option ``measuring = "exchange"``): every
   sampled client that must measure gets every known slice of P_hat (below) in a message
   before training and replies the alphas of its current task (and of the task it has just
   finished); G_task and G_class are updated before the round's payloads are chosen. A client
   measures when a task started since the last measurement, when its task has never been
   measured, or in its first round after a switch. (``measuring = "in-training"``: the
   client measures at the start of the training round instead, on the whole pool it then
   trains with, and G changes after the round.)

For a client on task t:

1. first-step aggregation (eq. 3): ``P_hat[n] = sum_m G_task[n, m] P_g[m]`` over the known
   task slices (components P, keys K and attention vectors A alike, the paper's
   P_g in R^{M_g x (2+L) x D}), recomputed from the raw P_g every round;
2. second-step selection (eq. 4): only the slices of the ``k`` tasks most correlated with t
   (t itself included) are sent, with the head rows of t and the weights G_task[s, t] of
   t's raw slice in each sent slice s; the client's local pool is those slices.

The client learns its raw slice P_c^t (eq. 8): its change enters every local slice with its
eq. 3 weight in the forward pass (``PowderPrompt``), as the authors' code mixes the raw pool.
Replies carry the client's own task slice (the P_hat slice it was sent plus its change) and
its head rows, plus the ``powder-alpha`` record (empty when not measuring in training). The
server adds each task's sample-weighted mean change to its raw slice (``raw_slices``), and
averages head rows per task (FedAvg over the clients that trained each task; untouched
slices keep their values). P_hat is never stored back: storing it would apply eq. 3 again
every round.

Wire additions (message config): ``powder-tasks`` (ascending task slices in the payload),
``powder-own-weights`` (G_task[s, t] for each of them), ``powder-measure`` (reply alphas),
``powder-previous`` (the task the client has just finished, also measured; -1: none),
``powder-class-corr`` (for each of the task's classes y, ``sum_i G_class[y, i]``: the dual
distillation's per-sample weight).

Tasks are the paper's per-client tasks of random classes with ``task-generator = random``
(section 5.1's benchmark, common/data/schedule.py RandomTaskSchedule), or the platform's shared
class-incremental stream. On random tasks each task is scored with its own local pool (the
k slices of P_hat selected for it; ``evaluation = "global"``: the raw pool with CODA-P), and
by default (``head = "auto"``) each task has its own head block, the paper's psi_c^t.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from ...common.records import ARRAYS, CONFIG, METRICS, arrays_of, as_int, from_array_record, to_array_record
from ..platform.aggregation import aggregate_per_task
from ..platform.partial import Rows, completed
from ..platform.replies import check_metrics
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .correlation import (
    correlation_matrix,
    first_step_aggregation,
    select_tasks,
    sparsify_rows,
)
from .options import PowderOptions
from .prompt import PowderPrompt
from .records import (
    ALPHA,
    CLASS_CORR,
    LOCAL_TASKS,
    MEASURE,
    MEASURE_METRICS,
    OWN_WEIGHTS,
    PREVIOUS,
)

log = logging.getLogger("promptfcl")


@dataclass
class PowderSent:
    """What the server chose for one client (``Sent.data``)."""

    local_tasks: list[int]  # the task slices of its local pool
    measure: tuple[int, ...] = field(default_factory=tuple)  # tasks whose alphas may come back
    start: dict[str, np.ndarray] = field(default_factory=dict)  # the task's P_hat slice of every prompt array


class PowderStrategy(PromptStrategy):
    """Powder's server: correlation-weighted first step, per-client top-k payloads, per-slice merge.

    Parameters
    ----------
    options : PowderOptions, optional
        ``powder.*`` options (the clients read the loss options).
    """

    opts: PowderOptions
    reply_records = frozenset({ARRAYS, METRICS, ALPHA})

    def audit_notes(self) -> dict[str, Any]:
        """What the server's correlation weights show (the privacy audit's report)."""
        return {"powder": {
            "measured_tasks": np.flatnonzero(self.task_measured).tolist(),
            "measured_classes": np.flatnonzero(self.class_measured).tolist(),
            "note": ("Powder's server keeps task and class attention weights averaged (weighted by sample count) "
                     "over the clients that measured them: they show which tasks and classes are present in the "
                     "federation and how they correlate, not which client holds them, and carry no image "
                     "features; the feature-level audit is the head inversion"),
        }}

    def setup(self) -> None:
        num_classes = self.num_classes
        # alpha: selection weights of every pool row, per layer
        self.width = len(self.model.layers) * self.model.pool_size
        self.known_tasks = 0
        self.task_alpha = np.zeros((self.data.num_tasks, self.width))
        self.task_measured = np.zeros(self.data.num_tasks, dtype=bool)
        self.class_alpha = np.zeros((num_classes, self.width))
        self.class_measured = np.zeros(num_classes, dtype=bool)
        self.new_tasks_pending = False  # a task started since the last aggregation: every client measures
        self.global_arrays: ArrayRecord | None = None  # P_g at the start of this round
        self.aggregated: dict[str, np.ndarray] = {}  # P_hat of this round (sent, never stored back)
        self.mixing = np.eye(self.data.num_tasks)  # the first step's matrix of this round
        self.measured_before = 0  # tasks measured in this round's exchange
        self.measured_in_training = 0  # tasks measured by this round's train replies

    def reference_components(self) -> int:
        """The single-task reference trains as many components as a client's local pool (k slices),
        or one task's slice (``reference = "task-slice"``)."""
        per_task = self.layout.components_per_task
        return per_task * (min(self.opts.k, self.data.num_tasks) if self.opts.reference == "local-pool" else 1)

    def summary(self) -> None:
        super().summary()
        log.info("powder: %s", self.opts.to_dict())

    # ------------------------------------------------------------------ correlation
    def task_correlation(self) -> np.ndarray:
        """G_task (num_tasks x num_tasks) from the measured task alphas (identity rows elsewhere)."""
        return correlation_matrix(self.task_alpha, self.task_measured, self.opts.p)

    def class_correlation(self) -> np.ndarray:
        """G_class (num_classes x num_classes), built like G_task from the class alphas."""
        return correlation_matrix(self.class_alpha, self.class_measured, self.opts.p)

    def mixing_matrix(self) -> np.ndarray:
        """The matrix of the first step: G_task (optionally sparsified), or identity (w/o FUS)."""
        if not self.opts.first_step:
            return np.eye(self.data.num_tasks)
        g = self.task_correlation()
        if self.opts.row_top > 0:  # sparsify among the known tasks only
            k = self.known_tasks
            g = g.copy()
            g[:k, :k] = sparsify_rows(g[:k, :k], self.opts.row_top)
        return g

    # ------------------------------------------------------------------ hooks
    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        self.known_tasks = max(self.known_tasks, task + 1)
        self.new_tasks_pending = True  # Algorithm 1 line 4: new tasks, every current task is re-measured
        return super().on_task_start(task, arrays)

    def to_measure(self, task: int, round_: int) -> tuple[int, ...]:
        """The tasks whose alphas a client on ``task`` (round ``round_`` of it) measures: its task,
        when a task started since the last measurement or its task was never measured, and
        with it the task it has just finished, in its first round on a new one (Algorithm 1,
        lines 4-9). Empty: nothing to measure."""
        previous = self.schedule.previous_task(task) if round_ == 0 else -1
        if previous >= 0:
            return task, previous
        return (task,) if self.new_tasks_pending or not self.task_measured[task] else ()

    def round_start(self, server_round: int, task: int, round_: int, arrays: ArrayRecord) -> None:
        """P_g of this round and its first step (eq. 3), with the correlations measured so far."""
        self.prepare_round(arrays)

    def payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict:
        """The client's local pool: the top-k tasks' aggregated slices (all of them when it
        measures in the training round); its reply holds its own task's slice and head rows."""
        task = self._check_known(sent)
        measured = self.to_measure(task, sent.round)
        sent.config[PREVIOUS] = measured[1] if len(measured) == 2 else -1
        measure = bool(measured) and self.opts.measuring == "in-training"
        if measure:
            local = list(range(self.known_tasks))  # P_hat whole (Algorithm 1 line 8)
        else:
            rng = np.random.default_rng([self.run.seed, as_int(sent.config.get("server-round", 0)), sent.client, 0x50D])
            local = select_tasks(self.task_correlation()[task], task, self.known_tasks, self.opts.k,
                                 self.opts.selection, rng)
        classes = self.layout.classes(task)
        out, expected, start, origin = {}, {}, {}, {}
        for name, value in self.aggregated.items():
            rows = self._rows(name, value, task)
            if rows is None:  # not task-structured: travels whole
                out[name], expected[name], origin[name] = value, np.zeros_like(value), value
            elif name.startswith("prompt."):  # the local pool's slices
                out[name] = np.concatenate([value[self._rows(name, value, t)] for t in local])
                expected[name] = np.zeros_like(value[rows])
                start[name] = origin[name] = value[rows].copy()
            else:  # the head rows of the client's task
                out[name], expected[name], origin[name] = value[rows], np.zeros_like(value[rows]), value[rows]
        g_class = self.class_correlation()
        sent.config[LOCAL_TASKS] = [int(t) for t in local]
        # the weight of the client's raw slice in each local slice of P_hat (eq. 3): its change
        # enters them with these in the client's forward pass (PowderPrompt)
        sent.config[OWN_WEIGHTS] = [float(self.mixing[s, task]) for s in local]
        sent.config[MEASURE] = measure
        sent.config[CLASS_CORR] = [float(v) for v in g_class[classes].sum(axis=1)]
        # what the reply holds: the task's slice and head rows (shapes only) ...
        sent.expected = to_array_record(expected)
        # ... and what its update is measured from, for the norm filter and update-clip: the raw
        # slice its change is added to (raw_slices) and the head rows and whole arrays it was sent
        # (measured from zeros, as before, the norm was of the values: a reversed x10 update
        # read only 3.5 times an honest one and passed the filter)
        sent.start = origin
        sent.data = PowderSent(local, measured if measure else (), start)
        return RecordDict({ARRAYS: to_array_record(out), CONFIG: sent.config})

    def uses_exchange(self) -> bool:
        return self.opts.measuring == "exchange"

    def exchange_payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict | None:
        """Algorithm 1 line 8: every known slice of P_hat's prompt arrays, on which the client
        measures the alphas of its task (and of the one it has just finished); a client with
        nothing to measure gets no message."""
        task = self._check_known(sent)
        measured = self.to_measure(task, sent.round)
        sent.config[PREVIOUS] = measured[1] if len(measured) == 2 else -1
        if not measured:
            return None
        rows = slice(0, self.known_tasks * self.layout.components_per_task)  # slices 0..known-1
        out = {name: value[rows] for name, value in self.aggregated.items()
               if name.startswith("prompt.") and self._rows(name, value, task) is not None}
        local = list(range(self.known_tasks))
        sent.config[LOCAL_TASKS] = local
        sent.config[MEASURE] = True
        sent.data = PowderSent(local, measured, {})
        return RecordDict({ARRAYS: to_array_record(out), CONFIG: sent.config})

    def _check_known(self, sent: Sent) -> int:
        if not 0 <= sent.task < self.known_tasks:
            raise RuntimeError(f"client {sent.client} assigned task {sent.task}, whose slice was never initialised "
                               f"(known tasks: {self.known_tasks}); call on_task_start first")
        return sent.task

    def evaluation_pools(self, arrays: ArrayRecord, upto: int) -> tuple[ArrayRecord, dict[int, list[int]]] | None:
        """Random tasks: every task scored with its local pool, the k slices of P_hat selected for it
        (eq. 3-4 on this round's P_g and G_task), as the paper evaluates each client task."""
        if self.data.task_generator != "random" or self.opts.evaluation != "local":
            return None
        known = upto + 1
        mixed = first_step_aggregation(from_array_record(arrays), self.mixing_matrix(), known, self.model.pool_size,
                                       self.data.num_tasks)
        rng = np.random.default_rng([self.run.seed, known, 0xE7A1])  # the w/o SEL ablation's random pools
        correlation = self.task_correlation()
        pools = {g: select_tasks(correlation[g], g, known, self.opts.k, self.opts.selection, rng) for g in range(known)}
        return to_array_record(mixed), pools

    def prepare_round(self, arrays: ArrayRecord) -> None:
        """P_g of this round and its first-step aggregation P_hat (eq. 3), for sending only:
        P_g stays the raw slices, and ``merge`` adds the clients' changes to them."""
        self.global_arrays = arrays
        self.mixing = self.mixing_matrix()
        self.aggregated = first_step_aggregation(from_array_record(arrays), self.mixing, self.known_tasks,
                                                 self.model.pool_size, self.data.num_tasks)

    def state_dict(self) -> dict[str, Any]:
        return {
            "known-tasks": int(self.known_tasks),
            "task-alpha": self.task_alpha.copy(),
            "task-measured": self.task_measured.copy(),
            "class-alpha": self.class_alpha.copy(),
            "class-measured": self.class_measured.copy(),
            "new-tasks-pending": bool(self.new_tasks_pending),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.known_tasks = int(state.get("known-tasks", 0))
        if "task-alpha" in state:
            self.task_alpha = np.array(state["task-alpha"], dtype=np.float64)
            self.task_measured = np.array(state["task-measured"], dtype=bool)
            self.class_alpha = np.array(state["class-alpha"], dtype=np.float64)
            self.class_measured = np.array(state["class-measured"], dtype=bool)
        self.new_tasks_pending = bool(state.get("new-tasks-pending", False))

    # ------------------------------------------------------------------ measuring exchange (Algorithm 1, 8-10)
    def check_exchange(self, reply: Message, sent: Sent) -> str | None:
        """Why an answer to the measuring exchange cannot be used (None: it can)."""
        if set(reply.content.keys()) != {ALPHA, METRICS}:
            return f"records {sorted(reply.content.keys())}, expected {sorted({ALPHA, METRICS})}"
        reason = check_metrics(reply.content[METRICS], MEASURE_METRICS)
        if reason is not None:
            return reason
        if reply.content[METRICS]["num-examples"] == 0:
            return "nothing measured (num-examples 0)"
        return self.check_alpha(arrays_of(reply.content, ALPHA), sent)

    def use_exchange(self, server_round: int, answers: list[Accepted]) -> None:
        """Replace the measured alphas (eq. 6-7); the round's P_hat is then recomputed with them."""
        records = [arrays_of(a.content, ALPHA) for a in answers]
        self.measured_before = self.update_correlation(records)
        if records:
            self.new_tasks_pending = False

    # ------------------------------------------------------------------ replies and aggregation
    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """The alpha record: empty unless the server asked this client to measure."""
        return self.check_alpha(arrays_of(reply.content, ALPHA), sent)

    def check_alpha(self, record: ArrayRecord, sent: Sent) -> str | None:
        """Why an alpha record cannot be used (None: it can)."""
        names = set(record.keys())
        if not sent.data.measure:
            return None if not names else "alphas sent back although the server did not ask for them"
        need = {"tasks", "task-alpha", "task-count", "classes", "class-alpha", "class-count"}
        if names != need:
            return f"alpha record must hold {sorted(need)}, got {sorted(names)}"
        a = {k: record[k].numpy() for k in need}
        allowed_classes = set()
        for t in sent.data.measure:
            if t >= 0:
                allowed_classes |= set(self.layout.classes(t).tolist())
        for kind, ids, allowed in (("task", a["tasks"], set(sent.data.measure)),
                                   ("class", a["classes"], allowed_classes)):
            alpha, count = a[f"{kind}-alpha"], a[f"{kind}-count"]
            if ids.ndim != 1 or alpha.shape != (len(ids), self.width) or count.shape != (len(ids),):
                return f"{kind} alphas of shape {alpha.shape} for {ids.shape} ids (width {self.width} expected)"
            if not set(ids.tolist()) <= allowed or len(set(ids.tolist())) != len(ids):
                return f"{kind} alphas for {sorted(ids.tolist())}, the server asked for {sorted(allowed)}"
            if not np.isfinite(alpha).all() or not (count > 0).all():
                return f"{kind} alphas not finite or counts not positive"
        return None

    def aggregate(self, accepted: list[Accepted]) -> ArrayRecord:
        """Merge the returned task slices into P_g per task (as raw slices, ``raw_slices``), then
        update the correlations from the alphas measured in training."""
        assert self.global_arrays is not None  # kept by configure_train, before any reply
        base = from_array_record(self.global_arrays)
        merged = self.merge(
            base,
            [(a.task, self.raw_slices(a.sent, from_array_record(arrays_of(a.content)), base), a.weight)
             for a in accepted],
        )
        measuring = [arrays_of(a.content, ALPHA) for a in accepted if a.sent.data.measure]
        self.measured_in_training = self.update_correlation(measuring)
        if measuring:
            self.new_tasks_pending = False
        return to_array_record(merged)

    def round_metrics(self, accepted: list[Accepted]) -> dict[str, float]:
        measured, self.measured_before = self.measured_before + self.measured_in_training, 0
        return {
            "tasks-aggregated": len({a.task for a in accepted}),
            "tasks-measured": measured,
            "local-pool-tasks": float(np.mean([len(a.sent.data.local_tasks) for a in accepted])),
        }

    def raw_slices(
        self, sent: Sent, reply: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """A reply's prompt slices as raw slices: P_g[t] + (trained slice - the P_hat slice sent).

        P_g holds the raw per-task slices; eq. 3's mixed slices are only sent. Storing a
        trained P_hat slice back as the raw slice would apply eq. 3 again every round (the
        pool grows without bound with eq. 3's unnormalised rows, and the slices of correlated
        tasks trained together become identical with normalised rows). The client's change is
        a change of its raw slice (its forward pass mixes it in with eq. 3's weights,
        PowderPrompt), so it is added to the raw slice; a client that returns what it was
        sent leaves P_g as it was. Head rows are not mixed and pass through unchanged.
        """
        out = dict(reply)
        for name, start in sent.data.start.items():
            rows = self._rows(name, np.asarray(base[name]), sent.task)
            raw = np.asarray(base[name])[rows].astype(np.float64)
            out[name] = (raw + (np.asarray(reply[name], np.float64) - start)).astype(np.asarray(base[name]).dtype)
        return out

    def merge(
        self, base: Mapping[str, np.ndarray], updates: Sequence[tuple[int, Mapping[str, np.ndarray], float]]
    ) -> dict[str, np.ndarray]:
        """P_g with every trained task slice (and its head rows) replaced by the sample-weighted
        average of the clients that trained it; other arrays averaged over every reply.

        Replies carry only their task's rows: placed into a copy of ``base``, they go through
        the shared per-slice FedAvg (``platform.aggregation.aggregate_per_task``)."""
        full = [(task, completed(arrays, base, self._rows_of(task)), weight)
                for task, arrays, weight in updates]
        return aggregate_per_task(self.layout, base, full, self.policies.combiner)

    def update_correlation(self, records: list[ArrayRecord]) -> int:
        """Replace the alphas of every task and class measured this round (count-weighted over
        the clients that measured them); returns how many tasks were measured."""
        found: dict[str, dict[int, list[tuple[np.ndarray, float]]]] = {"task": {}, "class": {}}
        for record in records:
            if not list(record.keys()):
                continue
            for kind, ids_name in (("task", "tasks"), ("class", "classes")):
                ids = record[ids_name].numpy()
                alpha, count = record[f"{kind}-alpha"].numpy(), record[f"{kind}-count"].numpy()
                for i, a, n in zip(ids.tolist(), alpha, count.tolist()):
                    found[kind].setdefault(int(i), []).append((np.asarray(a, dtype=np.float64), float(n)))
        for kind, table, measured in (("task", self.task_alpha, self.task_measured),
                                      ("class", self.class_alpha, self.class_measured)):
            for i, rows in found[kind].items():
                table[i] = count_weighted_mean([a for a, _ in rows], [n for _, n in rows])
                measured[i] = True
        return len(found["task"])

    # ------------------------------------------------------------------ helpers
    def _rows(self, name: str, value: np.ndarray, task: int) -> slice | np.ndarray | None:
        """``task``'s rows of array ``name`` (its pool slice, or its classes' head rows); None: neither."""
        return self.layout.task_rows(name, value, task)

    def _rows_of(self, task: int) -> Rows:
        """``task``'s rows of each array (:meth:`_rows`), as the partial arrays of its reply hold them."""
        return lambda name, value: self._rows(name, value, task)


__all__ = [
    "ALPHA",
    "CLASS_CORR",
    "LOCAL_TASKS",
    "MEASURE",
    "PREVIOUS",
    "PowderOptions",
    "PowderPrompt",
    "PowderStrategy",
    "correlation_matrix",
    "first_step_aggregation",
    "select_tasks",
    "sparsify_rows",
]


def count_weighted_mean(vectors: list[np.ndarray], counts: list[float]) -> np.ndarray:
    """Sum_i n_i a_i / Sum_i n_i, accumulated in order in float64 (the mean of the vectors without counts)."""
    total, n = np.zeros(np.shape(vectors[0])), 0.0
    for value, weight in zip(vectors, counts):
        total += weight * np.asarray(value, dtype=np.float64)
        n += weight
    return total / n if n > 0 else np.mean(np.asarray(vectors, dtype=np.float64), axis=0)
