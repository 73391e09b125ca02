"""FPPL on the server: global prototypes, prototype pool and classifier debiasing.

Per round (Algorithm 1 of FPPL, lines 8-12):

1. sample-size-weighted FedAvg of task prompts, fusion layer and head (the base class);
2. classifier debiasing: the head is trained with cross-entropy on the prototype pool
   C_g plus this round's local prototypes for E_server epochs (eq. 4);
3. global prototypes G^y = mean of the local prototypes of class y over the clients
   holding y (eq. 5); sent to every client of the next round for L_ur.

When a client leaves a task, the pool grows by its local prototypes of that task (line 14);
with synchronous arrival every client leaves at the task's end. Under asynchronous arrival
clients on different tasks train in the same round: each client's prototypes are kept per
(client, task), G^y averages over every client that holds y so far (those that have left the
task included), G covers the classes of every task some client is on next round, and the
head is debiased on every class with prototypes.
This module also holds what both sides share: the options, the prompt module (one prompt
per task, fused by a cosine-linear layer) and the record names; the client side (its loss,
local prototypes) is in :mod:`client.fppl`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from torch import nn

from promptfcl.common.config import ConfigError, ExperimentConfig, MethodOptions
from promptfcl.common.data import task_classes
from promptfcl.common.model import CodaPrompt
from promptfcl.common.privacy import PrivateRecord
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.platform.strategy import PromptStrategy, method_records

log = logging.getLogger("promptfcl")

#: client -> server: this client's per-class mean features ("classes", "means", "counts")
LOCAL_PROTOTYPES = "prototypes"
#: server -> client: global prototypes of the current task's classes ("classes", "means")
GLOBAL_PROTOTYPES = "global-prototypes"

FUSION_SCALES = ("fixed", "learnable")


# ---------------------------------------------------------------------------- options
@dataclass(frozen=True)
class FPPLOptions(MethodOptions):
    """FPPL's ``fppl.*`` run-config options (kebab-case keys, e.g. ``fppl.server-epochs``).

    Defaults follow the paper; where it is silent, the authors' code
    (the authors' code).

    Attributes
    ----------
    temperature : float
        tau of the unified-representation InfoNCE (paper: 0.2).
    ur_weight : float
        Weight of L_ur in the client loss (paper: 1, eq. 8; the code's ``lamda``).
    unified_loss : bool
        Ablation "w/o unified representation loss" when False: no L_ur, and no global
        prototypes are sent.
    fusion : bool
        Ablation "w/o fusion" when False: each sample uses only the task prompt with the
        largest ``g_psi(q)`` (argmax, as in the authors' ``wo_fusion``) instead of the
        softmax-weighted sum.
    debias : bool
        Ablation "w/o debias" when False: the server does not retrain the head.
    pool : bool
        FPPL-WOP when False: no prototype pool; debiasing uses only the current
        local prototypes.
    server_epochs : int
        E_server, epochs of classifier debiasing per round (paper: 5).
    server_lr : float
        Adam learning rate of debiasing (paper silent; authors' code: 1e-3).
    server_batch_size : int
        Batch size of debiasing (paper silent; authors' code: 128, the training batch).
    fusion_scale : str
        "fixed": ``g_psi`` is the plain cosine of eq. 2; "learnable": times a learnable
        scale initialised at 1 (the authors' CosineLinear).
    latest_per_client : bool
        True (default; the authors' code's bookkeeping): global prototypes, debiasing and
        the pool use the latest prototypes of every client that has trained on the current
        task. False: only this round's clients' (Algorithm 1 read literally). The paper has
        every client in every round, where the two are the same; with partial participation
        False builds the pool from the task's last round alone, which can leave a class out
        of it for good (on the offline benchmark, 5 of 10 clients per round, Dirichlet 0.05:
        A_N 53.9 with True against 49.4; at 0.5 they tie, 58.9 and 59.8; README, FPPL).
    """

    prefix = "fppl"

    temperature: float = 0.2
    ur_weight: float = 1.0
    unified_loss: bool = True
    fusion: bool = True
    debias: bool = True
    pool: bool = True
    server_epochs: int = 5
    server_lr: float = 1e-3
    server_batch_size: int = 128
    fusion_scale: str = "fixed"
    latest_per_client: bool = True

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.temperature > 0, f"fppl.temperature must be > 0, got {self.temperature}")
        need(self.ur_weight >= 0, f"fppl.ur-weight must be >= 0, got {self.ur_weight}")
        need(self.server_epochs >= 1, f"fppl.server-epochs must be >= 1, got {self.server_epochs}")
        need(self.server_lr > 0, f"fppl.server-lr must be > 0, got {self.server_lr}")
        need(self.server_batch_size >= 1, f"fppl.server-batch-size must be >= 1, got {self.server_batch_size}")
        need(self.fusion_scale in FUSION_SCALES,
             f"fppl.fusion-scale must be one of {FUSION_SCALES}, got {self.fusion_scale!r}")


class FPPLPrompt(CodaPrompt):
    """One prompt per task, fused by a cosine-linear layer on the query (eq. 2).

    Parameters (all travel in the trainable state as ``prompt.*``):

    * ``p{layer}`` (T, L, D): task ``t``'s prompt for block ``layer`` is row ``t``;
    * ``fusion`` (T, D): the cosine-linear layer ``psi``; row ``t`` scores task ``t``;
    * ``fusion_scale`` (1,): multiplies the cosine; stays 1 unless
      ``fppl.fusion-scale = "learnable"`` (the authors' code);
    * buffer ``hard_selection`` (1,): 1 selects the argmax task prompt instead of the
      softmax fusion (the "w/o fusion" ablation). It is a buffer so that the switch
      travels with the parameters: clients and the server's evaluator build the model
      from the prompt class alone, without the method options.

    ``pool_size`` is accepted for the shared constructor signature and ignored: FPPL
    has exactly one prompt per task.
    """

    def __init__(self, embed_dim: int, layers: list[int], pool_size: int, length: int, num_tasks: int) -> None:
        nn.Module.__init__(self)  # not CodaPrompt.__init__: none of its components/keys/attention
        self.embed_dim, self.layers, self.pool_size = embed_dim, list(layers), pool_size
        self.length, self.num_tasks = length, num_tasks
        self.per_task = 1
        self.task = 0
        for layer in self.layers:
            # Uniform in [-1, 1], as the authors' FedPrompt ("uniformly initialized", paper).
            self.register_parameter(f"p{layer}", nn.Parameter(torch.empty(num_tasks, length, embed_dim).uniform_(-1, 1)))
        bound = 1.0 / math.sqrt(embed_dim)  # CosineLinear's init
        self.fusion = nn.Parameter(torch.empty(num_tasks, embed_dim).uniform_(-bound, bound))
        self.fusion_scale = nn.Parameter(torch.ones(1))
        self.register_buffer("hard_selection", torch.zeros(1))

    # -- task bookkeeping -------------------------------------------------------
    def slice_of(self, task: int) -> slice:
        """Rows of ``p{layer}`` and ``fusion`` that belong to ``task``."""
        return slice(task, task + 1)

    def init_task_slice(self, task: int, generator: torch.Generator, orthogonal: bool = True) -> None:
        """Task 0: uniform random prompt. Task t > 0: copy of task t-1's prompt (p_t <- p_{t-1}).

        ``orthogonal`` is CODA-P's and has no meaning here.
        """
        with torch.no_grad():
            for layer in self.layers:
                param = getattr(self, f"p{layer}")
                if task == 0:
                    param[0] = torch.rand(param[0].shape, generator=generator) * 2 - 1
                else:
                    param[task] = param[task - 1]

    # -- fusion -------------------------------------------------------------------
    def task_scores(self, query: torch.Tensor) -> torch.Tensor:
        """g_psi(q): scaled cosine of the query with every task's row of psi, (B, T)."""
        return self.fusion_scale * (F.normalize(query, dim=-1) @ F.normalize(self.fusion, dim=-1).T)

    def weights(self, query: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        """Fusion weights (B, T): softmax over seen tasks 0..task, exactly 0 for unseen tasks.

        With ``hard_selection`` set, a one-hot of the argmax over seen tasks instead.
        """
        scores = self.task_scores(query)
        seen = torch.arange(self.num_tasks, device=scores.device) <= self.task
        scores = scores.masked_fill(~seen[None, :], float("-inf"))
        if bool(self.hard_selection.item()):
            return F.one_hot(scores.argmax(dim=1), self.num_tasks).to(scores.dtype)
        return torch.softmax(scores, dim=1)

    def task_prompts(self, layer: int) -> torch.Tensor:
        """Prompts of tasks 0..task (task+1, L, D); finished tasks' detached while training."""
        param = getattr(self, f"p{layer}")
        if self.training:
            return torch.cat([param[: self.task].detach(), param[self.task : self.task + 1]], dim=0)
        return param[: self.task + 1]

    def forward(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """Fused prompt (B, L, D) for ``layer``: sum_t w_t(q) p_t^(layer) (eq. 2)."""
        w = self.weights(query)[:, : self.task + 1]
        return torch.einsum("bt,tld->bld", w, self.task_prompts(layer))

    def orthogonality_penalty(self) -> torch.Tensor:
        """CODA-P's regulariser does not apply to FPPL."""
        return torch.zeros(())


# ---------------------------------------------------------------------------- prototype sets
@dataclass
class PrototypeSet:
    """A flat list of prototypes: one row per (client, class).

    Attributes
    ----------
    classes : (n,) int64 class of each prototype.
    means : (n, D) float32 prototypes.
    clients : (n,) int64 client id that produced it (-1 when unknown).
    """

    classes: np.ndarray
    means: np.ndarray
    clients: np.ndarray

    def __post_init__(self) -> None:
        self.classes = np.asarray(self.classes, np.int64).reshape(-1)
        self.means = np.asarray(self.means, np.float32)
        self.clients = np.asarray(self.clients, np.int64).reshape(-1)

    @classmethod
    def empty(cls, dim: int = 0) -> "PrototypeSet":
        return cls(np.zeros(0, np.int64), np.zeros((0, dim), np.float32), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return int(self.classes.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.classes.nbytes + self.means.nbytes + self.clients.nbytes)

    def concat(self, other: "PrototypeSet") -> "PrototypeSet":
        if not len(self):
            return other
        if not len(other):
            return self
        return PrototypeSet(np.concatenate([self.classes, other.classes]),
                            np.concatenate([self.means, other.means]),
                            np.concatenate([self.clients, other.clients]))

    def replace_clients(self, newer: "PrototypeSet", classes_per_task: int | None = None) -> "PrototypeSet":
        """Keep only the newest prototypes of each client: drop ours of clients in ``newer``.

        With ``classes_per_task`` (the stream's tasks: task t owns classes [t k, (t+1) k)), only
        ours of the same (client, task) pairs: a client's prototypes of another task stay.
        """
        keep = ~np.isin(self.keys(classes_per_task), np.unique(newer.keys(classes_per_task)))
        return self.select(keep).concat(newer)

    def keys(self, classes_per_task: int | None = None) -> np.ndarray:
        """One key per prototype: its client, or its (client, task) pair with ``classes_per_task``."""
        if classes_per_task is None:
            return self.clients
        return np.stack([self.clients, self.classes // classes_per_task], axis=1).view(np.dtype((np.void, 16))).ravel()

    def select(self, mask: np.ndarray) -> "PrototypeSet":
        """The prototypes where ``mask`` is true, in order."""
        return PrototypeSet(self.classes[mask], self.means[mask], self.clients[mask])

    def class_means(self) -> tuple[np.ndarray, np.ndarray]:
        """Eq. 5: per class, the plain (unweighted) mean over the clients holding it."""
        classes = np.unique(self.classes)
        means = np.stack([self.means[self.classes == c].astype(np.float64).mean(axis=0) for c in classes]) \
            if len(classes) else np.zeros((0, self.means.shape[1]))
        return classes.astype(np.int64), means.astype(np.float32)

    def to_state(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}_classes": self.classes, f"{prefix}_means": self.means, f"{prefix}_clients": self.clients}

    @classmethod
    def from_state(cls, state: dict[str, Any], prefix: str) -> "PrototypeSet":
        return cls(state[f"{prefix}_classes"], state[f"{prefix}_means"], state[f"{prefix}_clients"])


# ---------------------------------------------------------------------------- debiasing
def debias_head(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
                epochs: int, lr: float, batch_size: int, seed: Any) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 4: train the linear head with CE on prototypes; returns the new (weight, bias).

    Logits are restricted to the classes present among the prototypes (as the authors'
    code does): classes without a prototype are neither pushed up nor down, which
    matters for FPPL-WOP, where only the current task's classes have prototypes.
    Adam, shuffled mini-batches (seeded), a fresh optimiser per call.
    """
    head = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(np.asarray(weight, np.float32)))
        head.bias.copy_(torch.from_numpy(np.asarray(bias, np.float32)))
    x = torch.from_numpy(np.asarray(features, np.float32))
    y = torch.from_numpy(np.asarray(labels, np.int64))
    allowed = torch.zeros(weight.shape[0], dtype=torch.bool)
    allowed[y.unique()] = True
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), batch_size):
            sel = order[start : start + batch_size]
            logits = head(x[sel]).masked_fill(~allowed[None, :], float("-inf"))
            loss = F.cross_entropy(logits, y[sel])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return (head.weight.detach().numpy().astype(weight.dtype, copy=False),
            head.bias.detach().numpy().astype(bias.dtype, copy=False))


# ---------------------------------------------------------------------------- strategy
class FPPLStrategy(PromptStrategy):
    """FPPL's server: FedAvg + prototype aggregation, prototype pool and classifier debiasing.

    State a checkpoint must hold (:meth:`state_dict`): the prototype pool C_g, the
    current task's local prototypes (they join the pool at the task's end) and the
    global prototypes G to send next round.

    Parameters
    ----------
    cfg, num_classes, options
        As :class:`~strategies.base.PromptStrategy`; ``options`` are the ``fppl.*`` keys
        (see :class:`FPPLOptions`).
    """

    per_task_in_flight = True  # asynchronous arrival: a task's slice over the clients on it

    name = "fppl"
    random_tasks = False  # prototypes pooled per (client, task) of the stream
    prompt_class: type[CodaPrompt] = FPPLPrompt
    options_class = FPPLOptions  # the CLI validates ``fppl.*`` options with it before training
    #: The base only requires "arrays" and "metrics" (so an empty client is still logged
    #: as "no training examples"); :meth:`check_reply` then requires exactly these records.
    # Checked in check_reply after the base checks, not by the base: a client with no examples
    # of the task replies without prototypes and must be skipped quietly ("no training
    # examples"), not logged as a malformed reply.
    reply_records = None
    fppl_reply_records = frozenset({ARRAYS, METRICS, LOCAL_PROTOTYPES})
    # dp.clip = C: each class prototype (a mean feature) is clipped to norm C on its own;
    # classes, counts and the client id are the label histogram and bookkeeping, in the clear
    private_records = {LOCAL_PROTOTYPES: PrivateRecord(bounded={"means": (1, 1.0)},
                                                       public=("classes", "counts", "client"))}

    def uploaded_features(self, classes: list[int], seed: int) -> list[dict[str, Any]]:
        """Per class, one client's prototype: the newest (this task's local prototypes before the pool)."""
        out = []
        for c in classes:
            for protos in (self.current, self.pool):
                rows = np.flatnonzero(protos.classes == c)
                if len(rows):
                    out.append({"class": c, "kind": "prototype", "vector": protos.means[rows[0]],
                                "client": int(protos.clients[rows[0]]), "meta": {}})
                    break
        return out

    def __init__(self, cfg: ExperimentConfig, num_classes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(cfg, num_classes, options)
        self.opts = FPPLOptions.from_options(self.options)
        self.task = 0
        self.pool = PrototypeSet.empty()  # C_g: prototypes of finished tasks
        self.current = PrototypeSet.empty()  # {C_k^t}: the current task's local prototypes
        self.global_classes = np.zeros(0, np.int64)  # G: classes ...
        self.global_means = np.zeros((0, 0), np.float32)  # ... and their global prototypes
        self._global_record: ArrayRecord | None = None  # built once per round, shared by all messages

    def summary(self) -> None:
        super().summary()
        log.info("fppl: options %s (one prompt per task: pool-size %d is not used)",
                 self.opts.to_dict(), self.cfg.pool_size)

    # ------------------------------------------------------------------ task hooks
    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """A client reaches a new task: prompt p_t <- p_{t-1} (task 0: random); fusion switch.

        Under asynchronous arrival the first client to reach task t gets the server's p_{t-1}
        as it stands, while others still train it. G holds the classes of the tasks some client
        is on (:meth:`consolidate`), so the new task's first round has no G of its own classes.
        """
        self.task = task
        state = from_array_record(arrays)
        state["prompt.hard_selection"] = np.full((1,), 0.0 if self.opts.fusion else 1.0, np.float32)
        return super().on_task_start(task, to_array_record(state))

    def on_task_end(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Every client has left ``task`` (its nominal end): its prototypes still in {C_k^t} join C_g
        (Algorithm 1, line 14). Under asynchronous arrival those of clients that left earlier
        have joined at the first round they trained a later task (:meth:`pool_departed`)."""
        self._pool_finished(self.current.classes < (task + 1) * self.classes_per_task)
        log.info("fppl: after task %d the prototype pool holds %d prototypes of %d classes (%.1f KB)",
                 task + 1, len(self.pool), len(np.unique(self.pool.classes)), self.pool.nbytes / 1e3)
        return arrays

    # ------------------------------------------------------------------ messages
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.task = int(config["task"])
        self.pool_departed(server_round - 1)
        self._global_record = None
        tasks = self.tasks_in_flight(server_round - 1)  # G of the classes some client trains now
        k = self.classes_per_task
        keep = (self.global_classes >= tasks.start * k) & (self.global_classes < tasks.stop * k)
        if self.opts.unified_loss and keep.any():
            self._global_record = to_array_record({"classes": self.global_classes[keep],
                                                   "means": self.global_means[keep]})
        return super().configure_train(server_round, arrays, config, grid)

    def client_payload(self, client_id: int, arrays: ArrayRecord, config: ConfigRecord) -> RecordDict:
        """Parameters and config, plus G (the current classes' global prototypes) once there is one."""
        content = super().client_payload(client_id, arrays, config)
        if self._global_record is not None:
            content[GLOBAL_PROTOTYPES] = self._global_record
        return content

    def check_reply(self, msg: Message) -> str | None:
        """The base checks, plus a well-formed, finite local-prototype record."""
        reason = super().check_reply(msg)
        if reason is not None:
            return reason
        content = msg.content
        names = method_records(content)
        if names != self.fppl_reply_records:
            extra, missing = names - self.fppl_reply_records, self.fppl_reply_records - names
            return f"unexpected records {sorted(extra)}, missing records {sorted(missing)}"
        if LOCAL_PROTOTYPES not in content.array_records:
            return f"{LOCAL_PROTOTYPES!r} is not an array record"
        rec = content[LOCAL_PROTOTYPES]
        if not {"classes", "means"} <= set(rec.keys()):
            return f"{LOCAL_PROTOTYPES!r} record lacks 'classes' or 'means'"
        classes, means = rec["classes"].numpy(), rec["means"].numpy()
        dim = self.sent_arrays["prompt.fusion"].shape[1] if self.sent_arrays is not None else means.shape[-1]
        if means.ndim != 2 or means.shape != (classes.shape[0], dim):
            return f"prototypes of shape {means.shape} for {classes.shape[0]} classes of dim {dim}"
        if not np.issubdtype(classes.dtype, np.integer) or classes.ndim != 1:
            return "prototype classes must be a vector of integers"
        if classes.size and (classes.min() < 0 or classes.max() >= self.num_classes):
            return "prototype classes out of range"
        if len(np.unique(classes)) != len(classes):
            return "prototypes repeat a class"
        if not np.isfinite(means).all():
            return "prototypes have non-finite values"
        task, client = self.assigned_task(msg), self.assigned_client(msg)
        if task is None and not self.schedule.synchronous:
            return "cannot tell which task this reply trained (no matching message sent this round)"
        if task is not None and not np.isin(classes, task_classes(self.cfg, task, self.num_classes)).all():
            return "prototypes of classes outside the task the client was sent"
        if "client" in rec.keys():
            claimed = rec["client"].numpy().reshape(-1)
            if claimed.shape != (1,) or (client is not None and int(claimed[0]) != client):
                return "prototypes claim another client than the one the server sent"
        return None

    # ------------------------------------------------------------------ aggregation
    @property
    def classes_per_task(self) -> int:
        return self.num_classes // self.cfg.num_tasks

    def consolidate(self, server_round: int, arrays: ArrayRecord, replies: list[RecordDict]) -> ArrayRecord:
        """After FedAvg: collect local prototypes, debias the head (eq. 4), build G (eq. 5) for the
        next round's tasks."""
        received = self._collect(replies)
        self.current = (self.current.replace_clients(received, self.classes_per_task)
                        if self.opts.latest_per_client else received)
        if self.opts.debias:
            arrays = self._debias(server_round, arrays)
        self._update_global(self.tasks_in_flight(server_round))  # server_round: the next round's 0-based index
        return arrays

    def pool_departed(self, round_index: int) -> None:
        """The prototypes of the clients that have left their task by ``round_index`` (0-based)
        join C_g: a client's last prototypes of a task are final once it trains the next one."""
        k = self.classes_per_task
        self._pool_finished(np.array([c >= 0 and self.client_position(int(c), round_index) > int(y) // k
                                      for c, y in zip(self.current.clients, self.current.classes)], dtype=bool))

    def _pool_finished(self, finished: np.ndarray) -> None:
        """C_g <- C_g U the ``finished`` rows of {C_k^t} (dropped for FPPL-WOP); the rest stay current."""
        if not finished.any():
            return
        if self.opts.pool:
            self.pool = self.pool.concat(self.current.select(finished))
        self.current = self.current.select(~finished)

    def _update_global(self, tasks: range) -> None:
        """G (eq. 5) of the classes of ``tasks``: per class, the mean over every client holding it so
        far, in the pool or still current (with synchronous arrival, the current task's clients)."""
        held = self.pool.concat(self.current)
        held = held.select((held.classes >= tasks.start * self.classes_per_task)
                           & (held.classes < tasks.stop * self.classes_per_task))
        if len(held):
            self.global_classes, self.global_means = held.class_means()
        else:
            self.global_classes, self.global_means = np.zeros(0, np.int64), np.zeros((0, 0), np.float32)

    def _collect(self, replies: list[RecordDict]) -> PrototypeSet:
        """This round's local prototypes, each under the client the server sent (-1: unknown)."""
        origins = self.reply_origins(replies) or [(None, None)] * len(replies)
        out = PrototypeSet.empty()
        for content, (client, _) in zip(replies, origins):
            rec = content[LOCAL_PROTOTYPES]
            classes = rec["classes"].numpy().astype(np.int64)
            if client is None:  # a direct call: the record's own client field, as before
                client = int(rec["client"].numpy().reshape(-1)[0]) if "client" in rec.keys() else -1
            out = out.concat(PrototypeSet(classes, rec["means"].numpy().astype(np.float32),
                                          np.full(len(classes), client, np.int64)))
        return out

    def debias_set(self) -> PrototypeSet:
        """Prototypes the head is debiased on: C_g U {C_k^t}, or {C_k^t} alone for FPPL-WOP."""
        return self.pool.concat(self.current) if self.opts.pool else self.current

    def _debias(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        data = self.debias_set()
        if not len(data):
            return arrays
        state = from_array_record(arrays)
        state["head.weight"], state["head.bias"] = debias_head(
            state["head.weight"], state["head.bias"], data.means, data.classes,
            epochs=self.opts.server_epochs, lr=self.opts.server_lr, batch_size=self.opts.server_batch_size,
            seed=[self.cfg.seed, server_round, 0xDEB1A5])
        return to_array_record(state)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Prototype pool, current task's local prototypes, global prototypes, task."""
        return {
            "task": self.task,
            **self.pool.to_state("pool"),
            **self.current.to_state("current"),
            "global_classes": self.global_classes,
            "global_means": self.global_means,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task = int(state["task"])
        self.pool = PrototypeSet.from_state(state, "pool")
        self.current = PrototypeSet.from_state(state, "current")
        self.global_classes = np.asarray(state["global_classes"], np.int64)
        self.global_means = np.asarray(state["global_means"], np.float32)

    # ------------------------------------------------------------------ helpers
    def _prompt_from(self, state: dict[str, np.ndarray]) -> CodaPrompt:
        """An FPPL prompt module holding the prompt arrays of ``state``."""
        dim = int(state["prompt.fusion"].shape[1])
        prompt = FPPLPrompt(dim, self.cfg.layers, self.cfg.pool_size, self.cfg.prompt_length, self.cfg.num_tasks)
        prompt.load_state_dict({k[7:]: torch.from_numpy(np.array(v, copy=True))
                                for k, v in state.items() if k.startswith("prompt.")})
        return prompt
