"""Powder's client: local pool from the server, alpha measurement, CE + lambda * dual distillation.

The shared loop (strategies/platform/learner.py) trains the current task's slice and the head with CE
over the current task's classes; this learner

* rebuilds full-size arrays from the server's per-client payload (only the slices of its
  local pool and its task's head rows travel) and restricts the prompt module to that local
  pool (eq. 4, :class:`PowderPrompt`), its own slice's change mixed into every local slice
  with eq. 3's weights (``powder-own-weights``);
* when the server asks (``powder-measure``: in the measuring message before training, or at
  the start of the training round with ``measuring = "in-training"``), measures the average
  prompt-selection weights alpha (eq. 6) of its current task and of the task it has just
  finished, per task and per class, over the whole pool it was sent;
* adds, per batch, lambda * L_dual (eq. 5): the KL divergence from the model at the start
  of the round (the teacher, holding the transferred knowledge) to the current model over
  the non-true classes of the task (the true-class logit removed, as in FedNTD), each
  sample weighted by beta = softmax over the batch of its class's total correlation
  sum_i G_class[y, i]. ``distillation = "classic"`` uses plain KD over all the task's
  classes instead (Table 5, DIS);
* replies only its task's slice of every prompt array (the P_hat slice it was sent plus its
  raw slice's change) and its task's head rows, plus the ``powder-alpha`` record.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ...common.data.partitions import client_indices
from ...common.records import (
    METRICS,
    arrays_of,
    as_float,
    as_int,
    as_list,
    config_of,
    from_array_record,
    to_array_record,
    to_torch,
)
from ..platform.distillation import classic_distillation, dual_distillation
from ..platform.learner import Batch, LocalLearner
from ..platform.partial import Rows, completed
from .options import PowderOptions
from .prompt import PowderPrompt
from .records import ALPHA, CLASS_CORR, LOCAL_TASKS, MEASURE, OWN_WEIGHTS, PREVIOUS


def sample_weights(class_total: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """beta: softmax over the batch of each sample's class total correlation (eq. 5)."""
    return F.softmax(class_total[labels].float(), dim=0)


class PowderLearner(LocalLearner):
    """Local learning of Powder (eq. 8) on the local pool the server sent.

    Parameters
    ----------
    runtime : Runtime
        Data, model (with :class:`PowderPrompt`), device and query cache.
    options : dict
        ``powder.*`` options (prefix removed).
    """

    opts: PowderOptions

    def __init__(self, **inputs: Any) -> None:  # LocalLearner's keyword inputs (made by ``of``)
        super().__init__(**inputs)
        self.local_tasks: list[int] = []
        self.own_weights: dict[int, float] | None = None  # G_task[s, task] per local task s (None: not sent)
        self.measure = False
        self.previous = -1  # the task just finished, measured too (-1: none)
        self.client_id = 0
        self.class_total: torch.Tensor | None = None  # sum_i G_class[y, i] per head row of class y (1 where unknown)
        self.teacher: tuple[torch.nn.Module, torch.nn.Module] | None = None  # round-start prompt and head
        self.alpha_record = ArrayRecord()
        self.last_distillation: float | None = None  # the last batch's term (diagnostics, tests)

    @property
    def prompt(self) -> PowderPrompt:
        prompt = self.rt.model.prompt
        if not isinstance(prompt, PowderPrompt):
            raise TypeError(f"Powder needs the model built with PowderPrompt, got {type(prompt).__name__}")
        return prompt

    # ------------------------------------------------------------------ wire format
    def expand(self, sent: ArrayRecord, task: int, prompts_only: bool = False) -> ArrayRecord:
        """Full-size arrays: the local pool's slices and the task's head rows in place, zeros elsewhere
        (``prompts_only``: the payload holds the prompt arrays only, as a measuring message does)."""
        full = {k: v.detach().cpu().numpy() for k, v in self.rt.model.trainable_state().items()}
        got = from_array_record(sent)
        names = {k for k in full if k.startswith("prompt.")} if prompts_only else set(full)
        if set(got) != names:
            raise ValueError(f"payload arrays {sorted(got)} differ from the model's {sorted(names)}")
        zeros = {name: np.zeros_like(value) for name, value in full.items()}  # an array not sent is not used
        placed = completed(got, {name: zeros[name] for name in got}, self.sent_rows(task))
        return to_array_record({name: placed.get(name, value) for name, value in zeros.items()})

    def sent_rows(self, task: int) -> Rows:
        """The rows of each array the server sends: the local pool's slices (its tasks' slices, in
        order) of a prompt array, ``task``'s head rows, the whole of any other array."""
        def rows(name: str, value: np.ndarray) -> slice | np.ndarray | None:
            own = self.rows(name, value, task)
            if own is None or not name.startswith("prompt."):
                return own
            return np.concatenate([np.arange(len(value))[self.rows(name, value, t)] for t in self.local_tasks])

        return rows

    def uploaded(self, state: dict[str, torch.Tensor], task: int) -> dict[str, torch.Tensor]:
        """The reply: the task's slice of every prompt array and the task's head rows."""
        out = {}
        for name, value in state.items():
            array = value.detach().cpu().numpy()
            rows = self.rows(name, array, task)
            out[name] = value if rows is None else torch.from_numpy(array[rows])
        return out

    def rows(self, name: str, value: np.ndarray, task: int) -> slice | np.ndarray | None:
        """``task``'s rows of array ``name`` (its pool slice, or its classes' head rows); None: neither."""
        return self.rt.layout.task_rows(name, value, task)

    # ------------------------------------------------------------------ the round
    def read_message(self, config: ConfigRecord, task: int, round_: int, client_id: int) -> None:
        """This round's local pool, mixing weights, measuring request and class correlations."""
        local = [as_int(t) for t in as_list(config[LOCAL_TASKS])]
        if task not in local or local != sorted(set(local)) or not 0 <= local[0] <= local[-1] < self.data.num_tasks:
            raise ValueError(f"local pool {local} is not a sorted set of tasks holding task {task}")
        self.local_tasks, self.client_id, self.round_ = local, client_id, round_
        weights = None if config.get(OWN_WEIGHTS) is None else as_list(config[OWN_WEIGHTS])
        if weights is not None and len(weights) != len(local):
            raise ValueError(f"{OWN_WEIGHTS} has {len(weights)} values for the local pool {local}")
        self.own_weights = None if weights is None else dict(zip(local, (as_float(w) for w in weights)))
        self.measure = bool(config.get(MEASURE, False))
        self.previous = as_int(config.get(PREVIOUS, -1))
        if not -1 <= self.previous < self.data.num_tasks or self.previous == task:
            raise ValueError(f"{PREVIOUS} = {self.previous} is not a task other than {task}")
        # indexed like the logits (head rows), as the batches' labels are
        total = torch.ones(self.rt.layout.head_size)
        corr = [as_float(v) for v in as_list(config.get(CLASS_CORR, []))]
        rows = self.rt.layout.head_rows(task)  # in the order of the task's classes
        if corr:
            if len(corr) != len(rows):
                raise ValueError(f"{CLASS_CORR} has {len(corr)} values for {len(rows)} classes")
            total[rows] = torch.tensor(corr)
        self.class_total = total.to(self.rt.device)

    def received(self, content: RecordDict, task: int, round_: int, client_id: int) -> ArrayRecord:
        """This round's local pool and the rest of the server's message read; the payload completed
        to full-size arrays (zeros outside the local pool and the task's head rows)."""
        self.read_message(config_of(content), task, round_, client_id)
        self.alpha_record = ArrayRecord()
        return self.expand(arrays_of(content), task)

    def reply_records(self) -> dict[str, Any]:
        """The alphas measured at the round's start (empty when the server did not ask)."""
        return {ALPHA: self.alpha_record}

    def round_cleanup(self) -> None:
        """The shared model's prompt back to plain CODA-P; the teacher dropped."""
        self.prompt.end_round()
        self.teacher = None

    def answer(self, content: RecordDict, task: int, round_: int, client_id: int) -> RecordDict:
        """The measuring exchange (Algorithm 1, line 9): the alphas of the current task, and of the
        task just finished, over the whole P_hat sent; no training."""
        config = config_of(content)
        self.read_message(config, task, round_, client_id)
        if not self.measure:
            raise ValueError(f"a message before training must ask for alphas ({MEASURE} = true)")
        model = self.rt.model
        model.load_trainable_state(to_torch(self.expand(arrays_of(content), task, prompts_only=True)))
        model.prompt.set_task(task)
        self.prompt.begin_round(self.local_tasks, None)
        try:
            record = self.measure_alphas([task] + ([self.previous] if self.previous >= 0 else []))
        finally:
            self.prompt.end_round()
        n = len(client_indices(self.rt.data.train.labels, self.rt.layout, self.rt.partition, client_id, task, round_))
        return RecordDict({ALPHA: record, METRICS: MetricRecord({"num-examples": int(n)})})

    def round_start(self, content: RecordDict, task: int) -> None:
        """Restrict the prompt to the local pool; measure alphas if asked; keep the round-start model."""
        self.prompt.begin_round(self.local_tasks, self.own_weights)
        if self.measure:
            measured = [task] + ([self.previous] if self.previous >= 0 else [])
            self.alpha_record = self.measure_alphas(measured)
        if self.opts.dual and self.opts.lambda_ > 0:
            model = self.rt.model
            self.teacher = (copy.deepcopy(model.prompt).eval(), copy.deepcopy(model.head).eval())

    @torch.no_grad()
    def measure_alphas(self, tasks: list[int], batch_size: int = 256) -> ArrayRecord:
        """Eq. 6 per task and per class: mean selection weights over the client's samples,
        laid out over every pool row of every prompted block (zeros for rows not in the pool)."""
        rt, prompt = self.rt, self.prompt
        rows = prompt.pool_rows()
        width = len(prompt.layers) * self.model.pool_size
        labels_all = rt.data.train.labels
        out: dict[str, list[Any]] = {"tasks": [], "task-alpha": [], "task-count": [], "classes": [], "class-alpha": [],
                                     "class-count": []}
        by_class: dict[int, list] = {}
        was_training = prompt.training
        prompt.eval()
        try:
            for t in tasks:
                index = client_indices(labels_all, rt.layout, rt.partition, self.client_id, t,
                                       self.round_ if t == tasks[0] else 0)
                if len(index) == 0:
                    continue
                queries = rt.queries("train", index)
                alphas = np.zeros((len(index), width), dtype=np.float64)
                for start in range(0, len(index), batch_size):
                    if queries is not None:
                        q = queries[start : start + batch_size]
                    else:
                        x = rt.model.preprocess(
                            torch.from_numpy(rt.data.train.images[index[start : start + batch_size]]).to(rt.device)
                        )
                        q = rt.model.query(x)
                    for li, layer in enumerate(prompt.layers):
                        w = prompt.weights(q, layer).double().cpu().numpy()
                        alphas[start : start + len(q), li * self.model.pool_size + rows] = w
                out["tasks"].append(t)
                out["task-alpha"].append(alphas.mean(axis=0))
                out["task-count"].append(len(index))
                labels = labels_all[index]
                for c in np.unique(labels):  # a class in both measured tasks (random tasks) pools its samples
                    mask = labels == c
                    total = by_class.setdefault(int(c), [np.zeros(width), 0])
                    total[0] += alphas[mask].sum(axis=0)
                    total[1] += int(mask.sum())
        finally:
            prompt.train(was_training)
        for c, (total, count) in sorted(by_class.items()):
            out["classes"].append(c)
            out["class-alpha"].append(total / count)
            out["class-count"].append(count)
        return to_array_record(
            {
                "tasks": np.asarray(out["tasks"], dtype=np.int64),
                "task-alpha": np.asarray(out["task-alpha"], dtype=np.float64).reshape(-1, width),
                "task-count": np.asarray(out["task-count"], dtype=np.int64),
                "classes": np.asarray(out["classes"], dtype=np.int64),
                "class-alpha": np.asarray(out["class-alpha"], dtype=np.float64).reshape(-1, width),
                "class-count": np.asarray(out["class-count"], dtype=np.int64),
            }
        )

    @torch.no_grad()
    def teacher_logits(self, batch: Batch) -> torch.Tensor:
        """Logits of the round-start model on the batch, masked like the student's."""
        model = self.rt.model
        prompt, head = model.prompt, model.head
        assert self.teacher is not None, "teacher_logits before round_start"
        model.prompt, model.head = self.teacher  # type: ignore[assignment]
        try:
            logits = model.logits(model.features(batch.images, batch.query))
        finally:
            model.prompt, model.head = prompt, head
        return logits.masked_fill(~torch.isfinite(batch.logits), float("-inf"))

    def extra_loss(self, batch: Batch, task: int) -> torch.Tensor | None:
        if self.teacher is None:
            return None
        teacher = self.teacher_logits(batch)
        if self.opts.distillation == "classic":
            loss = classic_distillation(batch.logits, teacher, self.opts.temperature)
        else:
            total = self.class_total
            assert total is not None  # set by read_message, before any batch
            if batch.share != 1.0 and batch.step_labels is not None and batch.rows is not None:
                # a micro-batch: beta is a softmax over the whole step's samples; the loop weights
                # this micro-batch's part by its share, which the division undoes
                beta = sample_weights(total, batch.step_labels)[batch.rows] / batch.share
            else:
                beta = sample_weights(total, batch.labels)
            loss = dual_distillation(batch.logits, teacher, batch.labels, beta, self.opts.temperature)
        self.last_distillation = float(loss.detach())
        return self.opts.lambda_ * loss


__all__ = ["PowderLearner", "sample_weights"]
