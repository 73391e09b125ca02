"""HePCo's models of the query space: the conditional generator, the teachers (clients, previous
server model) and the student (the provisional model's prompts and head), all on (B, D) latents."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


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
    ``head_b`` (C, N). M is the teachers' active components (the whole pool, or the slices up
    to their task).
    ``weights``: each teacher's weight in the sums over teachers of eqs. 2-4 and 6
    (:meth:`weigh`): (C,) one per teacher, or (C, N) one per teacher and class (a latent of
    class y weighs teacher c by ``weights[c, y]``); None: 1 each, the plain sum.
    """

    keys: dict[int, torch.Tensor]
    prompts: dict[int, torch.Tensor]
    head_w: torch.Tensor
    head_b: torch.Tensor
    weights: torch.Tensor | None = None

    @classmethod
    def stack(cls, states: list[dict[str, np.ndarray]], layers: list[int], stop: int,
              device: torch.device, weights: list[float] | np.ndarray | None = None) -> Teachers:
        def cat(name: str, upto: int | None = None) -> torch.Tensor:
            return torch.stack([torch.from_numpy(np.array(s[name][:upto], dtype=np.float32)) for s in states]).to(
                device
            )

        return cls(
            keys={l: F.normalize(cat(f"prompt.k{l}", stop), dim=-1) for l in layers},
            prompts={l: cat(f"prompt.p{l}", stop) for l in layers},
            head_w=cat("head.weight"),
            head_b=cat("head.bias"),
            weights=None if weights is None else torch.as_tensor(np.asarray(weights, np.float32), device=device),
        )

    @property
    def total_weight(self) -> float:
        """The teachers' weights summed on one latent (their number when unweighted; per class,
        the largest sum over a class)."""
        if self.weights is None:
            return float(self.head_w.shape[0])
        return float(self.weights.sum(0).max()) if self.weights.dim() == 2 else float(self.weights.sum())

    def weigh(self, per_latent: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The weighted sum over teachers of their mean over latents of a (C, B) loss of the latents
        of ``labels`` (B,): sum_c mean_b w_c(y_b) loss[c, b] (the plain sum when unweighted)."""
        if self.weights is None:
            return per_latent.mean(-1).sum()
        w = self.weights.to(per_latent.dtype)
        if w.dim() == 1:
            return (per_latent.mean(-1) * w).sum()
        return (per_latent * w[:, labels]).mean(-1).sum()

    def held(self, classes: torch.Tensor) -> torch.Tensor:
        """Those of ``classes`` some teacher has a weight for (all of them but with per-class weights)."""
        if self.weights is None or self.weights.dim() == 1:
            return classes
        return classes[self.weights[:, classes].sum(0) > 0]

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
    share: float  # its share of the latents: its replies, or their total weight (hepco.client-weights)

    def holds(self, labels: torch.Tensor) -> torch.Tensor:
        """Which of ``labels`` are this task's classes."""
        return (labels >= self.classes[0]) & (labels <= self.classes[-1])


def task_groups(classes: torch.Tensor, teachers: Teachers | list[TaskTeachers]) -> list[TaskTeachers]:
    """``teachers`` as task groups: stacked teachers of one task (``classes``) make a single group."""
    return [TaskTeachers(classes, teachers, 1)] if isinstance(teachers, Teachers) else list(teachers)


def draw_labels(groups: list[TaskTeachers], n: int, rng: torch.Generator) -> torch.Tensor:
    """``n`` latent labels: uniform over one task's classes (Algorithm 1, "sample class labels y
    randomly"); over several tasks, a task's classes drawn in proportion to its ``share`` (the
    replies that trained it, or their weight; uniform within the task). With per-class teacher
    weights only the classes some teacher holds are drawn: a latent no teacher can judge
    teaches nothing."""
    held = [g.teachers.held(g.classes) for g in groups]
    if len(groups) == 1:
        classes = held[0]
        return classes[torch.randint(len(classes), (n,), generator=rng, device=classes.device)]
    classes = torch.cat(held)
    weights = torch.cat(
        [torch.full((len(h),), g.share / max(len(h), 1), dtype=torch.float64) for g, h in zip(groups, held)]
    ).to(classes.device)
    return classes[torch.multinomial(weights, n, replacement=True, generator=rng)]


class LatentStudent(nn.Module):
    """The provisional server model in the latent space: its prompts (keys and components) and head.

    ``trainable``: the components distillation trains, as on the clients: the whole pool
    (``hepco.pool-training = "whole"``, the default), or the slices of the tasks trained this
    round (``"task-slices"``), earlier slices then fixed so that distillation cannot overwrite
    what earlier tasks learnt through them.
    """

    def __init__(self, state: dict[str, np.ndarray], layers: list[int], trainable: slice, device: torch.device) -> None:
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
        """``state`` with this student's trainable components and head written back (dtypes kept)."""
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
                c = {
                    "p_c": p_c,
                    "fixed": fixed,
                    "g_ff": fixed @ fixed.T,
                    "g_fc": torch.einsum("mx,cnx->cmn", fixed, p_c),
                    "g_cc": torch.einsum("cmx,cnx->cmn", p_c, p_c),
                }
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

    def mse(self, z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum over layers and teachers (weighted, :meth:`Teachers.weigh`) of MSE(student prompt,
        teacher prompt) on latents ``z`` of ``labels``, mean over B, L, D."""
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
            total = total + self.teachers.weigh((ss[None] - 2 * sc + cc) / c["p_c"].shape[-1], labels)
        return total.to(z.dtype)
