"""FPPL on the client: fused task prompts, unified-representation loss, local prototypes.

FPPL (Federated Prototype-Augmented Prompt Learning, papers/002, section IV-A/B):

* one prompt ``p_t`` (L x D per prompted block) per task; a new task's prompt starts
  as a copy of the previous one, finished tasks' prompts are frozen;
* a cosine-linear layer ``g_psi: D -> T`` on the query ``q(x)``; a softmax over the
  tasks seen so far weighs the task prompts, whose weighted sum is the block's prompt (eq. 2);
* loss = CE + L_ur, where L_ur is an InfoNCE between the prompted feature ``c_x`` and
  the global prototypes of the current task's classes, cosine similarity over a
  temperature tau = 0.2 (eq. 6-8);
* after local training, the per-class mean features (local prototypes, eq. 3) are
  uploaded next to the prompts, the fusion layer and the head.

The module holds the pieces both sides share: the prompt module (:class:`FPPLPrompt`),
the method options (:class:`FPPLOptions`), the record names and the pure loss function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import RecordDict
from torch import nn

from client.learner import Batch, LocalLearner
from common.config import ConfigError, MethodOptions
from common.data import task_classes
from common.model import CodaPrompt
from common.records import CONFIG, to_array_record
from common.runtime import Runtime

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
    (shared/REFERENCE.md, "FPPL").

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


# ---------------------------------------------------------------------------- losses
def unified_representation_loss(
    features: torch.Tensor, labels: torch.Tensor, proto_classes: torch.Tensor,
    proto_means: torch.Tensor, temperature: float,
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
    """
    # Position of each label among the prototypes' classes (-1: no prototype).
    match = labels[:, None] == proto_classes[None, :].to(labels.device)
    has = match.any(dim=1)
    if not bool(has.any()):
        return None
    target = match[has].float().argmax(dim=1)
    sims = F.normalize(features[has], dim=-1) @ F.normalize(proto_means.to(features), dim=-1).T
    return F.cross_entropy(sims / temperature, target)


@torch.no_grad()
def local_prototypes(rt: Runtime, index: np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class mean prompted feature over the training samples ``index`` (eq. 3).

    Uses the model as it is (call after training, with the task set); eval mode.

    Returns
    -------
    classes : (C,) int64, the classes present, ascending.
    means : (C, D) float32, C_k^y.
    counts : (C,) int64, |D_k^y|.
    """
    model = rt.model
    model.eval()
    labels = rt.data.train.labels[index]
    classes, position = np.unique(labels, return_inverse=True)
    sums = torch.zeros(len(classes), model.embed_dim, dtype=torch.float64)
    queries = rt.queries("train", index)
    for start in range(0, len(index), batch_size):
        sel = slice(start, start + batch_size)
        x = model.preprocess(torch.from_numpy(rt.data.train.images[index[sel]]).to(rt.device))
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

    def __init__(self, runtime: Runtime, options: dict[str, Any] | None = None) -> None:
        super().__init__(runtime, options)
        self.opts = FPPLOptions.from_options(self.options)
        self.proto_classes: torch.Tensor | None = None
        self.proto_means: torch.Tensor | None = None
        self.client_id = -1

    def round_start(self, content: RecordDict, task: int) -> None:
        """Freeze or free the fusion scale; keep the global prototypes of this task's classes."""
        self.rt.model.prompt.fusion_scale.requires_grad_(self.opts.fusion_scale == "learnable")
        self.proto_classes = self.proto_means = None
        config = content.config_records.get(CONFIG)
        self.client_id = int(config["client-id"]) if config is not None and "client-id" in config else -1
        if not self.opts.unified_loss or GLOBAL_PROTOTYPES not in content.array_records:
            return  # e.g. the first round of a task: no global prototype of its classes yet
        record = content[GLOBAL_PROTOTYPES]
        classes = record["classes"].numpy().astype(np.int64)
        means = record["means"].numpy()
        keep = np.isin(classes, task_classes(self.cfg, task, self.rt.data.num_classes))
        keep &= np.isfinite(means).all(axis=1)
        if keep.any():
            self.proto_classes = torch.from_numpy(classes[keep]).to(self.rt.device)
            self.proto_means = torch.from_numpy(np.array(means[keep], dtype=np.float32)).to(self.rt.device)

    def extra_loss(self, batch: Batch, task: int) -> torch.Tensor | None:
        """ur-weight * L_ur (eq. 6), or None without global prototypes or with the loss switched off."""
        if not self.opts.unified_loss or self.proto_means is None:
            return None
        loss = unified_representation_loss(batch.features, batch.labels, self.proto_classes,
                                           self.proto_means, self.opts.temperature)
        return None if loss is None else self.opts.ur_weight * loss

    def round_end(self, index: np.ndarray, task: int) -> dict[str, Any]:
        """Upload C_k^t: the per-class mean features of this client's data, with their counts.

        The client id goes along so the server can keep the latest prototypes per client.
        """
        classes, means, counts = local_prototypes(self.rt, index)
        return {LOCAL_PROTOTYPES: to_array_record({
            "classes": classes, "means": means, "counts": counts,
            "client": np.array([self.client_id], np.int64)})}


__all__ = [
    "FPPLOptions", "FPPLPrompt", "FPPLLearner", "unified_representation_loss", "local_prototypes",
    "LOCAL_PROTOTYPES", "GLOBAL_PROTOTYPES",
]
