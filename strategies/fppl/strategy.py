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
The method's other parts: ``options.py``, ``prompt.py`` (one prompt per task, fused by a
cosine-linear layer), ``prototypes.py`` (prototype sets, debiasing), ``records.py`` and the
client's ``learner.py`` (its loss, local prototypes).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from ...common.records import ARRAYS, METRICS, arrays_of, from_array_record, to_array_record
from ..platform.checks import class_rows_problem
from ..platform.partial import Rows, completed
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .options import FPPLOptions
from .prompt import task_prompt_names
from .prototypes import PrototypeSet, debias_head
from .records import GLOBAL_PROTOTYPES, LOCAL_PROTOTYPES

log = logging.getLogger("promptfcl")


class FPPLStrategy(PromptStrategy):
    """FPPL's server: FedAvg + prototype aggregation, prototype pool and classifier debiasing.

    State a checkpoint must hold (:meth:`state_dict`): the prototype pool C_g, the
    current task's local prototypes (they join the pool at the task's end) and the
    global prototypes G to send next round.

    Parameters
    ----------
    cfg, num_classes, options
        As :class:`~promptfcl.strategies.platform.strategy.PromptStrategy`; ``options`` are the
        ``fppl.*`` keys (see :class:`FPPLOptions`).
    """

    opts: FPPLOptions
    per_task = "in-flight"  # asynchronous arrival: a task's prompt over the clients on it
    # (a client with no examples of its task replies without prototypes: the platform leaves
    # it out as "no training examples" before it checks the records)
    reply_records = frozenset({ARRAYS, METRICS, LOCAL_PROTOTYPES})

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

    def setup(self) -> None:
        self.task = 0
        self.pool = PrototypeSet.empty()  # C_g: prototypes of finished tasks
        self.current = PrototypeSet.empty()  # {C_k^t}: the current task's local prototypes
        self.global_classes = np.zeros(0, np.int64)  # G: classes ...
        self.global_means = np.zeros((0, 0), np.float32)  # ... and their global prototypes
        self._global_record: ArrayRecord | None = None  # built once per round, shared by all messages

    def summary(self) -> None:
        super().summary()
        log.info("fppl: options %s (one prompt per task: pool-size %d is not used)",
                 self.opts.to_dict(), self.model.pool_size)

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
    def round_start(self, server_round: int, task: int, round_: int, arrays: ArrayRecord) -> None:
        """Prototypes of clients that have moved on join the pool; G of the classes some client trains now."""
        self.task = task
        self.pool_departed(server_round - 1)
        self._global_record = None
        tasks = self.tasks_in_flight(server_round - 1)
        k = self.classes_per_task
        keep = (self.global_classes >= tasks.start * k) & (self.global_classes < tasks.stop * k)
        if self.opts.unified_loss and keep.any():
            self._global_record = to_array_record({"classes": self.global_classes[keep],
                                                   "means": self.global_means[keep]})

    def payload(self, sent: Sent, arrays: ArrayRecord) -> RecordDict:
        """Parameters and config, plus G (the current classes' global prototypes) once there is one.

        The reply carries every array but the other tasks' frozen prompts: of each task prompt
        array only the row of the task the client was sent (``sent.expected``).
        """
        content = super().payload(sent, arrays)
        assert content is not None  # the platform's payload always trains
        if self._global_record is not None:
            content[GLOBAL_PROTOTYPES] = self._global_record
        state = from_array_record(arrays_of(content))
        sent.expected = to_array_record({name: value[sent.task : sent.task + 1] if name in self._task_prompts else value
                                         for name, value in state.items()})
        return content

    @property
    def _task_prompts(self) -> set[str]:
        return task_prompt_names(self.model.layers)

    def _own_prompt(self, task: int) -> Rows:
        """What a reply holds of each array: of a task prompt array the row of ``task``, others whole."""
        prompts = self._task_prompts
        return lambda name, value: slice(task, task + 1) if name in prompts else None

    def aggregate(self, accepted: list[Accepted]) -> ArrayRecord:
        """FedAvg over the replies, each completed with the frozen prompts it was sent."""
        complete = [to_array_record(completed(from_array_record(arrays_of(a.content)),
                                              from_array_record(a.sent.arrays),  # type: ignore[arg-type]
                                              self._own_prompt(a.task)))
                    for a in accepted]
        for a, record in zip(accepted, complete):
            a.content[ARRAYS] = record  # what the platform's average reads
        return super().aggregate(accepted)

    def stateful_parameters(self, arrays: ArrayRecord) -> int | None:
        """FPPL's count (the paper's 0.25 M per round on ImageNet-R): one task prompt per layer, psi,
        the head and the global prototypes of a task's classes; the other tasks' prompts are frozen,
        so a client that kept them would not receive them again."""
        state = from_array_record(arrays)
        prompts = sum(int(np.prod(state[name].shape[1:])) for name in self._task_prompts)
        unsent = {"prompt.hard_selection"} | ({"prompt.fusion_scale"} if self.opts.fusion_scale == "fixed" else set())
        others = sum(int(np.prod(v.shape)) for name, v in state.items()
                     if name not in self._task_prompts and name not in unsent)
        return prompts + others + self.classes_per_task * int(state["prompt.fusion"].shape[1])

    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """A well-formed, finite local-prototype record of the classes of the task the client was sent."""
        content = reply.content
        if LOCAL_PROTOTYPES not in content.array_records:
            return f"{LOCAL_PROTOTYPES!r} is not an array record"
        rec = arrays_of(content, LOCAL_PROTOTYPES)
        if not {"classes", "means"} <= set(rec.keys()):
            return f"{LOCAL_PROTOTYPES!r} record lacks 'classes' or 'means'"
        dim = int(arrays_of(content)["prompt.fusion"].shape[1])  # already checked against what was sent
        return class_rows_problem(rec, "prototypes", dim, self.layout.classes(sent.task), sent.client,
                                  self.num_classes)

    # ------------------------------------------------------------------ aggregation
    @property
    def classes_per_task(self) -> int:
        return self.layout.classes_per_task

    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """After FedAvg: collect local prototypes, debias the head (eq. 4), build G (eq. 5) for the
        next round's tasks."""
        received = self._collect(accepted)
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

    def _collect(self, accepted: list[Accepted]) -> PrototypeSet:
        """This round's local prototypes, each under the client the server sent."""
        out = PrototypeSet.empty()
        for a in accepted:
            rec = arrays_of(a.content, LOCAL_PROTOTYPES)
            classes = rec["classes"].numpy().astype(np.int64)
            out = out.concat(PrototypeSet(classes, rec["means"].numpy().astype(np.float32),
                                          np.full(len(classes), a.client, np.int64)))
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
            seed=[self.run.seed, server_round, 0xDEB1A5])
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
