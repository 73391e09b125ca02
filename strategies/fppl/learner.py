"""FPPL on the client: fused task prompts, unified-representation loss, local prototypes.

FPPL ("Federated Prototype-Augmented Prompt Learning", section IV-A/B):

* one prompt ``p_t`` (L x D per prompted block) per task; a new task's prompt starts
  as a copy of the previous one, finished tasks' prompts are frozen;
* a cosine-linear layer ``g_psi: D -> T`` on the query ``q(x)``; a softmax over the
  tasks seen so far weighs the task prompts, whose weighted sum is the block's prompt (eq. 2);
* loss = CE + L_ur, where L_ur is an InfoNCE between the prompted feature ``c_x`` and
  the global prototypes of the current task's classes, cosine similarity over a
  temperature tau = 0.2 (eq. 6-8);
* after local training, the per-class mean features (local prototypes, eq. 3) are
  uploaded next to the prompts, the fusion layer and the head; with augmentation on they
  are taken over one augmented view of each image, as the authors' code does (option
  ``prototype-views``).

The pieces both sides share (the prompt module, the options, the record names) are this
folder's ``prompt.py``, ``options.py`` and ``records.py``, as every method's are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import RecordDict

from ...common.model.runtime import Runtime
from ...common.records import CONFIG, arrays_of, as_int, to_array_record
from ..platform.learner import Batch, LocalLearner
from .options import FPPLOptions
from .prompt import FPPLPrompt, task_prompt_names
from .records import GLOBAL_PROTOTYPES, LOCAL_PROTOTYPES


# ---------------------------------------------------------------------------- losses
def unified_representation_loss(
    features: torch.Tensor, labels: torch.Tensor, proto_classes: torch.Tensor,
    proto_means: torch.Tensor, temperature: float, counted: int | None = None,
) -> torch.Tensor | None:
    """L_ur (eq. 6): InfoNCE of each feature against the global prototypes, cosine / tau.

    The positive is the prototype of the sample's class; the negatives are the other
    given prototypes (the server sends those of the current task's classes). Samples
    whose class has no global prototype are left out (the authors' code does the same);
    None when no sample has one. Averaged over the samples that count.

    Parameters
    ----------
    features : (B, D) prompted features c_x.
    labels : (B,) class labels.
    proto_classes : (C,) classes of the prototypes.
    proto_means : (C, D) global prototypes G^y.
    temperature : tau.
    counted : the number of samples to average over (a micro-batch's step: the step's samples
        with a prototype); None: those of ``labels``.
    """
    # Position of each label among the prototypes' classes (-1: no prototype).
    match = labels[:, None] == proto_classes[None, :].to(labels.device)
    has = match.any(dim=1)
    if not bool(has.any()):
        return None
    target = match[has].float().argmax(dim=1)
    sims = F.normalize(features[has], dim=-1) @ F.normalize(proto_means.to(features), dim=-1).T
    if counted is not None:
        return F.cross_entropy(sims / temperature, target, reduction="sum") / max(counted, 1)
    return F.cross_entropy(sims / temperature, target)


@torch.no_grad()
def local_prototypes(
    rt: Runtime, index: np.ndarray, batch_size: int = 256,
    inputs: Callable[[np.ndarray], torch.Tensor] | None = None, labels: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class mean prompted feature over the training samples ``index`` (eq. 3).

    Uses the model as it is (call after training, with the task set); eval mode. ``inputs``
    maps a uint8 batch to model inputs (an augmented view: q(x) is then computed on the view);
    None: the stored images, preprocessed (query cache allowed). ``labels``: the samples' labels as
    the fit sees them (``LocalLearner.labels_of``: a label-flipping client's flipped); None: the data's.

    Returns
    -------
    classes : (C,) int64, the classes present, ascending.
    means : (C, D) float32, C_k^y.
    counts : (C,) int64, |D_k^y|.
    """
    model = rt.model
    model.eval()
    labels = rt.data.train.labels[index] if labels is None else labels
    classes, position = np.unique(labels, return_inverse=True)
    sums = torch.zeros(len(classes), model.embed_dim, dtype=torch.float64)
    queries = rt.queries("train", index) if inputs is None else None
    for start in range(0, len(index), batch_size):
        sel = slice(start, start + batch_size)
        images = rt.data.train.images[index[sel]]
        x = model.preprocess(torch.from_numpy(images).to(rt.device)) if inputs is None else inputs(images)
        q = queries[sel] if queries is not None else model.query(x)
        feats = model.features(x, q).double().cpu()
        sums.index_add_(0, torch.as_tensor(position[sel], dtype=torch.long), feats)
    counts = np.bincount(position, minlength=len(classes)).astype(np.int64)
    means = (sums / torch.from_numpy(counts).double()[:, None]).float().numpy()
    return classes.astype(np.int64), means, counts


# ---------------------------------------------------------------------------- learner
class FPPLLearner(LocalLearner):
    """FPPL's local learning: CE + L_ur on the fused-prompt features; uploads local prototypes.

    The shared loop trains ``prompt.*`` (the current task's prompt, psi) and the head;
    this class adds L_ur (``extra_loss``), reads the global prototypes the server sent
    (``round_start``) and returns the local prototypes (``round_end``).
    """

    opts: FPPLOptions

    def __init__(self, **inputs: Any) -> None:  # LocalLearner's keyword inputs (made by ``of``)
        super().__init__(**inputs)
        self.proto_classes: torch.Tensor | None = None
        self.proto_means: torch.Tensor | None = None
        self.client_id = -1

    def round_start(self, content: RecordDict, task: int) -> None:
        """Freeze or free the fusion scale; keep the global prototypes of this task's classes."""
        prompt = self.rt.model.prompt
        if not isinstance(prompt, FPPLPrompt):
            raise TypeError(f"FPPL needs the model built with FPPLPrompt, got {type(prompt).__name__}")
        prompt.fusion_scale.requires_grad_(self.opts.fusion_scale == "learnable")
        self.proto_classes = self.proto_means = None
        config = content.config_records.get(CONFIG)
        self.client_id = as_int(config["client-id"]) if config is not None and "client-id" in config else -1
        if not self.opts.unified_loss or GLOBAL_PROTOTYPES not in content.array_records:
            return  # e.g. the first round of a task: no global prototype of its classes yet
        record = arrays_of(content, GLOBAL_PROTOTYPES)
        classes = record["classes"].numpy().astype(np.int64)
        means = record["means"].numpy()
        keep = np.isin(classes, self.rt.layout.classes(task))
        keep &= np.isfinite(means).all(axis=1)
        if keep.any():
            self.proto_classes = torch.from_numpy(classes[keep]).to(self.rt.device)
            self.proto_means = torch.from_numpy(np.array(means[keep], dtype=np.float32)).to(self.rt.device)

    def extra_loss(self, batch: Batch, task: int) -> torch.Tensor | None:
        """ur-weight * L_ur (eq. 6), or None without global prototypes or with the loss switched off."""
        if not self.opts.unified_loss or self.proto_means is None:
            return None
        counted = None
        assert self.proto_classes is not None  # set with the means by round_start
        if batch.share != 1.0 and batch.step_labels is not None:
            # a micro-batch: averaged over the step's samples that have a prototype, not its own
            counted = int((batch.step_labels[:, None] == self.proto_classes[None, :].to(batch.labels.device))
                          .any(dim=1).sum())
        loss = unified_representation_loss(
            batch.features, batch.labels, self.proto_classes, self.proto_means, self.opts.temperature, counted
        )
        if loss is not None and counted is not None:
            loss = loss / batch.share  # the loop weights it by the share again: the step's mean
        return None if loss is None else self.opts.ur_weight * loss

    def uploaded(self, state: dict[str, torch.Tensor], task: int) -> dict[str, torch.Tensor]:
        """Every array but the frozen prompts of the other tasks: of each ``prompt.p<layer>``
        (T, L, D) only row ``task`` (1, L, D), the one this client trained."""
        rows = self.rt.model.prompt.slice_of(task)
        return {name: value[rows] if name in task_prompt_names(self.model.layers) else value
                for name, value in state.items()}

    def round_end(self, index: np.ndarray, task: int) -> dict[str, Any]:
        """Upload C_k^t: the per-class mean features of this client's data, with their counts.

        The client id goes along so the server can keep the latest prototypes per client.
        With ``augment`` on and ``fppl.prototype-views = "augmented"`` (default; the authors'
        code averages over one pass of its training loader, the paper is silent), each image
        is seen through one augmented view of its own seeded stream; ``"stored"``: the stored
        images, the evaluation's inputs.
        """
        augment = self.augmentation(0x9207) if self.opts.prototype_views == "augmented" else None
        inputs = None if augment is None else (lambda images: self.inputs(images, augment))
        classes, means, counts = local_prototypes(self.rt, index, inputs=inputs, labels=self.labels_of(index, task))
        return {
            LOCAL_PROTOTYPES: to_array_record(
                {"classes": classes, "means": means, "counts": counts, "client": np.array([self.client_id], np.int64)}
            )
        }


__all__ = [
    "FPPLOptions",
    "FPPLPrompt",
    "FPPLLearner",
    "unified_representation_loss",
    "local_prototypes",
    "LOCAL_PROTOTYPES",
    "GLOBAL_PROTOTYPES",
]
