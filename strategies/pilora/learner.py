"""PILoRA on the client: DCE + prototype, orthogonality and L1 losses; class means of the round.

The loss of a batch at task t (the authors' ``update.py`` with ``CPN.py``; fed-mammoth's
``PiLora.observe``):

    CE(-d(f, c) / T, y) + lambda mean_b d(f_b, c_{y_b})
      + gamma sum_{tau<t} (sum |A_t^q A_tau^q^T| + sum |A_t^v A_tau^v^T|) + mu (||A_t^q||_1 + ||A_t^v||_1)

The platform computes the first term over the task's classes (its masked cross-entropy on the
module's distance logits); with ``pilora.softmax-over = "all"`` (both codes) :meth:`extra_loss`
replaces it by the cross-entropy over every class's prototype, those outside the task frozen, by
adding that and subtracting the platform's own term on the same logits (they cancel exactly,
value and gradient). Adam's weight decay of the codes is ``wd / 2 ||p||^2`` on the trained set and
prototypes. The class means are those of the detached features of every training batch over all
local epochs (both codes), or of one pass after training (``pilora.class-means``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import RecordDict

from ...common.records import CONFIG, as_int, to_array_record
from ..platform.learner import Batch, LocalLearner
from .options import PILoRAOptions
from .prompt import PILoRAAdapters, l1_loss, orthogonality_loss, paired_distances, prototype_logits
from .records import CLASS_MEANS


class ClassSums:
    """Per-class sums of feature rows and how many rows each (float64, on the features' device)."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    def add(self, features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> None:
        f = features.detach().to(torch.float64)
        if self.sums is None or self.rows is None:
            self.sums = torch.zeros(num_classes, f.shape[1], dtype=torch.float64, device=f.device)
            self.rows = torch.zeros(num_classes, dtype=torch.float64, device=f.device)
        self.sums.index_add_(0, labels.to(f.device), f)
        self.rows.index_add_(0, labels.to(f.device), torch.ones(len(labels), dtype=torch.float64, device=f.device))

    def means(self, min_rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """(classes with at least ``min_rows`` rows, their means (C, ``dim``) float32)."""
        if self.sums is None or self.rows is None:
            return np.zeros(0, np.int64), np.zeros((0, dim), np.float32)
        rows = self.rows.cpu().numpy()
        classes = np.flatnonzero(rows >= min_rows).astype(np.int64)
        means = (self.sums.cpu().numpy()[classes] / rows[classes, None]).astype(np.float32)
        return classes, means


def round_cosine(round_: int, rounds: int) -> float:
    """The factor of both rates in round ``round_`` (from 0) of a task of ``rounds`` rounds, as the
    authors' loop computes it (Ghy0501/PILoRA, ``PILoRA-cifar/VITLORA.py``, ``train``): after round e
    it sets the next round's rates to ``base (1 + cos(e pi / E)) / 2``, so round 0 runs at the base
    rate and round r >= 1 at ``(1 + cos((r - 1) pi / E)) / 2``: 1, 1, 0.75 at E = 3."""
    return 1.0 if round_ == 0 else 0.5 * (1.0 + math.cos(math.pi * (round_ - 1) / rounds))


class PILoRALearner(LocalLearner):
    """PILoRA's local learning (module docstring): the shared loop trains the current LoRA set and
    the head's rows (the prototypes; only the task's receive a gradient) at their own rates."""

    opts: PILoRAOptions

    def __init__(self, **inputs: Any) -> None:  # LocalLearner's keyword inputs (made by ``of``)
        super().__init__(**inputs)
        self.class_sums = ClassSums()
        self.client_id = -1

    @property
    def adapters(self) -> PILoRAAdapters:
        prompt = self.rt.model.prompt
        assert isinstance(prompt, PILoRAAdapters), "PILoRA's learner needs its own adapters"
        return prompt

    def round_start(self, content: RecordDict, task: int) -> None:
        self.class_sums = ClassSums()
        config = content.config_records.get(CONFIG)
        self.client_id = as_int(config["client-id"]) if config is not None and "client-id" in config else -1

    def learning_rate(self, name: str, task: int) -> float | None:
        """Prototypes (``head.weight``) at ``prototype-lr``, the LoRA sets at ``lora-lr``, each times the
        authors' cosine over the task's rounds (``round-schedule``, :func:`round_cosine`)."""
        base = self.opts.prototype_lr if name == "head.weight" else \
            self.opts.lora_lr if name.startswith("prompt.lora_") else None
        if base is None:
            return None
        if self.opts.round_schedule == "cosine":
            round_ = self.seed[3] if len(self.seed) > 3 else 0
            base *= round_cosine(round_, self.federation.rounds_per_task)
        return base

    def extra_loss(self, batch: Batch, task: int) -> torch.Tensor | None:
        opts, model = self.opts, self.rt.model
        if opts.class_means == "training-batches":
            self.class_sums.add(batch.features, batch.labels, self.rt.layout.head_size)
        prototypes = model.head.weight
        terms: list[torch.Tensor] = []
        if opts.softmax_over == "all":
            rows = torch.zeros(len(prototypes), dtype=torch.bool, device=prototypes.device)
            rows[torch.as_tensor(self.rt.layout.head_rows(task), device=prototypes.device)] = True
            frozen_elsewhere = torch.where(rows[:, None], prototypes, prototypes.detach())
            logits = prototype_logits(batch.features, frozen_elsewhere, opts.temperature)
            terms.append(F.cross_entropy(logits, batch.labels) - F.cross_entropy(batch.logits, batch.labels))
        if opts.pl > 0:
            terms.append(opts.pl * paired_distances(batch.features, prototypes[batch.labels]).mean())
        if opts.lora:
            adapters = self.adapters
            if opts.ortho > 0 and task > 0:
                terms.append(opts.ortho * orthogonality_loss(adapters, task).to(batch.features.device))
            if opts.l1 > 0:
                terms.append(opts.l1 * l1_loss(adapters, task).to(batch.features.device))
        if opts.weight_decay > 0:
            trained = [prototypes[torch.as_tensor(self.rt.layout.head_rows(task), device=prototypes.device)]]
            trained += self.adapters.task_parameters(task) if opts.lora else []
            terms.append(0.5 * opts.weight_decay * sum((p.float().square().sum() for p in trained),
                                                       torch.zeros((), device=prototypes.device)))
        return sum(terms[1:], terms[0]) if terms else None

    def round_end(self, index: np.ndarray, task: int) -> dict[str, Any]:
        """Upload the class means of this round (``pilora.class-means``) with each class's count of
        training samples (not of feature rows: a count is bounded by the reply's ``num-examples``)."""
        if self.opts.class_means == "separate-pass":
            self.class_sums = self.feature_pass(index, task)
        classes, means = self.class_sums.means(self.opts.min_class_count, self.rt.model.embed_dim)
        labels = self.rt.layout.head_targets(task, self.labels_of(index, task))
        counts = np.bincount(labels, minlength=self.rt.layout.head_size)[classes].astype(np.int64)
        return {CLASS_MEANS: to_array_record({
            "classes": classes, "means": means, "counts": counts, "client": np.array([self.client_id], np.int64)})}

    @torch.no_grad()
    def feature_pass(self, index: np.ndarray, task: int, batch_size: int = 256) -> ClassSums:
        """The features of the trained model on this client's stored images (the evaluation's inputs)."""
        rt, model = self.rt, self.rt.model
        model.eval()
        sums = ClassSums()
        labels = torch.as_tensor(rt.layout.head_targets(task, self.labels_of(index, task)))
        for start in range(0, len(index), batch_size):
            images = rt.data.train.images[index[start : start + batch_size]]
            x = model.preprocess(torch.from_numpy(images).to(rt.device), evaluation=True)
            with rt.autocast():
                feats = model.features(x, model.query(x))
            sums.add(feats, labels[start : start + batch_size], rt.layout.head_size)
        return sums

    def round_cleanup(self) -> None:
        self.class_sums = ClassSums()


__all__ = ["ClassSums", "PILoRALearner", "round_cosine"]
