"""PILoRA on the server: sample-weighted FedAvg of the LoRA sets, heterogeneity-aware prototypes.

* The adapters (and, with ``pilora.reweight = "fedavg"``, the prototypes) are the platform's
  sample-weighted average, per task set and head rows with clients on several tasks
  (``per_task = "in-flight"``): the authors' ``utils.average_weights`` and fed-mammoth's
  weighted ``end_round_server``.
* ``consolidate`` re-weights each class's prototype from the clients' prototypes by their
  distance to the class means of the clients holding the class (``prototypes.py``).
* ``on_task_start`` draws the new task's LoRA set (``A`` Kaiming-uniform, ``B`` zero) and sets the
  prototypes of the classes of this and every later task to ``0.1 N(0, I)`` (both codes draw all
  100 at the start; each task's rows come from their own seeded stream, so redrawing a later task
  at its start changes nothing: no client has trained them), and the head's unused bias to zero.

Other parts: ``options.py``, ``prompt.py`` (adapters and distance logits), ``learner.py``
(losses, class means), ``prototypes.py`` (re-weighting), ``records.py``.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message

from ...common.records import ARRAYS, METRICS, arrays_of, from_array_record, to_array_record
from ..platform.checks import class_rows_problem
from ..platform.rounds import Accepted, Sent
from ..platform.strategy import PromptStrategy
from .options import PILoRAOptions
from .prototypes import reweighted_prototypes
from .records import CLASS_MEANS

log = logging.getLogger("promptfcl")

#: the prototypes' initial scale (both codes: ``0.1 * randn``)
PROTOTYPE_SCALE = 0.1


class PILoRAStrategy(PromptStrategy):
    """PILoRA's server (module docstring). Keeps, for the privacy audit, each class's newest uploaded mean."""

    opts: PILoRAOptions
    per_task = "in-flight"  # asynchronous arrival: a task's set and prototypes over the clients on it
    reply_records = frozenset({ARRAYS, METRICS, CLASS_MEANS})

    def setup(self) -> None:
        self.mean_classes = np.zeros(0, np.int64)  # each class's newest uploaded mean (privacy audit)
        self.mean_clients = np.zeros(0, np.int64)
        self.mean_vectors = np.zeros((0, 0), np.float32)
        self._weights_max: list[float] = []  # this round's largest client weight per re-weighted class
        self._warned_combiner = False

    def summary(self) -> None:
        super().summary()
        log.info("pilora: LoRA rank %d on q, v of blocks %s (%s), prototypes as the head's rows, re-weighting %s",
                 self.opts.rank, self.model.layers, "sets 0..t" if self.opts.lora_sum else "task t's set",
                 self.opts.reweight)

    # ------------------------------------------------------------------ tasks
    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """The new task's LoRA set (platform: ``init_task_slice``); prototypes of tasks >= ``task``
        drawn ``0.1 N(0, I)`` from their task's seeded stream; the bias zero."""
        state = from_array_record(super().on_task_start(task, arrays))
        weight = np.array(state["head.weight"], copy=True)
        for later in range(task, self.data.num_tasks):
            rows = self.layout.head_rows(later)
            draw = np.random.default_rng([self.run.seed, later, 0x9107]).standard_normal((len(rows), weight.shape[1]))
            weight[rows] = (PROTOTYPE_SCALE * draw).astype(weight.dtype)
        state["head.weight"] = weight
        state["head.bias"] = np.zeros_like(state["head.bias"])
        return to_array_record(state)

    # ------------------------------------------------------------------ replies
    def check_records(self, reply: Message, sent: Sent) -> str | None:
        """A well-formed, finite class-mean record of the classes of the task the client was sent."""
        content = reply.content
        if CLASS_MEANS not in content.array_records:
            return f"{CLASS_MEANS!r} is not an array record"
        rec = arrays_of(content, CLASS_MEANS)
        if not {"classes", "means", "counts"} <= set(rec.keys()):
            return f"{CLASS_MEANS!r} record lacks 'classes', 'means' or 'counts'"
        classes, counts = rec["classes"].numpy(), rec["counts"].numpy()
        dim = int(arrays_of(content)["head.weight"].shape[1])  # already checked against what was sent
        problem = class_rows_problem(rec, "class means", dim, self.layout.head_rows(sent.task), sent.client,
                                     self.layout.head_size)
        if problem is None and (counts.shape != classes.shape or not np.issubdtype(counts.dtype, np.integer)
                                or (counts < 1).any()):
            return "class-mean counts must be one positive integer per class"
        return problem

    # ------------------------------------------------------------------ aggregation
    def consolidate(self, server_round: int, arrays: ArrayRecord, accepted: list[Accepted]) -> ArrayRecord:
        """Each trained class's prototype re-weighted (``pilora.reweight = "heterogeneity"``) from the
        prototypes of the clients on its task and their class means; the adapters stay averaged."""
        self._remember_means(accepted)
        self._weights_max = []
        if self.opts.reweight != "heterogeneity" or not accepted:
            return arrays
        if self.policies.combiner.mode != "mean":  # a robust combiner's rows are the run's choice
            if not self._warned_combiner:
                log.warning("pilora: aggregation = %r: the prototypes follow the combiner, not the re-weighting",
                            self.policies.combiner.mode)
                self._warned_combiner = True
            return arrays
        state = from_array_record(arrays)
        weight = np.array(state["head.weight"], copy=True)
        for task in sorted({a.task for a in accepted}):
            holders = [a for a in accepted if a.task == task]
            rows = self.layout.head_rows(task)
            position = {int(r): j for j, r in enumerate(rows)}
            prototypes = np.stack([arrays_of(a.content)["head.weight"].numpy()[rows] for a in holders])
            means = np.zeros_like(prototypes, dtype=np.float64)
            holds = np.zeros(prototypes.shape[:2], dtype=bool)
            for i, a in enumerate(holders):
                rec = arrays_of(a.content, CLASS_MEANS)
                for c, m in zip(rec["classes"].numpy().tolist(), rec["means"].numpy()):
                    means[i, position[int(c)]], holds[i, position[int(c)]] = m, True
            merged, weights = reweighted_prototypes(prototypes, means, holds, self.opts.reweight_temperature)
            weight[rows] = merged.astype(weight.dtype)
            self._weights_max += weights.max(axis=1).tolist()
        state["head.weight"] = weight
        return to_array_record(state)

    def round_metrics(self, accepted: list[Accepted]) -> dict[str, float]:
        """``prototype-weight-max``: the largest client weight of a re-weighted class, averaged over
        the classes (1 / clients: uniform; 1: one client's prototype)."""
        return {"prototype-weight-max": float(np.mean(self._weights_max))} if self._weights_max else {}

    def _remember_means(self, accepted: list[Accepted]) -> None:
        """Each class's newest uploaded mean, with the client that sent it (privacy audit)."""
        newest: dict[int, tuple[int, np.ndarray]] = {
            int(c): (int(cl), v) for c, cl, v in zip(self.mean_classes, self.mean_clients, self.mean_vectors)}
        for a in accepted:
            rec = arrays_of(a.content, CLASS_MEANS)
            for c, m in zip(rec["classes"].numpy().tolist(), rec["means"].numpy()):
                newest[int(c)] = (a.client, np.asarray(m, np.float32))
        if newest:
            order = sorted(newest)
            self.mean_classes = np.array(order, np.int64)
            self.mean_clients = np.array([newest[c][0] for c in order], np.int64)
            self.mean_vectors = np.stack([newest[c][1] for c in order]).astype(np.float32)

    def uploaded_features(self, classes: list[int], seed: int) -> list[dict[str, Any]]:
        """Per class, the newest class mean a client uploaded."""
        out = []
        for c in classes:
            rows = np.flatnonzero(self.mean_classes == c)
            if len(rows):
                out.append({"class": c, "kind": "class-mean", "vector": self.mean_vectors[rows[0]],
                            "client": int(self.mean_clients[rows[0]]), "meta": {}})
        return out

    def stateful_parameters(self, arrays: ArrayRecord) -> int:
        """What one exchange would carry each way if clients kept the frozen sets and prototypes: the
        current task's LoRA set and its classes' prototypes (the class means travel beside them)."""
        state = from_array_record(arrays)
        sets = sum(int(np.prod(v.shape[1:])) for k, v in state.items()
                   if k.startswith("prompt.lora_") and not k.endswith("_w"))
        return sets + self.layout.classes_per_task * int(state["head.weight"].shape[1])

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"mean_classes": self.mean_classes, "mean_clients": self.mean_clients, "mean_vectors": self.mean_vectors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean_classes = np.asarray(state["mean_classes"], np.int64)
        self.mean_clients = np.asarray(state["mean_clients"], np.int64)
        self.mean_vectors = np.asarray(state["mean_vectors"], np.float32)
