"""Local learning on a client: the one training loop every method shares.

``LocalLearner`` is FedAvg-Prompt's client (CODA-P, cross-entropy over the current task's
classes). The platform owns the loop (:meth:`LocalLearner.fit` and its pieces, ``SEALED``: a
subclass that overrides one is refused with a TypeError, as ``PromptStrategy`` refuses one that
overrides Flower's contract); a method changes local learning by filling hooks, in the order
a fit calls them:

* ``received(content, task, round_, client_id)``  the full-size arrays to start from (Powder
  completes its partial payload)
* ``round_start(content, task)``  read extra records the server sent (prototypes, known tasks, ...)
* ``held_out(index)``  samples held out of training for validation (Fed-CPrompt's early stopping)
* ``learning_rate(name, task)``  a trainable parameter's own learning rate (PILoRA's prototypes)
* ``extra_loss(batch, task)``  add a term to the loss of each batch
* ``epoch_end(epoch, validation, task)``  after each local epoch; True stops training there
* ``round_end(index, task)``  extra records to upload, from the trained samples (statistics, ...)
* ``uploaded(state, task)``  the trained parameters the reply carries (FPPL, Powder: their own part)
* ``reply_metrics()``  the method's own fields of the reply's metrics
* ``reply_records()``  records every reply of the fit carries, samples or none (Powder's alphas)
* ``round_cleanup()``  in a ``finally``: no round state left on the process's shared model
* ``answer(content, task, round_, client_id)``  reply to a message before training (Powder's
  measuring step; not part of a fit)

Training-time augmentation (``augment``) lives here too, for every method: each batch
is augmented with views drawn from a generator seeded by (seed, client, task, round),
and q(x) is computed on the augmented images (the query cache holds the stored images').
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ...common.config import sections as sections
from ...common.config.experiment import ExperimentConfig
from ...common.config.options import MethodOptions, NoOptions
from ...common.data.augment import augment_images
from ...common.data.partitions import client_indices
from ...common.model.preprocess import random_resized_crops
from ...common.model.prompted import masked_logits
from ...common.model.runtime import Runtime
from ...common.node.memory_plan import TrainingPlan
from ...common.privacy import PrivacyOptions, privacy_options
from ...common.records import ARRAYS, METRICS, as_int, to_array_record, to_torch
from ..registry import Declared
from .collusion import flipped_labels

log = logging.getLogger("promptfcl")

#: the loop's pieces: the platform's, never a method's (LocalLearner.__init_subclass__ refuses a
#: subclass that overrides one; a method fills the hooks instead)
SEALED = frozenset({"fit", "_train", "_parameter_groups", "step", "inputs", "augmentation", "update_reference",
                    "_reply"})
#: what a method fills, in the order a fit calls them (``answer``: outside a fit); the module's
#: docstring and docs/extending.md list each (a test keeps them so)
HOOKS = ("received", "round_start", "held_out", "learning_rate", "extra_loss", "epoch_end", "round_end", "uploaded",
         "reply_metrics", "reply_records", "round_cleanup", "answer")


@dataclass
class Batch:
    """One training batch and what the forward pass made of it."""

    images: torch.Tensor  # preprocessed (B, C, H, W)
    labels: torch.Tensor  # (B,) the head rows of the true classes (the classes themselves with a per-class head)
    query: torch.Tensor  # (B, D)
    features: torch.Tensor  # prompted pre-logit features (B, D)
    logits: torch.Tensor  # masked to the current task's head rows (B, head outputs)
    # a micro-batch of the optimiser's step (a node's memory plan): its share of the step's images;
    # the labels of the whole step and this micro-batch's rows among them. The loop weights the
    # micro-batch's loss by ``share``, so a loss that averages over samples needs nothing more; one
    # whose terms couple the step's samples reads ``step_labels`` (Powder's weights, FPPL's count).
    share: float = 1.0
    step_labels: torch.Tensor | None = None
    rows: slice | None = None


@dataclass(frozen=True)
class FitConditions:
    """What the node decides for one fit, passed to it (:meth:`LocalLearner.fit`): its memory
    ``plan`` (micro-batches; the default: whole batches) and whether it trains on its task's
    classes reversed (``flip_labels``: ``fault = "label-flip"`` chose this client)."""

    plan: TrainingPlan = field(default_factory=TrainingPlan)
    flip_labels: bool = False


class LocalLearner:
    """FedAvg-Prompt local learning (CODA-P prompts + linear head, CE on the current task).

    Made by :meth:`of`; it takes what it reads, never the whole configuration: six sections,
    ``privacy`` (``dp.*``) and the process's ``runtime`` (data, model, device, query cache).

    Parameters
    ----------
    runtime : Runtime
        Data, model, device and query cache of this process.
    options : MethodOptions or mapping, optional
        The method's options, parsed (a mapping of ``<method>.*`` keys, prefix removed, is
        parsed with ``options_class``; None: the defaults).
    """

    #: the method's options dataclass, declared once in its ``Method`` (the strategy's, read without it)
    options_class: Declared[type[MethodOptions]] = Declared("options", NoOptions)

    @classmethod
    def of(cls, cfg: ExperimentConfig, runtime: Runtime, options: MethodOptions | Mapping[str, Any] | None = None,
           privacy: PrivacyOptions | None = None) -> Self:
        """The learner of run ``cfg`` on ``runtime`` (the one place it reads the whole configuration;
        ``privacy``: its ``dp.*`` options, already parsed, or None: parsed here)."""
        return cls(run=cfg.run, data=cfg.data, federation=cfg.federation, model=cfg.model, training=cfg.training,
                   evaluation=cfg.evaluation, privacy=privacy if privacy is not None else privacy_options(cfg),
                   runtime=runtime, options=options)

    def __init__(self, *, run: sections.RunSection, data: sections.DataSection,
                 federation: sections.FederationSection, model: sections.ModelSection,
                 training: sections.TrainingSection, evaluation: sections.EvaluationSection, privacy: PrivacyOptions,
                 runtime: Runtime, options: MethodOptions | Mapping[str, Any] | None = None) -> None:
        self.rt = runtime
        self.run, self.data, self.federation, self.model = run, data, federation, model
        self.training, self.evaluation = training, evaluation
        self.privacy = privacy  # the run's dp.* options
        self.opts: Any = options if isinstance(options, MethodOptions) else \
            self.options_class.from_options(options or {})
        self.seed: list[int] = [self.run.seed]  # [seed, client, task, round] of the current fit (set by fit)
        self.conditions = FitConditions()  # the current fit's (set by fit for its duration; the default outside)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = SEALED & set(vars(cls))
        if overridden:
            raise TypeError(f"{cls.__name__} overrides {sorted(overridden)}: the platform owns the training loop; "
                            "fill the hooks instead (strategies/platform/learner.py)")

    # ------------------------------------------------------------------ hooks
    def received(self, content: RecordDict, task: int, round_: int, client_id: int) -> ArrayRecord:
        """The full-size trainable arrays this fit starts from (hook; default: the message's
        ``arrays`` as they are). A method whose server sends part of them completes them here
        (Powder: its local pool and task rows), reading what else it needs from ``content``."""
        return content.array_records[ARRAYS]

    def round_start(self, content: RecordDict, task: int) -> None:
        """Read method-specific records sent by the server."""

    def learning_rate(self, name: str, task: int) -> float | None:
        """The learning rate of trainable parameter ``name`` (the model's parameter name, e.g.
        ``head.weight``, ``prompt.lora_q0_a``) in this fit (hook; None: the run's ``lr``). A method
        whose paper trains parts at different rates (PILoRA's prototypes and adapters) says so."""
        return None

    def extra_loss(self, batch: Batch, task: int) -> torch.Tensor | None:
        """Extra loss term for one batch (None: plain cross-entropy)."""
        return None

    def round_end(self, index: np.ndarray, task: int) -> dict[str, Any]:
        """Extra records to upload, by record name."""
        return {}

    def held_out(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(trained on, held out for validation) of this fit's samples (hook; default: none held out).
        Only the samples trained on count in the reply's ``num-examples`` (its FedAvg weight)."""
        return index, index[:0]

    def reply_metrics(self) -> dict[str, int | float]:
        """The method's own fields of the reply's metrics (hook; its strategy declares them in
        ``reply_metrics``). Default: none."""
        return {}

    def reply_records(self) -> dict[str, Any]:
        """Records every reply of this fit carries, by record name, whether it trained on samples
        or had none (hook; :meth:`round_end`'s come from the trained samples and only with some).
        Powder: the alphas measured at the round's start. Default: none."""
        return {}

    def round_cleanup(self) -> None:
        """After every fit, in a ``finally`` (hook): the runtime and its model are shared by every
        message of the process, so no round state may stay behind (Fed-CPrompt's known tasks,
        Powder's local pool). Default: nothing to undo."""

    def epoch_end(self, epoch: int, validation: np.ndarray, task: int) -> bool:
        """After local epoch ``epoch`` (hook; ``validation``: the held-out samples): True stops the
        fit's local training there. Default: never."""
        return False

    def uploaded(self, state: dict[str, torch.Tensor], task: int) -> dict[str, torch.Tensor]:
        """The trained parameters the reply carries (hook; default: all of them). A method whose
        clients leave parts unchanged may send less (FPPL: the task's own prompt)."""
        return state

    def update_reference(self, received: ArrayRecord, task: int) -> ArrayRecord:
        """What a reply's arrays are an update of: the received arrays as :meth:`uploaded` would
        send them (differential privacy clips the difference)."""
        return to_array_record(self.uploaded(to_torch(received), task))

    def answer(self, content: RecordDict, task: int, round_: int, client_id: int) -> RecordDict:
        """Reply to an exchange before training (``PromptStrategy.configure_exchange``); only
        methods whose strategy requests one implement it."""
        raise NotImplementedError(f"{type(self).__name__} takes no exchange before training")

    # ------------------------------------------------------------------ the loop
    def fit(self, content: RecordDict, task: int, round_: int, client_id: int,
            conditions: FitConditions | None = None) -> RecordDict:
        """Train on this client's share of ``task`` starting from the arrays received; the reply.
        ``conditions``: the node's memory plan and label flipping for this fit (None: the defaults).

        The platform's loop (sealed): it calls the hooks (the module's docstring lists them, in
        order) and, however the fit ends, :meth:`round_cleanup`.
        """
        self.conditions = conditions or FitConditions()
        try:
            return self._train(content, task, round_, client_id)
        finally:
            self.round_cleanup()
            self.conditions = FitConditions()  # a later fit or answer starts from the defaults

    def _train(self, content: RecordDict, task: int, round_: int, client_id: int) -> RecordDict:
        """The fit but its cleanup (:meth:`fit`)."""
        rt, model = self.rt, self.rt.model
        started = time.perf_counter()
        index = client_indices(rt.data.train.labels, rt.layout, rt.partition, client_id, task, round_)

        self.seed = [self.run.seed, client_id, task, round_]  # seeds this fit's randomness (hooks may use it)
        model.load_trainable_state(to_torch(self.received(content, task, round_, client_id)))
        model.prompt.set_task(task)
        self.round_start(content, task)
        if len(index) == 0:
            # Nothing to learn from: reply zero examples, the server leaves this client out.
            return self._reply(index, task, started, losses=[])

        # the CE's rows: the task's (its own block with a per-task head); every seen class's
        # for the joint upper bound (stream tasks only, one row per class)
        joint = self.federation.centralised_mode == "joint"
        rows = rt.layout.training_classes(task) if joint else rt.layout.head_rows(task)
        allowed = torch.zeros(rt.layout.head_size, dtype=torch.bool)
        allowed[rows] = True
        seed = self.seed
        torch.manual_seed(int(np.random.default_rng(seed).integers(2**31 - 1)))
        rng = np.random.default_rng(seed + [0xBA7C4])
        augment = self.augmentation()

        optimizer = torch.optim.Adam(self._parameter_groups(task), lr=self.training.lr)
        trained, validation = self.held_out(index)
        steps = self.training.local_epochs * math.ceil(len(trained) / self.training.batch_size)
        scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
                     if self.training.lr_schedule == "cosine" else None)
        # CODA-P's schedule steps once per epoch: each group's rate is its base (the learning_rate
        # hook's) times the factor, re-made every fit as CODA-P's code re-makes it every task
        epochs_k = self.training.lr_schedule_epochs or self.training.local_epochs
        per_epoch = (torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: codap_cosine(e, epochs_k))
                     if self.training.lr_schedule == "codap-cosine" else None)
        # (n, D) on device, or None: computed per batch. An augmented image has its own q(x),
        # so the cache (queries of the stored images) serves only unaugmented training.
        queries = rt.queries("train", trained) if augment is None else None
        images = rt.data.train.images
        labels = torch.as_tensor(rt.layout.head_targets(task, self.labels_of(trained, task)))

        model.train()
        losses: list[float] = []
        for epoch in range(self.training.local_epochs):
            order = rng.permutation(len(trained))
            for start in range(0, len(order), self.training.batch_size):
                pos = order[start : start + self.training.batch_size]
                x = self.inputs(images[trained[pos]], augment)
                y = labels[pos].to(rt.device)
                optimizer.zero_grad(set_to_none=True)
                loss = self.step(x, y, queries[pos] if queries is not None else None, allowed, task)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                losses.append(loss)
            if self.epoch_end(epoch, validation, task):
                break
            if per_epoch is not None:
                per_epoch.step()
            model.train()
        model.eval()
        return self._reply(index, task, started, losses, examples=len(trained))

    def _parameter_groups(self, task: int) -> list[dict[str, Any]]:
        """The trainable parameters, one optimiser group per learning rate (``learning_rate``)."""
        groups: dict[float, list[torch.nn.Parameter]] = {}
        for name, param in self.rt.model.named_parameters():
            if param.requires_grad:
                rate = self.learning_rate(name, task)
                groups.setdefault(self.training.lr if rate is None else float(rate), []).append(param)
        return [{"params": params, "lr": rate} for rate, params in groups.items()]

    def step(self, x: torch.Tensor, y: torch.Tensor, queries: torch.Tensor | None, allowed: torch.Tensor,
             task: int) -> float:
        """One optimiser step's gradient (accumulated in the parameters' ``grad``) and its loss.

        In micro-batches of the plan's size where a node's memory budget asks for them: each
        micro-batch's loss weighted by its share of the step, so the accumulated gradient is the
        whole batch's (cross-entropy and every per-sample mean; float rounding aside).
        """
        rt, model = self.rt, self.rt.model
        micro = self.conditions.plan.micro_batch or len(y)
        total = 0.0
        for start in range(0, len(y), micro):
            rows = slice(start, start + micro)
            share = 1.0 if micro >= len(y) else len(y[rows]) / len(y)
            xs, ys = (x, y) if share == 1.0 else (x[rows], y[rows])
            with rt.autocast():
                q = queries[rows] if queries is not None else model.query(xs)
                feats = model.features(xs, q)
                logits = masked_logits(model.logits(feats), allowed)
                loss = F.cross_entropy(logits, ys)
                extra = self.extra_loss(Batch(xs, ys, q, feats, logits, share, y, rows), task)
                if extra is not None:
                    loss = loss + extra
                if share != 1.0:
                    loss = loss * share
            loss.backward()
            total += float(loss.detach())
        return total

    @torch.no_grad()
    def accuracy(self, index: np.ndarray, task: int, batch_size: int = 256) -> float:
        """Accuracy of the model as it stands on training samples ``index``, among ``task``'s head
        rows (what local training optimises; validation for early stopping), on the evaluation's
        inputs (``eval-crop``). Leaves the model in eval mode."""
        return self.correct(index, task, batch_size) / max(len(index), 1)

    def labels_of(self, index: np.ndarray, task: int) -> np.ndarray:
        """The labels of training samples ``index`` as this fit sees them: its data's, or with
        ``fault = "label-flip"`` the task's classes reversed, in everything computed from them
        (targets, validation, every statistic a method uploads), as a relabelled dataset would."""
        true = self.rt.data.train.labels[index]
        return flipped_labels(true, self.rt.layout.classes(task)) if self.conditions.flip_labels else true

    @torch.no_grad()
    def correct(self, index: np.ndarray, task: int, batch_size: int = 256) -> int:
        """How many of training samples ``index`` the model classifies right among ``task``'s head
        rows, each image taken as evaluation takes a test image (``eval-crop``: validation scores
        what evaluation scores). Leaves the model in eval mode."""
        layout = self.rt.layout
        targets = torch.as_tensor(layout.head_targets(task, self.labels_of(index, task)))
        correct = 0
        for rows, logits in self._validation_logits(index, layout.head_rows(task), batch_size):
            correct += int((logits.argmax(1).cpu() == targets[rows]).sum())
        return correct

    @torch.no_grad()
    def validation_loss(self, index: np.ndarray, task: int, batch_size: int = 256) -> float:
        """Mean cross-entropy of training samples ``index`` (of ``task``) over the head rows of every
        task up to ``task`` (Fed-CPrompt's code validates over the first (t + 1) x 10 logits), each
        image taken as evaluation takes it. Leaves the model in eval mode."""
        layout = self.rt.layout
        seen = np.unique(np.concatenate([layout.head_rows(t) for t in range(task + 1)]))
        targets = torch.as_tensor(layout.head_targets(task, self.labels_of(index, task)))
        total = 0.0
        for rows, logits in self._validation_logits(index, seen, batch_size):
            total += float(F.cross_entropy(logits, targets[rows].to(logits.device), reduction="sum"))
        return total / max(len(index), 1)

    def _validation_logits(self, index: np.ndarray, allowed_rows: np.ndarray,
                           batch_size: int) -> Iterator[tuple[slice, torch.Tensor]]:
        """(positions in ``index``, float32 logits masked to ``allowed_rows``) per batch of training
        samples ``index``, each image preprocessed as evaluation preprocesses a test image."""
        rt, model = self.rt, self.rt.model
        model.eval()
        allowed = torch.zeros(rt.layout.head_size, dtype=torch.bool)
        allowed[allowed_rows] = True
        # the training split's query cache holds the uncropped images' q(x): valid while the
        # evaluation takes the whole image
        queries = rt.queries("train", index) if self.evaluation.eval_crop >= 1.0 else None
        for start in range(0, len(index), batch_size):
            images = rt.data.train.images[index[start : start + batch_size]]
            x = model.preprocess(torch.from_numpy(images).to(rt.device), evaluation=True)
            with rt.autocast():
                q = queries[start : start + batch_size] if queries is not None else model.query(x)
                logits = masked_logits(model(x, q).float(), allowed)
            yield slice(start, start + batch_size), logits

    def augmentation(self, stream: int = 0xA06) -> np.random.Generator | None:
        """A random source of augmented views for this fit (None: ``augment = "none"``).

        Seeded by (seed, client, task, round), like the batch order, and ``stream`` (a hook
        that needs views of its own, such as HGP's statistics pass, takes another stream), so
        the same fit sees the same views in any process.
        """
        if self.training.augment == "none":
            return None
        return np.random.default_rng(list(self.seed) + [stream])

    def inputs(self, images: np.ndarray, augment: np.random.Generator | None) -> torch.Tensor:
        """Preprocessed model inputs of a uint8 batch, augmented first when ``augment`` is given."""
        crops = None
        if augment is not None and self.training.augment == "resized-crop-flip":  # cropped on the device
            crops = torch.from_numpy(random_resized_crops(len(images), images.shape[-2], images.shape[-1], augment,
                                                          scale=(self.training.augment_crop_scale, 1.0)))
        elif augment is not None:
            images = augment_images(images, self.training.augment, augment)
        return self.rt.model.preprocess(torch.from_numpy(images).to(self.rt.device), crops)

    def _reply(self, index: np.ndarray, task: int, started: float, losses: list[float],
               examples: int | None = None) -> RecordDict:
        extras = self.round_end(index, task) if len(index) else {}
        metrics = MetricRecord({
            "num-examples": int(len(index) if examples is None else examples),
            "train-loss": float(np.mean(losses)) if losses else 0.0,
            "train-seconds": time.perf_counter() - started,
        })
        for key, value in self.reply_metrics().items():
            metrics[key] = value
        if self.rt.device.type == "cuda":  # what the round needed on the GPU (benchmarks, sizing actors per GPU)
            metrics["device-peak-mb"] = torch.cuda.max_memory_allocated(self.rt.device) / 1e6
        reply = RecordDict({ARRAYS: to_array_record(self.uploaded(self.rt.model.trainable_state(), task)),
                            METRICS: metrics})
        for name, record in extras.items():
            reply[name] = record
        for name, record in self.reply_records().items():
            reply[name] = record
        return reply


def codap_cosine(epoch: int, epochs: int) -> float:
    """The factor of the base rate at local epoch ``epoch`` (from 0) of ``lr-schedule = codap-cosine``:
    CODA-P's CosineSchedule (CODA-Prompt utils/schedulers.py; the same class in Fed-CPrompt's and
    Powder's code), cos(99 pi e / (200 (K - 1))) over K = ``epochs``: 1 at epoch 0, cos(0.495 pi)
    = 0.0157 at epoch K - 1. K = 1 is constant (the code's formula divides by zero there)."""
    if epochs <= 1:
        return 1.0
    return math.cos(99 * math.pi * epoch / (200 * (epochs - 1)))


def read_task_round(config: ConfigRecord) -> tuple[int, int, int]:
    """(task, round within task, client id) from a train message's config."""
    try:
        return as_int(config["task"]), as_int(config["round"]), as_int(config["client-id"])
    except KeyError as exc:
        raise ValueError(f"train message config lacks {exc}") from None


__all__ = ["HOOKS", "SEALED", "Batch", "LocalLearner", "codap_cosine", "read_task_round"]
