"""HePCo: heterogeneous prompt consolidation by latent generation and distillation at the server.

Paper: "Continual Adaptation of Vision Transformers for Federated Learning"
(Halbe et al., sections 5-6 and Appendix B).

Clients are FedAvg-Prompt clients with the paper's prompt variant (:class:`HePCoPrompt`:
components weighted by the cosine of the query with their keys). The server, every round:

1. provisional model ``w`` = average of the clients' prompts, keys and heads (sec. 5.2);
2. trains a conditional generator ``z = G(eps, y)`` in the D-dimensional *query* space
   for the current task's classes against the clients (eq. 5):
   ``min L_cls - lambda_KL L_KL - lambda_MSE L_MSE``;
3. trains a second generator for the past tasks' classes against the previous task's
   final server model (the only state the server keeps);
4. latent distillation (sec. 5.3): the provisional model's current prompt slice (keys and
   components) is fitted by MSE of its final prompts to each teacher's (clients on every
   latent, previous-task server on old-class latents only, eq. 6), and its head by
   cross-entropy on the same composite batch (current + ``replay_ratio`` old latents).

With asynchronous arrival (clients on two tasks in one round) the round's replies form one
teacher group per task (:class:`TaskTeachers`): the current-task generator and the
distillation cover the classes of every task trained in the round, a task's share of the
latents is its share of the replies, each client teaches the generator on its own task's
latents through its own slices, and the student trains the slices of all those tasks. The
past-task teacher is the server model at the previous task's nominal end.

Everything runs on ``(B, D)`` latents: the backbone is never needed at the server.
Vectorised over clients: teachers are stacked into ``(C, ...)`` tensors and every loss
is a batched einsum; prompt MSEs go through Gram matrices of the prompt components
(:class:`PromptGrams`), so no step forms the C x B x L x D teacher prompts.
Consolidation time per round is logged and returned in the round's MetricRecord
(``consolidation-seconds`` and its parts); the server loop's ``server_seconds`` includes it.

One generator or distillation "epoch" is one batch of pseudo-latents: there is no dataset
to pass over (the authors' code does the same).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from torch import nn

from promptfcl.common.config import ConfigError, ExperimentConfig, MethodOptions
from promptfcl.common.data import task_classes
from promptfcl.common.model import CodaPrompt, resolve_device
from promptfcl.common.records import ARRAYS, from_array_record, to_array_record
from promptfcl.strategies.platform.strategy import PromptStrategy

log = logging.getLogger("promptfcl")

#: Table 3 rows, as names for ``hepco.ablate`` (comma-separated, composable).
ABLATIONS = ("previous-model", "kl", "mse", "prompt-distillation", "classifier-distillation")


# ---------------------------------------------------------------------------- options
@dataclass
class HePCoOptions(MethodOptions):
    """``hepco.*`` run-config options (kebab-case keys), paper defaults (Appendix B).

    Attributes
    ----------
    noise_dim, label_embed_dim : int
        Generator input: noise (64) concatenated with a label embedding (64).
    generator_hidden : str
        Hidden widths, comma-separated: layer inputs [128, 256, 1024] -> D.
    generator_batchnorm : bool
        BatchNorm between generator layers (authors' code; the paper does not say).
    generator_epochs, generator_batch_size, generator_lr : int, int, float
        100 steps of 64 latents, Adam 1e-4.
    past_generator_epochs_per_task : int
        Extra steps per past task for the old-class generator (code: 50; paper: 0).
    distill_epochs, distill_batch_size, distill_lr : int, int, float
        200 steps, 64 current-task latents per step (+ replay), Adam 1e-4.
    lambda_kl, lambda_mse : float
        Weights of the maximised disagreement terms (1 and 0.1).
    replay_ratio : float
        Old-class latents per current-task latent in the composite batch (0.5).
    ablate : str
        Comma-separated Table 3 ablations, any of :data:`ABLATIONS`.
    averaging : str
        Provisional model: ``"uniform"`` (1/C sum, sec. 5.2 and the code) or
        ``"samples"`` (the platform's sample-weighted FedAvg).
    old_prompt_mean : str
        What the previous-task server's prompt MSE (eq. 6, the ``zeta`` term) is averaged
        over. ``"composite"`` (default, the paper): eq. 6 is a per-sample loss over the
        composite batch and ``zeta`` switches the teacher on for old-class samples, so the
        term is the old-latent mean scaled by the old share of the batch (1/3 at replay
        ratio 0.5). ``"old"``: the mean over the old latents alone, which weighs the
        previous-task teacher 1/share (3) times more than the paper.
    distill_generator_mode : str
        BatchNorm mode of the generators while they produce distillation latents.
        ``"eval"`` (default): running statistics, as the authors' code (the paper does not
        say, and the generator's BatchNorm is itself the code's). ``"train"``: each
        batch's own statistics.
    head_loss : str
        Cross-entropy of the head distillation over the composite batch. ``"ce"`` (default,
        sec. 5.3): plain mean over the batch, so each class weighs as often as it is drawn;
        at replay ratio 0.5 an old class gets 1/(2t) of a current class's latents at task
        t (0-indexed, equal-size tasks).
        ``"balanced"`` (not in the paper): each seen class drawn in the batch weighs the same,
        so the head is not pulled towards the current task by how often it is sampled.
    diagnostics : bool
        Also measure, every round, the consolidation against real data (a measurement,
        never fed back into training; needs the server's central data, so simulation
        with ``evaluation = "central"``): real queries and prompted features of up to
        ``diagnostics_per_class`` training images per seen class, their distance to the
        pseudo-latents, and the accuracy on the real prompted features of the provisional
        and distilled prompts x heads (see :class:`RealDataProbe`).
    diagnostics_per_class : int
        Real images and pseudo-latents per class for the diagnostics.
    """

    prefix = "hepco"

    noise_dim: int = 64
    label_embed_dim: int = 64
    generator_hidden: str = "256,1024"
    generator_batchnorm: bool = True
    generator_epochs: int = 100
    generator_batch_size: int = 64
    generator_lr: float = 1e-4
    past_generator_epochs_per_task: int = 0
    distill_epochs: int = 200
    distill_batch_size: int = 64
    distill_lr: float = 1e-4
    lambda_kl: float = 1.0
    lambda_mse: float = 0.1
    replay_ratio: float = 0.5
    ablate: str = ""
    averaging: str = "uniform"
    old_prompt_mean: str = "composite"
    distill_generator_mode: str = "eval"
    head_loss: str = "ce"
    diagnostics: bool = False
    diagnostics_per_class: int = 50

    # ---------------------------------------------------------------- derived switches
    @property
    def ablated(self) -> set[str]:
        return {a.strip() for a in self.ablate.split(",") if a.strip()}

    @property
    def use_previous(self) -> bool:
        return "previous-model" not in self.ablated

    @property
    def use_kl(self) -> bool:
        return "kl" not in self.ablated

    @property
    def use_mse(self) -> bool:
        return "mse" not in self.ablated

    @property
    def distill_prompts(self) -> bool:
        return "prompt-distillation" not in self.ablated

    @property
    def distill_head(self) -> bool:
        return "classifier-distillation" not in self.ablated

    @property
    def hidden(self) -> list[int]:
        return [int(v) for v in self.generator_hidden.split(",") if v.strip()]

    # ---------------------------------------------------------------- parsing
    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"hepco: {msg}")

        for name in ("noise_dim", "label_embed_dim", "generator_batch_size", "distill_batch_size"):
            need(getattr(self, name) >= 1, f"{name.replace('_', '-')} must be >= 1")
        for name in ("generator_epochs", "distill_epochs", "past_generator_epochs_per_task"):
            need(getattr(self, name) >= 0, f"{name.replace('_', '-')} must be >= 0")
        need(self.generator_lr > 0 and self.distill_lr > 0, "learning rates must be > 0")
        need(self.lambda_kl >= 0 and self.lambda_mse >= 0, "lambda-kl and lambda-mse must be >= 0")
        need(self.replay_ratio >= 0, f"replay-ratio must be >= 0, got {self.replay_ratio}")
        try:
            hidden = self.hidden
        except ValueError:
            raise ConfigError(f"hepco: generator-hidden must be comma-separated integers, got {self.generator_hidden!r}") from None
        need(len(hidden) >= 1 and all(h >= 1 for h in hidden), "generator-hidden needs at least one positive width")
        bad = self.ablated - set(ABLATIONS)
        need(not bad, f"unknown ablation(s) {sorted(bad)}; choose from {', '.join(ABLATIONS)}")
        need(self.averaging in ("uniform", "samples"), f"averaging must be 'uniform' or 'samples', got {self.averaging!r}")
        need(self.old_prompt_mean in ("composite", "old"),
             f"old-prompt-mean must be 'composite' or 'old', got {self.old_prompt_mean!r}")
        need(self.distill_generator_mode in ("eval", "train"),
             f"distill-generator-mode must be 'eval' or 'train', got {self.distill_generator_mode!r}")
        need(self.head_loss in ("ce", "balanced"), f"head-loss must be 'ce' or 'balanced', got {self.head_loss!r}")
        need(self.diagnostics_per_class >= 1, "diagnostics-per-class must be >= 1")


class HePCoPrompt(CodaPrompt):
    """The paper's decomposed prompting (sec. 5.1): ``p = sum_m cos(q, K_m) P_m``.

    CODA-P without attention vectors (the paper's client weights are ``{P, K}``, so
    none are created and none travel); task slices, freezing of earlier slices and
    orthogonal initialisation are CODA-P's, as the paper adapts L2P "as noted by
    Smith et al. (2022)".
    """

    kinds = "pk"  # no attention vectors

    def weights(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """alpha (B, M_active): cosine of the query with each active key."""
        keys = self._active("k", layer, self.training)
        return F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T

# ---------------------------------------------------------------------------- latent models
class LatentGenerator(nn.Module):
    """Conditional generator ``z = G(eps, y)`` in the query space (eq. 1, Appendix B).

    Label embedding concatenated with Gaussian noise, then a 3-layer MLP
    (layer inputs [noise + embed, *hidden]) with BatchNorm + ReLU between layers, output D.
    """

    def __init__(self, num_classes: int, out_dim: int, noise_dim: int = 64, embed_dim: int = 64,
                 hidden: list[int] | tuple[int, ...] = (256, 1024), batchnorm: bool = True) -> None:
        super().__init__()
        self.noise_dim = noise_dim
        self.embed = nn.Embedding(num_classes, embed_dim)
        layers: list[nn.Module] = []
        width = noise_dim + embed_dim
        for h in hidden:
            layers += [nn.Linear(width, h)] + ([nn.BatchNorm1d(h)] if batchnorm else []) + [nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, noise: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([self.embed(labels), noise], dim=1))

    def sample(self, labels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        noise = torch.randn(len(labels), self.noise_dim, generator=generator, device=labels.device)
        return self(noise, labels)


@dataclass
class Teachers:
    """C teacher models stacked for one batched pass: keys/prompts per layer and heads.

    ``keys[l]`` (C, M, D) L2-normalised; ``prompts[l]`` (C, M, L, D); ``head_w`` (C, N, D);
    ``head_b`` (C, N). M is the teachers' active components (slices up to their task).
    """

    keys: dict[int, torch.Tensor]
    prompts: dict[int, torch.Tensor]
    head_w: torch.Tensor
    head_b: torch.Tensor

    @classmethod
    def stack(cls, states: list[dict[str, np.ndarray]], layers: list[int], stop: int,
              device: torch.device) -> "Teachers":
        def cat(name: str, upto: int | None = None) -> torch.Tensor:
            return torch.stack([torch.from_numpy(np.array(s[name][:upto], dtype=np.float32)) for s in states]).to(device)

        return cls(
            keys={l: F.normalize(cat(f"prompt.k{l}", stop), dim=-1) for l in layers},
            prompts={l: cat(f"prompt.p{l}", stop) for l in layers},
            head_w=cat("head.weight"),
            head_b=cat("head.bias"),
        )

    def final_prompts(self, z: torch.Tensor, layer: int) -> torch.Tensor:
        """Each teacher's final prompt for latents ``z`` used as queries: (C, B, L, D)."""
        alpha = torch.einsum("bd,cmd->cbm", F.normalize(z, dim=-1), self.keys[layer])
        return torch.einsum("cbm,cmld->cbld", alpha, self.prompts[layer])

    def logits(self, z: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """Each teacher's head on ``z`` restricted to ``classes``: (C, B, |classes|)."""
        w, b = self.head_w[:, classes], self.head_b[:, classes]
        return torch.einsum("bd,cnd->cbn", z, w) + b[:, None, :]


@dataclass
class TaskTeachers:
    """The clients that trained one task in this round, stacked, with that task's classes.

    With asynchronous arrival a round has one group per task its clients trained; each
    client teaches on the latents of its own task's classes, through its own active slices.
    """

    classes: torch.Tensor  # the task's classes (a contiguous range)
    teachers: Teachers  # its clients, stacked up to their task's slices
    replies: int  # how many replies trained the task: its share of the latents

    def holds(self, labels: torch.Tensor) -> torch.Tensor:
        """Which of ``labels`` are this task's classes."""
        return (labels >= self.classes[0]) & (labels <= self.classes[-1])


def task_groups(classes: torch.Tensor, teachers: "Teachers | list[TaskTeachers]") -> list[TaskTeachers]:
    """``teachers`` as task groups: stacked teachers of one task (``classes``) make a single group."""
    return [TaskTeachers(classes, teachers, 1)] if isinstance(teachers, Teachers) else list(teachers)


def draw_labels(groups: list[TaskTeachers], n: int, rng: torch.Generator) -> torch.Tensor:
    """``n`` latent labels: uniform over one task's classes; over several tasks, a task's classes
    drawn in proportion to the replies that trained it (uniform within the task)."""
    if len(groups) == 1:
        classes = groups[0].classes
        return classes[torch.randint(len(classes), (n,), generator=rng, device=classes.device)]
    classes = torch.cat([g.classes for g in groups])
    weights = torch.cat([torch.full((len(g.classes),), g.replies / len(g.classes), dtype=torch.float64)
                         for g in groups]).to(classes.device)
    return classes[torch.multinomial(weights, n, replacement=True, generator=rng)]


class LatentStudent(nn.Module):
    """The provisional server model in the latent space: prompts of one task slice and the head.

    Only the current task's prompt slice (keys and components) is trainable, as on
    the clients; earlier slices stay fixed, so distillation cannot overwrite what
    earlier tasks learnt through the prompts.
    """

    def __init__(self, state: dict[str, np.ndarray], layers: list[int], trainable: slice,
                 device: torch.device) -> None:
        super().__init__()
        self.layers, self.trainable = list(layers), trainable

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(state[name], dtype=np.float32)).to(device)

        for l in self.layers:
            for kind in "pk":
                full = t(f"prompt.{kind}{l}")
                self.register_buffer(f"{kind}_fixed{l}", full[: trainable.start].clone())
                self.register_parameter(f"{kind}{l}", nn.Parameter(full[trainable].clone()))
        self.head_w = nn.Parameter(t("head.weight"))
        self.head_b = nn.Parameter(t("head.bias"))

    def prompt_parameters(self) -> list[nn.Parameter]:
        return [getattr(self, f"{kind}{l}") for l in self.layers for kind in "pk"]

    def head_parameters(self) -> list[nn.Parameter]:
        return [self.head_w, self.head_b]

    def final_prompts(self, z: torch.Tensor, layer: int) -> torch.Tensor:
        """Final prompt (B, L, D) of the active slices for latents ``z``."""
        keys = torch.cat([getattr(self, f"k_fixed{layer}"), getattr(self, f"k{layer}")])
        comps = torch.cat([getattr(self, f"p_fixed{layer}"), getattr(self, f"p{layer}")])
        alpha = F.normalize(z, dim=-1) @ F.normalize(keys, dim=-1).T
        return torch.einsum("bm,mld->bld", alpha, comps)

    def logits(self, z: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        return z @ self.head_w[classes].T + self.head_b[classes]

    def export(self, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``state`` with this student's prompt slice and head written back (dtypes kept)."""
        out = dict(state)
        for l in self.layers:
            for kind in "pk":
                name = f"prompt.{kind}{l}"
                arr = np.array(state[name], copy=True)
                arr[self.trainable] = getattr(self, f"{kind}{l}").detach().cpu().numpy().astype(arr.dtype)
                out[name] = arr
        out["head.weight"] = self.head_w.detach().cpu().numpy().astype(state["head.weight"].dtype)
        out["head.bias"] = self.head_b.detach().cpu().numpy().astype(state["head.bias"].dtype)
        return out


class PromptGrams:
    """Prompt MSE between the student and fixed teachers through Gram matrices.

    A final prompt is ``alpha @ P`` with ``P`` the (M, L*D) components, so
    ``||alpha_s P_s - alpha_c P_c||^2 = a_s G_ss a_s - 2 a_s G_sc a_c + a_c G_cc a_c``.
    Teachers are fixed and so are the student's earlier slices: every Gram block that
    involves only those is built once per round (M^2 L D); what involves the student's
    trainable slice (``per_task`` rows) is rebuilt per call when ``track_student``
    (distillation), or cached too when the student is fixed (generator training).
    A step then costs B M^2 per teacher plus ``per_task`` M L D, instead of the
    B M L D of forming every teacher's prompts (L D = 15,360 at paper scale).
    Quadratic forms are in float64 so that the difference of near-equal terms keeps
    its precision.
    """

    def __init__(self, student: LatentStudent, teachers: Teachers, track_student: bool = False) -> None:
        self.student, self.teachers, self.track = student, teachers, track_student
        self.layers = list(student.layers)
        self.cache: dict[int, dict[str, torch.Tensor]] = {}
        with torch.no_grad():
            for l in self.layers:
                fixed = self._flat(getattr(student, f"p_fixed{l}"))  # (M_f, LD)
                p_c = self._flat(teachers.prompts[l])  # (C, M_c, LD)
                c = {"p_c": p_c, "fixed": fixed, "g_ff": fixed @ fixed.T,
                     "g_fc": torch.einsum("mx,cnx->cmn", fixed, p_c), "g_cc": torch.einsum("cmx,cnx->cmn", p_c, p_c)}
                self.cache[l] = c
                if not track_student:
                    c["g_ss"], c["g_sc"] = self._student_blocks(l)

    @staticmethod
    def _flat(p: torch.Tensor) -> torch.Tensor:
        """(..., M, L, D) -> (..., M, L*D) in float64 (explicit sizes: M may be 0 on the first task)."""
        return p.reshape(*p.shape[:-2], p.shape[-2] * p.shape[-1]).double()

    def _student_blocks(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(G_ss, G_sc) from the cached fixed blocks and the student's current slice."""
        c = self.cache[l]
        cur = self._flat(getattr(self.student, f"p{l}"))  # (m, LD), live parameter
        g_cf = cur @ c["fixed"].T  # (m, M_f)
        g_ss = torch.cat([torch.cat([c["g_ff"], g_cf.T], 1), torch.cat([g_cf, cur @ cur.T], 1)], 0)
        g_sc = torch.cat([c["g_fc"], torch.einsum("mx,cnx->cmn", cur, c["p_c"])], 1)  # (C, M_s, M_c)
        return g_ss, g_sc

    def mse(self, z: torch.Tensor) -> torch.Tensor:
        """Sum over layers and teachers of MSE(student prompt, teacher prompt), mean over B, L, D."""
        zn = F.normalize(z, dim=-1)
        total = z.new_zeros((), dtype=torch.float64)
        for l in self.layers:
            c = self.cache[l]
            g_ss, g_sc = self._student_blocks(l) if self.track else (c["g_ss"], c["g_sc"])
            keys = torch.cat([getattr(self.student, f"k_fixed{l}"), getattr(self.student, f"k{l}")])
            a_s = (zn @ F.normalize(keys, dim=-1).T).double()  # (B, M_s)
            a_c = torch.einsum("bd,cmd->cbm", zn, self.teachers.keys[l]).double()  # (C, B, M_c)
            ss = torch.einsum("bm,mn,bn->b", a_s, g_ss, a_s)
            sc = torch.einsum("bm,cmn,cbn->cb", a_s, g_sc, a_c)
            cc = torch.einsum("cbm,cmn,cbn->cb", a_c, c["g_cc"], a_c)
            total = total + ((ss[None] - 2 * sc + cc).mean(-1) / c["p_c"].shape[-1]).sum()
        return total.to(z.dtype)


# ---------------------------------------------------------------------------- losses
def _local_labels(labels: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Positions of ``labels`` in ``classes`` (classes are a contiguous range here)."""
    return labels - classes[0]


def generator_losses(z: torch.Tensor, labels: torch.Tensor, classes: torch.Tensor, teachers: Teachers,
                     student: LatentStudent, use_kl: bool = True, use_mse: bool = True,
                     grams: PromptGrams | None = None) -> dict[str, torch.Tensor]:
    """L_cls, L_KL, L_MSE of eqs. 2-4 for latents ``z`` (summed over teachers).

    L_cls: CE of each teacher's head over ``classes``; L_KL: KL(softmax student head ||
    softmax teacher head) over ``classes``; L_MSE: MSE of final prompts, summed over
    prompted layers. A switched-off term is not computed at all (zero).

    Logits are restricted to ``classes``: clients train their heads with cross-entropy
    over the current task's classes only, so those logits are where their knowledge is
    (for the old-class generator, ``classes`` are the previous model's seen classes).
    ``grams`` (for a fixed student) computes L_MSE without forming the prompts.
    """
    y = _local_labels(labels, classes)
    t_logits = teachers.logits(z, classes)  # (C, B, K)
    C = t_logits.shape[0]
    l_cls = F.cross_entropy(t_logits.reshape(-1, t_logits.shape[-1]), y.repeat(C), reduction="mean") * C
    zero = z.new_zeros(())
    l_kl, l_mse = zero, zero
    if use_kl:
        s_logp = F.log_softmax(student.logits(z, classes), dim=-1)  # (B, K)
        t_logp = F.log_softmax(t_logits, dim=-1)
        l_kl = (s_logp.exp()[None] * (s_logp[None] - t_logp)).sum(-1).mean(-1).sum()
    if use_mse and grams is not None:
        l_mse = grams.mse(z)
    elif use_mse:
        for layer in student.layers:
            diff = student.final_prompts(z, layer)[None] - teachers.final_prompts(z, layer)
            l_mse = l_mse + diff.pow(2).mean(dim=(1, 2, 3)).sum()
    return {"cls": l_cls, "kl": l_kl, "mse": l_mse}


def group_generator_losses(z: torch.Tensor, labels: torch.Tensor, groups: list[TaskTeachers], student: LatentStudent,
                           use_kl: bool = True, use_mse: bool = True,
                           grams: list[PromptGrams] | None = None) -> dict[str, torch.Tensor]:
    """:func:`generator_losses` of each task group on the latents of its classes, summed.

    One group (synchronous arrival) is exactly :func:`generator_losses` on every latent.
    """
    grams = grams if grams is not None else [None] * len(groups)
    if len(groups) == 1:
        g = groups[0]
        return generator_losses(z, labels, g.classes, g.teachers, student, use_kl, use_mse, grams[0])
    total: dict[str, torch.Tensor] = {}
    for g, gram in zip(groups, grams):
        mine = g.holds(labels)
        if not bool(mine.any()):
            continue
        parts = generator_losses(z[mine], labels[mine], g.classes, g.teachers, student, use_kl, use_mse, gram)
        total = {k: total[k] + v if k in total else v for k, v in parts.items()}
    return total


def generator_objective(parts: dict[str, torch.Tensor], lambda_kl: float, lambda_mse: float) -> torch.Tensor:
    """Eq. 5: minimise L_cls - lambda_KL L_KL - lambda_MSE L_MSE."""
    return parts["cls"] - lambda_kl * parts["kl"] - lambda_mse * parts["mse"]


def train_generator(gen: LatentGenerator, classes: torch.Tensor, teachers: Teachers | list[TaskTeachers],
                    student: LatentStudent, opts: HePCoOptions, steps: int, rng: torch.Generator) -> dict[str, float]:
    """Fit ``gen`` for ``classes`` against ``teachers`` with the student fixed; last step's losses.

    ``teachers``: the stacked teachers of ``classes``, or one group per task trained this round
    (:class:`TaskTeachers`, whose classes together are ``classes``).
    """
    groups = task_groups(classes, teachers)
    student.requires_grad_(False)  # gradients reach z (and the generator) only
    optimizer = torch.optim.Adam(gen.parameters(), lr=opts.generator_lr)
    gen.train()
    last: dict[str, float] = {}
    grams = [PromptGrams(student, g.teachers) for g in groups] if opts.use_mse and steps else None
    for _ in range(steps):
        labels = draw_labels(groups, opts.generator_batch_size, rng)
        z = gen.sample(labels, rng)
        parts = group_generator_losses(z, labels, groups, student, opts.use_kl, opts.use_mse, grams)
        loss = generator_objective(parts, opts.lambda_kl, opts.lambda_mse)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        last = {k: float(v.detach()) for k, v in parts.items()}
    student.requires_grad_(True)
    return last


def set_sampling_mode(generators: list[LatentGenerator], mode: str) -> None:
    """BatchNorm mode of ``generators`` while they only produce latents (``"eval"`` | ``"train"``)."""
    for gen in generators:
        gen.train(mode == "train")


def distill(student: LatentStudent, opts: HePCoOptions,
            current: tuple[LatentGenerator, torch.Tensor, Teachers | list[TaskTeachers]],
            past: tuple[LatentGenerator, torch.Tensor, Teachers] | None, seen: torch.Tensor,
            rng: torch.Generator, use_grams: bool = True) -> dict[str, float]:
    """Latent distillation (sec. 5.3) of the student's prompt slice and head, in place.

    Parameters
    ----------
    current : (generator, classes, clients)
        Current-task generator, its classes and the stacked client teachers, or one group
        of them per task trained this round (:class:`TaskTeachers`): every client still
        teaches the prompts on every latent (eq. 6), each through its own active slices.
    past : (generator, classes, previous server) or None
        Old-class generator, old classes and the previous task's server model; None
        when there is no previous model (first task, or the ablation).
    seen : Tensor
        All classes seen so far: the head's cross-entropy is over these.
    use_grams : bool
        Prompt MSE through :class:`PromptGrams` (same loss, far cheaper); False forms
        every teacher's prompts (the reference computation).

    Returns
    -------
    dict
        Last step's prompt loss and head loss.
    """
    gen, classes, clients = current
    groups = task_groups(classes, clients)
    prompt_opt = torch.optim.Adam(student.prompt_parameters(), lr=opts.distill_lr)
    head_opt = torch.optim.Adam(student.head_parameters(), lr=opts.distill_lr)
    n_old = int(round(opts.replay_ratio * opts.distill_batch_size)) if past is not None else 0
    # Eq. 6's zeta term as a per-sample loss over the composite batch: the old-latent mean
    # times the old share of the batch ("composite", the paper), or the old-latent mean
    # alone ("old": the previous-task teacher 1/share times heavier).
    old_weight = (n_old / (opts.distill_batch_size + n_old)
                  if opts.old_prompt_mean == "composite" and n_old else 1.0)
    device = seen.device
    set_sampling_mode([gen] + ([past[0]] if past is not None else []), opts.distill_generator_mode)
    last: dict[str, float] = {}
    grams = grams_old = None
    if opts.distill_prompts and use_grams and opts.distill_epochs:
        grams = [PromptGrams(student, g.teachers, track_student=True) for g in groups]
        grams_old = PromptGrams(student, past[2], track_student=True) if n_old else None  # type: ignore[index]
    for _ in range(opts.distill_epochs):
        with torch.no_grad():
            y_new = draw_labels(groups, opts.distill_batch_size, rng)
            z_new = gen.sample(y_new, rng)
            if n_old:
                old_gen, old_classes, _ = past  # type: ignore[misc]
                y_old = old_classes[torch.randint(len(old_classes), (n_old,), generator=rng, device=device)]
                z_old = old_gen.sample(y_old, rng)
                z, y = torch.cat([z_new, z_old]), torch.cat([y_new, y_old])
            else:
                z, y = z_new, y_new
            # Distillation targets: teachers' final prompts (eq. 6), fixed for this step.
            direct = opts.distill_prompts and grams is None
            targets = {l: [g.teachers.final_prompts(z, l) for g in groups] for l in student.layers} if direct else {}
            old_targets = ({l: past[2].final_prompts(z_old, l)[0] for l in student.layers}  # type: ignore[index]
                           if direct and n_old else {})
        if grams is not None:
            # Eq. 6: clients on every latent; zeta: the previous server on old-class latents only.
            loss_p = grams[0].mse(z)
            for more in grams[1:]:
                loss_p = loss_p + more.mse(z)
            loss_p = loss_p + (old_weight * grams_old.mse(z_old) if grams_old is not None else 0.0)
            prompt_opt.zero_grad(set_to_none=True)
            loss_p.backward()
            prompt_opt.step()
            last["prompt-loss"] = float(loss_p.detach())
        elif opts.distill_prompts:
            loss_p = z.new_zeros(())
            for l in student.layers:
                mine = student.final_prompts(z, l)
                for target in targets[l]:
                    loss_p = loss_p + (mine[None] - target).pow(2).mean(dim=(1, 2, 3)).sum()
                if n_old:  # zeta: the previous server teaches on old-class latents only
                    loss_p = loss_p + old_weight * (mine[len(z_new):] - old_targets[l]).pow(2).mean()
            prompt_opt.zero_grad(set_to_none=True)
            loss_p.backward()
            prompt_opt.step()
            last["prompt-loss"] = float(loss_p.detach())
        if opts.distill_head:
            target = _local_labels(y, seen)
            weight = None
            if opts.head_loss == "balanced":  # 1 / (latents of the class in this batch): classes weigh alike
                counts = torch.bincount(target, minlength=len(seen)).float()
                weight = torch.where(counts > 0, 1.0 / counts.clamp_min(1.0), torch.zeros_like(counts))
            loss_h = F.cross_entropy(student.logits(z, seen), target, weight=weight)
            head_opt.zero_grad(set_to_none=True)
            loss_h.backward()
            head_opt.step()
            last["head-loss"] = float(loss_h.detach())
    return last


# ---------------------------------------------------------------------------- diagnostics
@torch.no_grad()
def sample_latents(gen: LatentGenerator, classes: torch.Tensor, per_class: int, mode: str,
                   rng: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` pseudo-latents of every class in ``classes``, sampled as distillation samples them."""
    set_sampling_mode([gen], mode)
    labels = classes.repeat_interleave(per_class)
    return gen.sample(labels, rng), labels


@torch.no_grad()
def teacher_accuracy(teachers: Teachers, z: torch.Tensor, labels: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Per teacher (C,): accuracy (%) of its head over ``classes`` on latents ``z`` of ``labels``.

    Whether a generator's latents are recognisable as their classes by the heads it was fitted
    against: the minimum a latent must do before distillation can transfer anything.
    """
    pred = teachers.logits(z, classes).argmax(-1) + classes[0]
    return (pred == labels[None]).float().mean(-1) * 100


class RealDataProbe:
    """The round's consolidation measured on real images (``hepco.diagnostics``; never trained on).

    The server distils prompts and head on pseudo-latents of the *query* space, while at
    test time the head sees the *prompted* features of real images. The probe takes up to
    ``per_class`` training images of each seen class (seeded) from the server's central
    data and reports:

    * ``real-query-feature-cos``: mean cosine between q(x) and the prompted feature f(x)
      (distilled prompts), and ``real-prompt-shift``: mean ||f(x) - q(x)|| over the mean
      distance of q(x) to its mean: how far the head's test-time input is from the query space;
    * ``latent-{query,feature}-cos-{old,new}``: mean over classes of the cosine between
      the class's mean pseudo-latent and its mean real q(x) / f(x);
      ``latent-{query,feature}-ncm-{old,new}``: accuracy (%) of assigning each
      pseudo-latent to the class with the nearest (cosine) real mean; and
      ``latent-feature-norm-ratio``: mean ||z|| over mean ||f(x)||;
    * ``real-{old,new}-acc-{provisional,distilled-head,distilled-prompts,distilled}``:
      accuracy (%) on real prompted features, all seen classes competing (as evaluation
      does), of the provisional model, with only its head distilled, with only its prompts
      distilled, and fully distilled: what each distillation does to old and new classes;
    * ``real-query-{old,new}-acc-distilled``: the distilled head on real q(x) (the space
      it was distilled in).
    """

    def __init__(self, cfg: ExperimentConfig, per_class: int) -> None:
        from promptfcl.common.runtime import get_runtime

        self.rt = get_runtime(cfg, HePCoPrompt)  # the server's central evaluation runtime (cached)
        self.cfg, self.per_class = cfg, per_class

    def images(self, classes: np.ndarray) -> np.ndarray:
        """Up to ``per_class`` training-image indices of each class (seeded, same every round)."""
        labels = self.rt.data.train.labels
        rng = np.random.default_rng([self.cfg.seed, 0xD1A6])
        picks = []
        for c in classes:
            idx = np.flatnonzero(labels == c)
            picks.append(np.sort(rng.permutation(idx)[: self.per_class]) if len(idx) else idx)
        return np.concatenate(picks) if picks else np.zeros(0, np.int64)

    @torch.no_grad()
    def features(self, state: dict[str, np.ndarray], index: np.ndarray, task: int,
                 batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """(q(x), f(x)) of training images ``index`` under the prompts of ``state`` (float32, CPU)."""
        from promptfcl.common.records import to_torch

        rt, model = self.rt, self.rt.model
        model.load_trainable_state(to_torch(to_array_record(state)))
        model.prompt.set_task(task)
        model.eval()
        queries = rt.queries("train", index)
        qs, fs = [], []
        for start in range(0, len(index), batch):
            x = model.preprocess(torch.from_numpy(rt.data.train.images[index[start : start + batch]]).to(rt.device))
            with rt.autocast():
                q = queries[start : start + batch] if queries is not None else model.query(x)
                f = model.features(x, q)
            qs.append(q.float().cpu())
            fs.append(f.float().cpu())
        return torch.cat(qs), torch.cat(fs)

    def measure(self, provisional: dict[str, np.ndarray], distilled: dict[str, np.ndarray], task: int,
                seen: np.ndarray, old: np.ndarray, latents: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
        """The metrics above; ``latents`` maps ``"old"`` / ``"new"`` to (pseudo-latents, labels)."""
        index = self.images(seen)
        y = torch.as_tensor(self.rt.data.train.labels[index])
        is_old = torch.as_tensor(np.isin(y.numpy(), old))
        q, f_prov = self.features(provisional, index, task)
        _, f_dist = self.features(distilled, index, task)
        seen_t = torch.as_tensor(seen)
        out: dict[str, float] = {}

        def acc(feats: torch.Tensor, head: dict[str, np.ndarray], part: torch.Tensor) -> float:
            w, b = torch.from_numpy(head["head.weight"][seen]), torch.from_numpy(head["head.bias"][seen])
            pred = seen_t[(feats[part] @ w.T + b).argmax(1)]
            return float((pred == y[part]).float().mean() * 100) if part.any() else float("nan")

        for name, part in (("old", is_old), ("new", ~is_old)):
            if not part.any():
                continue
            out[f"real-{name}-acc-provisional"] = acc(f_prov, provisional, part)
            out[f"real-{name}-acc-distilled-head"] = acc(f_prov, distilled, part)
            out[f"real-{name}-acc-distilled-prompts"] = acc(f_dist, provisional, part)
            out[f"real-{name}-acc-distilled"] = acc(f_dist, distilled, part)
            out[f"real-query-{name}-acc-distilled"] = acc(q, distilled, part)
        out["real-query-feature-cos"] = float(F.cosine_similarity(q, f_dist, dim=-1).mean())
        # Cosines of ViT features share a large common component; the prompts' shift against
        # the spread of the queries says how far apart the two spaces really are.
        out["real-prompt-shift"] = float((f_dist - q).norm(dim=-1).mean() / (q - q.mean(0)).norm(dim=-1).mean())

        # Pseudo-latents against the real class means of both spaces.
        means = {"query": torch.stack([q[y == c].mean(0) for c in seen]),
                 "feature": torch.stack([f_dist[y == c].mean(0) for c in seen])}
        for name, (z, labels) in latents.items():
            z, labels = z.float().cpu(), labels.cpu()
            pos = torch.searchsorted(seen_t, labels)  # seen is ascending
            for space, mu in means.items():
                cos = F.normalize(z, dim=-1) @ F.normalize(mu, dim=-1).T  # (B, |seen|)
                out[f"latent-{space}-ncm-{name}"] = float((cos.argmax(1) == pos).float().mean() * 100)
                classes = labels.unique()
                z_mean = torch.stack([z[labels == c].mean(0) for c in classes])
                out[f"latent-{space}-cos-{name}"] = float(
                    F.cosine_similarity(z_mean, mu[torch.searchsorted(seen_t, classes)], dim=-1).mean())
            out[f"latent-feature-norm-ratio-{name}"] = float(z.norm(dim=-1).mean() / f_dist.norm(dim=-1).mean())
        return out


# ---------------------------------------------------------------------------- strategy
class HePCoStrategy(PromptStrategy):
    """HePCo's server: provisional average, latent generation, latent distillation.

    State kept across rounds: only the previous task's final prompts, keys and head
    (``self.previous``), as the paper's storage analysis says (sec. 6.2.2).
    """

    per_task_in_flight = True  # asynchronous arrival: a task's slice over the clients on it

    name = "hepco"
    random_tasks = False  # tasks of the stream: contiguous classes and slices
    prompt_class = HePCoPrompt
    options_class = HePCoOptions

    def __init__(self, cfg: ExperimentConfig, num_classes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(cfg, num_classes, options)
        self.opts = HePCoOptions.from_options(self.options)
        if num_classes % cfg.num_tasks:
            raise ConfigError(f"{num_classes} classes do not split into {cfg.num_tasks} tasks")
        self.device = resolve_device(cfg.device)
        self.task, self.round = 0, 0
        self.previous: dict[str, np.ndarray] | None = None  # previous task's final P, K (seen slices), head
        self.previous_task = -1
        self.last_report: dict[str, float] = {}
        if self.opts.diagnostics and (cfg.evaluation != "central" or cfg.population != "virtual"):
            raise ConfigError("hepco.diagnostics measures against the server's central data: it needs "
                              "evaluation = central and population = virtual (simulation)")
        self._probe: RealDataProbe | None = None

    # ------------------------------------------------------------------ Flower contract
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        self.task, self.round = int(config["task"]), int(config["round"])
        return list(super().configure_train(server_round, arrays, config, grid))

    def aggregate_train(self, server_round: int, replies: Any) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Base aggregation (which calls :meth:`consolidate`), plus HePCo's timings and losses."""
        self.last_report = {}
        arrays, metrics = super().aggregate_train(server_round, replies)
        if metrics is not None:
            for key, value in self.last_report.items():
                metrics[key] = float(value)
        return arrays, metrics

    # ------------------------------------------------------------------ hooks
    def consolidate(self, server_round: int, arrays: ArrayRecord, replies: list[RecordDict]) -> ArrayRecord:
        """Provisional average -> generators -> latent distillation; returns the new global arrays."""
        started = time.perf_counter()
        opts, cfg, task = self.opts, self.cfg, self.task
        if opts.averaging == "uniform":
            provisional = from_array_record(self.average_replies(replies, np.ones(len(replies))))
        else:
            provisional = from_array_record(arrays)
        if not (opts.distill_prompts or opts.distill_head):
            self.last_report = {"consolidation-seconds": time.perf_counter() - started}
            return to_array_record(provisional)

        per_task = cfg.pool_size // cfg.num_tasks
        k = self.num_classes // cfg.num_tasks
        dev = self.device
        # the tasks this round's replies trained (one, the current task, with synchronous arrival):
        # the current-task generator and the distillation cover all their classes
        groups = self.task_teachers(replies, per_task)
        low, high = int(groups[0].classes[0]) // k, int(groups[-1].classes[-1]) // k
        classes = torch.arange(low * k, (high + 1) * k, device=dev)
        seen = torch.arange((high + 1) * k, device=dev)
        seed = int(np.random.default_rng([cfg.seed, task, self.round, 0x4EC0]).integers(2**31 - 1))
        rng = torch.Generator(device=dev).manual_seed(seed)

        clients = groups[0].teachers if len(groups) == 1 else groups
        student = LatentStudent(provisional, cfg.layers, slice(low * per_task, (high + 1) * per_task), dev)
        dim = int(student.head_w.shape[1])
        report: dict[str, float] = {}

        with torch.random.fork_rng(devices=[]):  # seeded generator init, global RNG untouched
            torch.manual_seed(seed)
            gen = self._new_generator(dim)
            past_gen = self._new_generator(dim) if self._has_past() else None

        t0 = time.perf_counter()
        parts = train_generator(gen, classes, clients, student, opts, opts.generator_epochs, rng)
        report.update({f"gen-{name}": v for name, v in parts.items()})
        t1 = time.perf_counter()
        past = None
        if past_gen is not None:
            old_classes = torch.arange(task * k, device=dev)
            prev = Teachers.stack([self.previous], cfg.layers, task * per_task, dev)  # type: ignore[list-item]
            steps = opts.generator_epochs + opts.past_generator_epochs_per_task * task
            parts = train_generator(past_gen, old_classes, prev, student, opts, steps, rng)
            report.update({f"past-gen-{name}": v for name, v in parts.items()})
            past = (past_gen, old_classes, prev)
        t2 = time.perf_counter()
        report.update(distill(student, opts, (gen, classes, clients), past, seen, rng))
        t3 = time.perf_counter()
        distilled = student.export(provisional)
        report.update(self._diagnose(gen, classes, clients, past, seen, student, provisional, distilled, seed))
        t4 = time.perf_counter()

        report.update({"generator-seconds": t1 - t0, "past-generator-seconds": t2 - t1,
                       "distill-seconds": t3 - t2, "diagnostics-seconds": t4 - t3,
                       "consolidation-seconds": t4 - started})
        self.last_report = report
        log.info("hepco round %d (task %d): consolidation %.2fs (generators %.2fs + %.2fs, distillation %.2fs) | %s",
                 server_round, task, t4 - started, t1 - t0, t2 - t1, t3 - t2,
                 " ".join(f"{name} {v:.3g}" for name, v in report.items() if not name.endswith("seconds")))
        return to_array_record(distilled)

    def task_teachers(self, replies: list[RecordDict], per_task: int) -> list[TaskTeachers]:
        """The round's client teachers, one group per task they trained (ascending), each stacked
        up to its task's slices; the task of a reply is the one the server sent it."""
        origins = self.reply_origins(replies) or [(None, None)] * len(replies)
        tasks = [self.task if task is None else task for _, task in origins]
        groups = []
        for t in sorted(set(tasks)):
            states = [from_array_record(r[ARRAYS]) for r, rt in zip(replies, tasks) if rt == t]
            groups.append(TaskTeachers(torch.as_tensor(task_classes(self.cfg, t, self.num_classes), device=self.device),
                                       Teachers.stack(states, self.cfg.layers, (t + 1) * per_task, self.device),
                                       len(states)))
        return groups

    def _diagnose(self, gen: LatentGenerator, classes: torch.Tensor, clients: Teachers | list[TaskTeachers],
                  past: tuple[LatentGenerator, torch.Tensor, Teachers] | None, seen: torch.Tensor,
                  student: LatentStudent, provisional: dict[str, np.ndarray], distilled: dict[str, np.ndarray],
                  seed: int) -> dict[str, float]:
        """What the round's pseudo-latents are (reported every round; real data only with ``diagnostics``).

        Always (a few hundred latents, no data): ``gen-teacher-acc`` (mean over clients of
        their head's accuracy over the current classes on the current-task generator's
        latents) and ``past-gen-teacher-acc`` (the previous-task server's head over the old
        classes on the past-task generator's latents): are the latents recognisable as the
        classes they were generated for? And the server head over all seen classes on the
        same latents before (``*-provisional-acc``) and after (``*-student-acc``) distillation.
        """
        opts = self.opts
        rng = torch.Generator(device=self.device).manual_seed(seed + 1)  # the training stream stays untouched
        z_new, y_new = sample_latents(gen, classes, opts.diagnostics_per_class, opts.distill_generator_mode, rng)
        accuracies = [teacher_accuracy(g.teachers, z_new[g.holds(y_new)], y_new[g.holds(y_new)], g.classes)
                      for g in task_groups(classes, clients)]  # each client on its own task's latents
        out = {"gen-teacher-acc": float(torch.cat(accuracies).mean())}
        latents = {"new": (z_new, y_new)}
        if past is not None:
            past_gen, old_classes, prev = past
            z_old, y_old = sample_latents(past_gen, old_classes, opts.diagnostics_per_class,
                                          opts.distill_generator_mode, rng)
            out["past-gen-teacher-acc"] = float(teacher_accuracy(prev, z_old, y_old, old_classes)[0])
            latents["old"] = (z_old, y_old)
        heads = {"provisional": Teachers.stack([provisional], [], 0, self.device),
                 "student": Teachers.stack([distilled], [], 0, self.device)}
        for part, (z, y) in latents.items():
            prefix = "gen" if part == "new" else "past-gen"
            for name, head in heads.items():
                out[f"{prefix}-{name}-acc"] = float(teacher_accuracy(head, z, y, seen)[0])
        if opts.diagnostics:
            if self._probe is None:
                self._probe = RealDataProbe(self.cfg, opts.diagnostics_per_class)
            old = np.arange(int(classes[0]))  # the stream's earlier tasks hold the classes below
            out.update(self._probe.measure(provisional, distilled, self.task, seen.cpu().numpy(), old, latents))
        return out

    def _has_past(self) -> bool:
        return (self.opts.use_previous and self.task > 0 and self.previous is not None
                and self.previous_task == self.task - 1 and self.opts.replay_ratio > 0)

    def _new_generator(self, dim: int) -> LatentGenerator:
        o = self.opts
        return LatentGenerator(self.num_classes, dim, o.noise_dim, o.label_embed_dim, o.hidden,
                               o.generator_batchnorm).to(self.device)

    def on_task_end(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        """Keep the task's final prompts and keys (its seen slices) and head: the next task's teacher."""
        if not self.opts.use_previous:
            self.previous, self.previous_task = None, -1  # the ablation keeps nothing
            return arrays
        stop = (task + 1) * (self.cfg.pool_size // self.cfg.num_tasks)
        state = from_array_record(arrays)
        kept = {}
        for l in self.cfg.layers:
            for kind in "pk":
                kept[f"prompt.{kind}{l}"] = np.array(state[f"prompt.{kind}{l}"][:stop], copy=True)
        kept["head.weight"] = np.array(state["head.weight"], copy=True)
        kept["head.bias"] = np.array(state["head.bias"], copy=True)
        self.previous, self.previous_task = kept, task
        return arrays

    def state_dict(self) -> dict[str, Any]:
        """Flat: ``previous-task`` and ``previous.<array name>`` for the previous task's model."""
        state: dict[str, Any] = {"previous-task": self.previous_task}
        for name, arr in (self.previous or {}).items():
            state[f"previous.{name}"] = arr
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous_task = int(state.get("previous-task", -1))
        kept = {k[len("previous."):]: np.asarray(v) for k, v in state.items() if k.startswith("previous.")}
        self.previous = kept or None

    def summary(self) -> None:
        super().summary()
        log.info("hepco: %s", self.opts)
