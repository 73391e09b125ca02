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
(section 5.1's benchmark, common/schedule.py RandomTaskSchedule), or the platform's shared
class-incremental stream. On random tasks each task is scored with its own local pool (the
k slices of P_hat selected for it; ``evaluation = "global"``: the raw pool with CODA-P), and
by default (``head = "auto"``) each task has its own head block, the paper's psi_c^t.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from promptfcl.common.config import ConfigError, ExperimentConfig, MethodOptions
from promptfcl.common.data import task_classes, task_rows
from promptfcl.common.model import CodaPrompt
from promptfcl.common.records import ARRAYS, CONFIG, METRICS, from_array_record, to_array_record
from promptfcl.strategies.platform.strategy import PromptStrategy, aggregate_per_task
from promptfcl.strategies.platform.replies import MetricSpec, check_metrics

#: the metrics record of a reply to the measuring exchange (client/powder.py)
MEASURE_METRICS = {"num-examples": MetricSpec(int, low=0)}

log = logging.getLogger("promptfcl")

#: reply record: measured alphas (empty when the server did not ask)
ALPHA = "powder-alpha"
#: config keys of a train message
LOCAL_TASKS = "powder-tasks"
MEASURE = "powder-measure"
CLASS_CORR = "powder-class-corr"
PREVIOUS = "powder-previous"
OWN_WEIGHTS = "powder-own-weights"
SELECTIONS = ("top-k", "random")
DISTILLATIONS = ("dual", "classic")
MEASURINGS = ("exchange", "in-training")


# ---------------------------------------------------------------------------- options
@dataclass(frozen=True)
class PowderOptions(MethodOptions):
    """Powder's options (run-config keys ``powder.<key>``, kebab-case).

    Defaults are the paper's (Appendix B: lambda 1, p 30; section 5.4: k 3). The ablation
    switches are Table 5's: ``first-step = false`` (w/o FUS), ``selection = "random"`` (w/o
    SEL), ``dual = false`` (w/o DUAL), ``distillation = "classic"`` (DIS: plain KD).
    ``temperature`` and ``row-top`` are the authors' code choices (3 and a few top entries
    per correlation row, renormalised); the paper states neither, so they default off
    (``row-top = 0`` is eq. 3 as printed, with eq. 7's unnormalised rows). ``measuring`` is
    Algorithm 1's separate measuring exchange by default.
    """

    prefix = "powder"

    k: int = 3  # tasks in a client's local pool (eq. 4), its own included
    p: float = 30.0  # sharpening exponent of the correlation (eq. 7)
    lambda_: float = 1.0  # run-config key "lambda": weight of the distillation term (eq. 8)
    first_step: bool = True  # false: no first-step aggregation, P_hat = P_g
    selection: str = "top-k"  # "random": own task + k-1 random known tasks
    dual: bool = True  # false: CE only
    distillation: str = "dual"  # "classic": KD over all current-task classes, no beta
    temperature: float = 1.0  # softening of the distillation (authors' code: 3)
    row_top: int = 0  # > 0: keep that many top entries per G_task row, rows renormalised (authors' code)
    # Random tasks: score each task with its local pool (the k selected slices of P_hat, as its
    # client trains and the paper evaluates), or with the raw global pool P_g ("global").
    evaluation: str = "local"
    # "exchange": Algorithm 1 lines 8-10, a measuring message before training (the whole P_hat
    # out, alphas back), G updated, then the round trains with top-k. "in-training": one message
    # fewer; the alphas are measured at the start of the training round on the whole pool the
    # client then trains with, and G changes only after that round.
    measuring: str = "exchange"

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError("powder." + msg)

        need(self.k >= 1, f"k must be >= 1, got {self.k}")
        need(np.isfinite(self.p) and self.p > 0, f"p must be > 0, got {self.p}")
        need(np.isfinite(self.lambda_) and self.lambda_ >= 0, f"lambda must be >= 0, got {self.lambda_}")
        need(self.selection in SELECTIONS, f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        need(self.distillation in DISTILLATIONS,
             f"distillation must be one of {DISTILLATIONS}, got {self.distillation!r}")
        need(np.isfinite(self.temperature) and self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        need(self.row_top >= 0, f"row-top must be >= 0 (0: dense rows), got {self.row_top}")
        need(self.evaluation in ("local", "global"), f"evaluation must be 'local' or 'global', got {self.evaluation!r}")
        need(self.measuring in MEASURINGS, f"measuring must be one of {MEASURINGS}, got {self.measuring!r}")


# ---------------------------------------------------------------------------- prompting
class PowderPrompt(CodaPrompt):
    """CODA-P prompts restricted to a client's local pool (eq. 4), the first step applied in the
    forward pass.

    ``local_tasks`` (set by the client from the server's message; None = plain CODA-P over
    slices 0..task, as the server's evaluation uses) lists the task slices in use; the client
    loads them with the mixed slices of P_hat it was sent. With ``own_weights`` (set by
    :meth:`begin_round`: ``{s: G_task[s, task]}`` for every local task s) the current task's
    slice holds the raw slice's *change* on top of the P_hat slice it was sent, and that change
    enters every local slice with its eq. 3 weight:

        P_local[s] = P_hat[s] + G_task[s, task] * (x - x0)

    where x is the trained slice and x0 the P_hat slice it started from. That is eq. 3
    applied in the forward pass to the raw slice being trained (Powder, section 4.1 and
    eq. 8: the client learns its own P_c^t; the authors' code mixes the raw pool the same
    way inside the forward pass), computed from the k slices of P_hat the client was sent
    and k weights, so payloads stay eq. 4's. The reply x - x0 is the raw slice's change,
    which the server adds to its raw pool. While training, slices of other tasks are used
    detached; only the current task's slice learns.
    """

    def __init__(self, embed_dim: int, layers: list[int], pool_size: int, length: int, num_tasks: int) -> None:
        super().__init__(embed_dim, layers, pool_size, length, num_tasks)
        self.local_tasks: list[int] | None = None
        self.own_weights: dict[int, float] | None = None
        self._start: dict[str, torch.Tensor] = {}  # x0: the current task's slice at the start of the round

    def begin_round(self, local_tasks: list[int], own_weights: Mapping[int, float] | None) -> None:
        """Use the local pool ``local_tasks`` (already loaded); mix the current slice's change
        into them with ``own_weights`` (None: no mixing, the current slice is used as it is)."""
        self.local_tasks = list(local_tasks)
        self.own_weights = None if own_weights is None else {int(t): float(w) for t, w in own_weights.items()}
        if self.own_weights is not None and set(self.own_weights) != set(self.local_tasks):
            raise ValueError(f"mixing weights for tasks {sorted(self.own_weights)}, local pool {self.local_tasks}")
        own = self.slice_of(self.task)
        self._start = {name: p[own].detach().clone() for name, p in self.named_parameters()}

    def end_round(self) -> None:
        """Back to plain CODA-P (the runtime's model is shared by every round of the process)."""
        self.local_tasks, self.own_weights, self._start = None, None, {}

    def _active(self, kind: str, layer: int, train: bool) -> torch.Tensor:
        if self.local_tasks is None:
            return super()._active(kind, layer, train)
        name = f"{kind}{layer}"
        param = getattr(self, name)
        own = param[self.slice_of(self.task)]
        change = None if self.own_weights is None else own - self._start[name]
        parts = []
        for t in self.local_tasks:
            if change is None:
                part = param[self.slice_of(t)]
                parts.append(part if (not train or t == self.task) else part.detach())
            elif t == self.task:  # eq. 7's diagonal is 1: then the slice is the trained one itself, exactly
                w = self.own_weights[t]
                parts.append(own if w == 1.0 else self._start[name] + w * change)
            else:
                parts.append(param[self.slice_of(t)].detach() + self.own_weights[t] * change)
        return torch.cat(parts, dim=0)

    def pool_rows(self) -> np.ndarray:
        """Pool rows of the local tasks, in the order ``_active`` stacks them."""
        tasks = range(self.task + 1) if self.local_tasks is None else self.local_tasks
        return np.concatenate([np.arange(self.pool_size)[self.slice_of(t)] for t in tasks])


# ---------------------------------------------------------------------------- correlation (eq. 6-7)
def correlation_matrix(alphas: np.ndarray, measured: np.ndarray, p: float) -> np.ndarray:
    """G (n, n): ``max(cos(alpha_i, alpha_j), 0) ** p`` between measured rows, identity elsewhere.

    Parameters
    ----------
    alphas : (n, W) array
        Average prompt-selection weights per task (or class); rows not measured are ignored.
    measured : (n,) bool array
        Which rows hold a measurement.
    p : float
        Sharpening exponent (the paper's 30).
    """
    n = len(alphas)
    g = np.eye(n, dtype=np.float64)
    idx = np.flatnonzero(np.asarray(measured, dtype=bool))
    if len(idx):
        a = np.asarray(alphas, dtype=np.float64)[idx]
        unit = a / np.maximum(np.linalg.norm(a, axis=1), 1e-12)[:, None]
        block = np.clip(unit @ unit.T, 0.0, 1.0) ** p
        np.fill_diagonal(block, 1.0)  # a task is fully correlated with itself (a zero alpha included)
        g[np.ix_(idx, idx)] = block
    return g


def sparsify_rows(g: np.ndarray, top: int) -> np.ndarray:
    """Keep the ``top`` largest entries of each row (ties: lower index first), rows renormalised to 1."""
    if top <= 0:
        return g
    out = np.zeros_like(g)
    for i, row in enumerate(g):
        keep = np.argsort(-row, kind="stable")[:top]
        out[i, keep] = row[keep]
    return out / np.maximum(out.sum(axis=1, keepdims=True), 1e-12)


def first_step_aggregation(state: Mapping[str, np.ndarray], g: np.ndarray, known: int, pool_size: int,
                           num_tasks: int) -> dict[str, np.ndarray]:
    """Eq. 3 on every prompt array: slice n of P_hat = sum_m G[n, m] * slice m of P, m < ``known``.

    Arrays that are not prompt pools (first dimension ``pool_size``) are returned unchanged;
    slices of tasks not yet known are copied as they are.
    """
    per_task = pool_size // num_tasks
    rows = known * per_task
    weights = np.asarray(g, dtype=np.float64)[:known, :known]
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        value = np.asarray(value)
        if not (name.startswith("prompt.") and value.ndim >= 1 and value.shape[0] == pool_size) or known == 0:
            out[name] = value
            continue
        slices = value[:rows].reshape(known, per_task, *value.shape[1:]).astype(np.float64)
        mixed = np.tensordot(weights, slices, axes=(1, 0)).reshape(rows, *value.shape[1:])
        merged = value.copy()
        merged[:rows] = mixed.astype(value.dtype)
        out[name] = merged
    return out


def select_tasks(row: np.ndarray, own: int, known: int, k: int, mode: str = "top-k",
                 rng: np.random.Generator | None = None) -> list[int]:
    """Eq. 4: the ``k`` known tasks most correlated with ``own`` (itself always in), ascending.

    ``mode = "random"`` (the w/o SEL ablation) takes ``own`` and k-1 other known tasks at random.
    Ties are broken towards the lower task index.
    """
    others = [m for m in range(known) if m != own]
    take = min(k, known) - 1
    if mode == "random":
        rng = rng or np.random.default_rng(0)
        chosen = rng.choice(len(others), size=take, replace=False).tolist() if take > 0 else []
        picked = [others[i] for i in chosen]
    else:
        order = sorted(others, key=lambda m: (-float(row[m]), m))
        picked = order[:take]
    return sorted([own] + picked)


# ---------------------------------------------------------------------------- strategy
@dataclass
class _Sent:
    """What the server sent one client this round: what its reply must look like."""

    message: Message
    client: int
    task: int
    local_tasks: list[int]
    expected: ArrayRecord  # the reply's arrays: the task slice of every prompt array, the task's head rows
    measure: tuple[int, ...] = field(default_factory=tuple)  # tasks whose alphas may come back
    start: dict[str, np.ndarray] = field(default_factory=dict)  # the task's P_hat slice of every prompt array


class PowderStrategy(PromptStrategy):
    """Powder's server: correlation-weighted first step, per-client top-k payloads, per-slice merge.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's configuration.
    num_classes : int
        Classes of the whole stream.
    options : dict, optional
        ``powder.*`` options (validated here; the clients read the loss options).
    """

    name = "powder"
    prompt_class = PowderPrompt
    options_class = PowderOptions
    reply_records = frozenset({ARRAYS, METRICS, ALPHA})

    @classmethod
    def privacy_refusal(cls, cfg: ExperimentConfig) -> str:
        """Refused whatever the options: the measuring exchange is a release outside the train reply."""
        return ("its measuring exchange answers, before training, with selection weights computed from the "
                "client's data (a second release per round, outside the train reply), and those weights choose "
                "which prompts it uploads; neither release is bounded nor accounted here")

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

    def __init__(self, cfg: ExperimentConfig, num_classes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(cfg, num_classes, options)
        self.opts = PowderOptions.from_options(self.options)
        self.width = len(cfg.layers) * cfg.pool_size  # alpha: selection weights of every pool row, per layer
        self.known_tasks = 0
        self.task_alpha = np.zeros((cfg.num_tasks, self.width))
        self.task_measured = np.zeros(cfg.num_tasks, dtype=bool)
        self.class_alpha = np.zeros((num_classes, self.width))
        self.class_measured = np.zeros(num_classes, dtype=bool)
        self.new_tasks_pending = False  # a task started since the last aggregation: every client measures
        self.global_arrays: ArrayRecord | None = None  # P_g at the start of this round
        self.aggregated: dict[str, np.ndarray] = {}  # P_hat of this round (sent, never stored back)
        self.mixing = np.eye(cfg.num_tasks)  # the first step's matrix of this round
        self.sent: list[_Sent] = []
        self._payloads: list[tuple | None] = []  # what client_payload made, in message order
        self._exchanging = False  # client_payload is making the measuring exchange's messages
        self.measured_before = 0  # tasks measured in this round's exchange
        self.exchange_rejected: list[tuple[int, str]] = []  # (node, reason) of this round's exchange

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
            return np.eye(self.cfg.num_tasks)
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

    def client_payload(self, client_id: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        """The client's local pool: the top-k tasks' aggregated slices (all of them when it
        measures in the training round); in the measuring exchange, the whole P_hat."""
        task, round_ = int(config["task"]), int(config["round"])
        if not 0 <= task < self.known_tasks:
            raise RuntimeError(f"client {client_id} assigned task {task}, whose slice was never initialised "
                               f"(known tasks: {self.known_tasks}); call on_task_start first")
        if not self.aggregated:
            self.prepare_round(arrays)
        measured = self.to_measure(task, round_)
        previous = measured[1] if len(measured) == 2 else -1
        config[PREVIOUS] = previous
        if self._exchanging:
            return self.measuring_payload(client_id, task, measured, config)
        measure = bool(measured) and self.opts.measuring == "in-training"
        if measure:
            local = list(range(self.known_tasks))  # P_hat whole (Algorithm 1 line 8)
        else:
            rng = np.random.default_rng([self.cfg.seed, int(config.get("server-round", 0)), client_id, 0x50D])
            local = select_tasks(self.task_correlation()[task], task, self.known_tasks, self.opts.k,
                                 self.opts.selection, rng)
        classes = task_classes(self.cfg, task, self.num_classes)
        out, expected, start = {}, {}, {}
        for name, value in self.aggregated.items():
            rows = self._rows(name, value, task)
            if rows is None:  # not task-structured: travels whole
                out[name], expected[name] = value, np.zeros_like(value)
            elif name.startswith("prompt."):  # the local pool's slices
                out[name] = np.concatenate([value[self._rows(name, value, t)] for t in local])
                expected[name] = np.zeros_like(value[rows])
                start[name] = value[rows].copy()
            else:  # the head rows of the client's task
                out[name], expected[name] = value[rows], np.zeros_like(value[rows])
        g_class = self.class_correlation()
        config[LOCAL_TASKS] = [int(t) for t in local]
        # the weight of the client's raw slice in each local slice of P_hat (eq. 3): its change
        # enters them with these in the client's forward pass (PowderPrompt)
        config[OWN_WEIGHTS] = [float(self.mixing[s, task]) for s in local]
        config[MEASURE] = measure
        config[CLASS_CORR] = [float(v) for v in g_class[classes].sum(axis=1)]
        content = RecordDict({ARRAYS: to_array_record(out), CONFIG: config})
        self._payloads.append((client_id, task, local, to_array_record(expected), measured if measure else (), start))
        return content

    def measuring_payload(self, client_id: int, task: int, measured: tuple[int, ...],
                          config: ConfigRecord) -> RecordDict:
        """Algorithm 1 line 8: every known slice of P_hat's prompt arrays, on which the client
        measures the alphas of ``measured``; a client with nothing to measure gets no message."""
        if not measured:
            self._payloads.append(None)
            return RecordDict({CONFIG: config})
        rows = slice(0, self.known_tasks * (self.cfg.pool_size // self.cfg.num_tasks))  # slices 0..known-1
        out = {name: value[rows] for name, value in self.aggregated.items()
               if name.startswith("prompt.") and self._rows(name, value, task) is not None}
        local = list(range(self.known_tasks))
        config[LOCAL_TASKS] = local
        config[MEASURE] = True
        self._payloads.append((client_id, task, local, ArrayRecord(), measured, {}))
        return RecordDict({ARRAYS: to_array_record(out), CONFIG: config})

    def evaluation_pools(self, arrays: ArrayRecord, upto: int) -> tuple[ArrayRecord, dict[int, list[int]]] | None:
        """Random tasks: every task scored with its local pool, the k slices of P_hat selected for it
        (eq. 3-4 on this round's P_g and G_task), as the paper evaluates each client task."""
        if self.cfg.task_generator != "random" or self.opts.evaluation != "local":
            return None
        known = upto + 1
        mixed = first_step_aggregation(from_array_record(arrays), self.mixing_matrix(), known, self.cfg.pool_size,
                                       self.cfg.num_tasks)
        rng = np.random.default_rng([self.cfg.seed, known, 0xE7A1])  # the w/o SEL ablation's random pools
        correlation = self.task_correlation()
        pools = {g: select_tasks(correlation[g], g, known, self.opts.k, self.opts.selection, rng) for g in range(known)}
        return to_array_record(mixed), pools

    def prepare_round(self, arrays: ArrayRecord) -> None:
        """P_g of this round and its first-step aggregation P_hat (eq. 3), for sending only:
        P_g stays the raw slices, and ``merge`` adds the clients' changes to them."""
        self.global_arrays = arrays
        self.mixing = self.mixing_matrix()
        self.aggregated = first_step_aggregation(from_array_record(arrays), self.mixing, self.known_tasks,
                                                 self.cfg.pool_size, self.cfg.num_tasks)

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
    def configure_exchange(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> list[Message]:
        """Before training, every sampled client with something to measure (``to_measure``) gets
        the whole P_hat and replies its alphas, so G_task and G_class are updated before this
        round's top-k payloads are chosen: a new task's first round already trains with its
        measured correlations. None with ``measuring = "in-training"``."""
        self.measured_before, self.exchange_rejected = 0, []
        if self.opts.measuring != "exchange":
            return []
        self.prepare_round(arrays)
        self._payloads, self._exchanging = [], True
        try:  # the base's sampling and node assignment, with client_payload making measuring payloads
            drafts = list(super().configure_train(server_round, arrays, config, grid))
        finally:
            self._exchanging = False
        kept = [(m, made) for m, made in zip(drafts, self._payloads) if made is not None]
        messages = [Message(content=m.content, message_type=MessageType.QUERY, dst_node_id=m.metadata.dst_node_id)
                    for m, _ in kept]
        self.sent = [_Sent(msg, *made) for msg, (_, made) in zip(messages, kept)]
        self.sent_messages, self._sent_by_id = messages, {}  # the exchange's replies are matched to these
        return messages

    def aggregate_exchange(self, server_round: int, replies: list[Message]) -> None:
        """Replace the measured alphas (eq. 6-7); the round's P_hat is then recomputed with them."""
        records = []
        for msg in replies:
            reason = self.check_measurement(msg)
            if reason is None:
                records.append(msg.content[ALPHA])
            else:
                node = msg.metadata.src_node_id
                self.exchange_rejected.append((node, "measuring: " + reason))
                log.warning("measuring reply from node %s excluded: %s", node, reason)
        self.measured_before = self.update_correlation(records)
        if records:
            self.new_tasks_pending = False
        self.aggregated = {}

    def check_measurement(self, msg: Message) -> str | None:
        """Why a reply to the measuring exchange cannot be used (None: it can)."""
        if msg.has_error():
            return f"client error: {msg.error.reason}"
        sent = self.sent_for(msg)
        if sent is None:
            return "cannot tell which message this reply answers (no matching message sent this round)"
        if set(msg.content.keys()) != {ALPHA, METRICS}:
            return f"records {sorted(msg.content.keys())}, expected {sorted({ALPHA, METRICS})}"
        reason = check_metrics(msg.content[METRICS], MEASURE_METRICS)
        if reason is not None:
            return reason
        if msg.content[METRICS]["num-examples"] == 0:
            return "nothing measured (num-examples 0)"
        return self.check_alpha(msg.content[ALPHA], sent)

    # ------------------------------------------------------------------ Flower contract
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Per-client payloads; remembers what each message sent and so what its reply must hold."""
        self.prepare_round(arrays)
        self._payloads = []
        messages = list(super().configure_train(server_round, arrays, config, grid))
        # client_payload ran once per message, in order
        self.sent = [_Sent(m, *made) for m, made in zip(messages, self._payloads)]
        self.sent_arrays = None  # replies are checked against their own message (expected_arrays)
        return messages

    def sent_for(self, msg: Message) -> _Sent | None:
        """The message ``msg`` answers (by message id; without ids, by node if it got one message)."""
        candidates = self.sent_candidates(msg)
        return self.sent[candidates[0]] if len(candidates) == 1 else None

    def check_reply(self, msg: Message) -> str | None:
        """The base's checks against what this client was sent, then the alpha record's."""
        if msg.has_error():
            return super().check_reply(msg)
        sent = self.sent_for(msg)
        if sent is None:
            return "cannot tell which message this reply answers (no matching message sent this round)"
        reason = super().check_reply(msg)
        if reason is None and int(msg.content[METRICS]["num-examples"]) > 0:
            reason = self.check_alpha(msg.content[ALPHA], sent)
        return reason

    def expected_arrays(self, reply: Message) -> ArrayRecord | None:
        """What this client was sent to train: its task's slice and head rows come back."""
        sent = self.sent_for(reply)
        return None if sent is None else sent.expected

    def check_alpha(self, record: ArrayRecord, sent: _Sent) -> str | None:
        """Why an alpha record cannot be used (None: it can)."""
        names = set(record.keys())
        if not sent.measure:
            return None if not names else "alphas sent back although the server did not ask for them"
        need = {"tasks", "task-alpha", "task-count", "classes", "class-alpha", "class-count"}
        if names != need:
            return f"alpha record must hold {sorted(need)}, got {sorted(names)}"
        a = {k: record[k].numpy() for k in need}
        allowed_classes = set()
        for t in sent.measure:
            if t >= 0:
                allowed_classes |= set(task_classes(self.cfg, t, self.num_classes).tolist())
        for kind, ids, allowed in (("task", a["tasks"], set(sent.measure)), ("class", a["classes"], allowed_classes)):
            alpha, count = a[f"{kind}-alpha"], a[f"{kind}-count"]
            if ids.ndim != 1 or alpha.shape != (len(ids), self.width) or count.shape != (len(ids),):
                return f"{kind} alphas of shape {alpha.shape} for {ids.shape} ids (width {self.width} expected)"
            if not set(ids.tolist()) <= allowed or len(set(ids.tolist())) != len(ids):
                return f"{kind} alphas for {sorted(ids.tolist())}, the server asked for {sorted(allowed)}"
            if not np.isfinite(alpha).all() or not (count > 0).all():
                return f"{kind} alphas not finite or counts not positive"
        return None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate, merge the returned task slices into P_g per task, update the correlations."""
        replies = list(replies)
        if self.global_arrays is None:
            raise RuntimeError("aggregate_train before configure_train: no server arrays to start from")
        accepted = self.accept_replies(replies)
        self.rejected = self.exchange_rejected + self.rejected  # the round's record lists both
        by_content = {id(m.content): self.sent_for(m) for m in replies if m.has_content()}
        pairs = [(by_content[id(c)], c) for c in accepted]
        self.aggregated = {}  # the next round recomputes P_hat
        if len(pairs) < self.cfg.min_replies:
            log.warning("round %d: %d usable replies, fewer than min-replies = %d; the global model is unchanged",
                        server_round, len(pairs), self.cfg.min_replies)
            return None, None
        weights = self.reply_weights([c for _, c in pairs])  # capped like every method's
        base = from_array_record(self.global_arrays)
        merged = self.merge(base, [(s.task, self.raw_slices(s, from_array_record(c[ARRAYS]), base), w)
                                   for (s, c), w in zip(pairs, weights)])
        measured_tasks = self.measured_before + self.update_correlation([c[ALPHA] for s, c in pairs if s.measure])
        if any(s.measure for s, _ in pairs):
            self.new_tasks_pending = False
        contents = [c for _, c in pairs]
        arrays = self.consolidate(server_round, to_array_record(merged), contents)
        tasks = {s.task for s, _ in pairs}
        metrics = MetricRecord({
            "num-examples": int(sum(int(c[METRICS]["num-examples"]) for _, c in pairs)),
            "clients": len(pairs),
            "tasks-aggregated": len(tasks),
            "tasks-measured": measured_tasks,
            "local-pool-tasks": float(np.mean([len(s.local_tasks) for s, _ in pairs])),
            "train-loss": float(np.average([float(c[METRICS]["train-loss"]) for c in contents], weights=weights)),
        })
        return arrays, metrics

    def raw_slices(self, sent: _Sent, reply: Mapping[str, np.ndarray],
                   base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
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
        for name, start in sent.start.items():
            rows = self._rows(name, np.asarray(base[name]), sent.task)
            raw = np.asarray(base[name])[rows].astype(np.float64)
            out[name] = (raw + (np.asarray(reply[name], np.float64) - start)).astype(np.asarray(base[name]).dtype)
        return out

    def merge(self, base: Mapping[str, np.ndarray],
              updates: list[tuple[int, Mapping[str, np.ndarray], float]]) -> dict[str, np.ndarray]:
        """P_g with every trained task slice (and its head rows) replaced by the sample-weighted
        average of the clients that trained it; other arrays averaged over every reply.

        Replies carry only their task's rows: placed into a copy of ``base``, they go through
        the shared per-slice FedAvg (``strategies.base.aggregate_per_task``)."""
        full = []
        for task, arrays, weight in updates:
            expanded: dict[str, np.ndarray] = {}
            for name, value in base.items():
                value = np.asarray(value)
                rows = self._rows(name, value, task)
                if rows is None:
                    expanded[name] = np.asarray(arrays[name])
                else:
                    expanded[name] = value.copy()
                    expanded[name][rows] = arrays[name]
            full.append((task, expanded, weight))
        return aggregate_per_task(self.cfg, base, full, self.num_classes)

    def update_correlation(self, records: list[ArrayRecord]) -> int:
        """Replace the alphas of every task and class measured this round (count-weighted over
        the clients that measured them); returns how many tasks were measured."""
        sums: dict[str, dict[int, list]] = {"task": {}, "class": {}}
        for record in records:
            if not list(record.keys()):
                continue
            for kind, ids_name in (("task", "tasks"), ("class", "classes")):
                ids = record[ids_name].numpy()
                alpha, count = record[f"{kind}-alpha"].numpy(), record[f"{kind}-count"].numpy()
                for i, a, n in zip(ids.tolist(), alpha, count.tolist()):
                    acc = sums[kind].setdefault(int(i), [np.zeros(self.width), 0.0])
                    acc[0] += float(n) * np.asarray(a, dtype=np.float64)
                    acc[1] += float(n)
        for i, (s, n) in sums["task"].items():
            self.task_alpha[i], self.task_measured[i] = s / n, True
        for i, (s, n) in sums["class"].items():
            self.class_alpha[i], self.class_measured[i] = s / n, True
        return len(sums["task"])

    # ------------------------------------------------------------------ helpers
    def _rows(self, name: str, value: np.ndarray, task: int) -> slice | np.ndarray | None:
        """``task``'s rows of array ``name`` (its pool slice, or its classes' head rows); None: neither."""
        return task_rows(self.cfg, name, value, task, self.num_classes)


__all__ = ["ALPHA", "CLASS_CORR", "LOCAL_TASKS", "MEASURE", "PREVIOUS", "PowderOptions", "PowderPrompt", "PowderStrategy",
           "correlation_matrix", "first_step_aggregation", "select_tasks", "sparsify_rows"]
