"""HePCo's server training: the generators (eq. 5) and latent distillation (sec. 5.3, eq. 6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .latents import (
    LatentGenerator,
    LatentStudent,
    PromptGrams,
    TaskTeachers,
    Teachers,
    draw_labels,
    task_groups,
)
from .options import HePCoOptions


# ---------------------------------------------------------------------------- losses
def _local_labels(labels: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """Positions of ``labels`` in ``classes`` (classes are a contiguous range here)."""
    return labels - classes[0]


def generator_losses(z: torch.Tensor, labels: torch.Tensor, classes: torch.Tensor, teachers: Teachers,
                     student: LatentStudent, use_kl: bool = True, use_mse: bool = True,
                     grams: PromptGrams | None = None, span: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """L_cls, L_KL, L_MSE of eqs. 2-4 for latents ``z`` of ``labels`` (drawn from ``classes``),
    summed over teachers, each times its weight (:meth:`Teachers.weigh`, the "weighted sum" of
    sec. 5.2).

    L_cls: CE of each teacher's head over the classes ``span``; L_KL: KL(softmax student head ||
    softmax teacher head) over ``span``; L_MSE: MSE of final prompts, summed over prompted
    layers. A switched-off term is not computed at all (zero).

    ``span``: the classes the logits compete over, a contiguous range from class 0 or from
    ``classes[0]``. Every class seen so far (``hepco.generator-classes = "seen"``: the paper's
    phi is the whole classifier, and the authors' trainer slices the logits up to the last
    seen class), or ``classes`` alone (None; ``"task"``: clients train their heads with
    cross-entropy over the current task's classes only). ``grams`` (for a fixed student)
    computes L_MSE without forming the prompts.
    """
    span = classes if span is None else span
    y = _local_labels(labels, span)
    t_logits = teachers.logits(z, span)  # (C, B, K)
    C = t_logits.shape[0]
    per_teacher = F.cross_entropy(t_logits.reshape(-1, t_logits.shape[-1]), y.repeat(C), reduction="none")
    l_cls = teachers.weigh(per_teacher.reshape(C, -1), labels)
    zero = z.new_zeros(())
    l_kl, l_mse = zero, zero
    if use_kl:
        s_logp = F.log_softmax(student.logits(z, span), dim=-1)  # (B, K)
        t_logp = F.log_softmax(t_logits, dim=-1)
        l_kl = teachers.weigh((s_logp.exp()[None] * (s_logp[None] - t_logp)).sum(-1), labels)
    if use_mse and grams is not None:
        l_mse = grams.mse(z, labels)
    elif use_mse:
        for layer in student.layers:
            diff = student.final_prompts(z, layer)[None] - teachers.final_prompts(z, layer)
            l_mse = l_mse + teachers.weigh(diff.pow(2).mean(dim=(2, 3)), labels)
    return {"cls": l_cls, "kl": l_kl, "mse": l_mse}


def seen_span(classes: torch.Tensor) -> torch.Tensor:
    """Every class up to the last of ``classes``: what a task's teachers have seen."""
    return torch.arange(int(classes[-1]) + 1, device=classes.device)


def group_generator_losses(z: torch.Tensor, labels: torch.Tensor, groups: list[TaskTeachers], student: LatentStudent,
                           use_kl: bool = True, use_mse: bool = True, grams: list[PromptGrams] | None = None,
                           over_seen: bool = False) -> dict[str, torch.Tensor]:
    """:func:`generator_losses` of each task group on the latents of its classes, summed; the
    logits span each group's own task (``over_seen`` False) or every class up to it (True).

    One group (synchronous arrival) is exactly :func:`generator_losses` on every latent.
    """
    grams = grams if grams is not None else [None] * len(groups)  # type: ignore[list-item]
    total: dict[str, torch.Tensor] = {}
    for g, gram in zip(groups, grams):
        span = seen_span(g.classes) if over_seen else None
        if len(groups) == 1:
            return generator_losses(z, labels, g.classes, g.teachers, student, use_kl, use_mse, gram, span)
        mine = g.holds(labels)
        if not bool(mine.any()):
            continue
        parts = generator_losses(z[mine], labels[mine], g.classes, g.teachers, student, use_kl, use_mse, gram, span)
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
        parts = group_generator_losses(z, labels, groups, student, opts.use_kl, opts.use_mse, grams,
                                       opts.generator_classes == "seen")
        loss = generator_objective(parts, opts.lambda_kl, opts.lambda_mse)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        last = {k: float(v.detach()) for k, v in parts.items()}
    student.requires_grad_(True)
    return last


def old_teacher_weight(opts: HePCoOptions, n_new: int, n_old: int, num_classes: int, client_weight: float) -> float:
    """The weight of the previous-task teacher's prompt MSE (eq. 6's zeta term, a mean over the
    ``n_old`` old-class latents) next to the clients' term (a sum over clients, of total weight
    ``client_weight``, of means over the ``n_new`` current-task latents of ``num_classes`` classes).

    ``old-latent-teachers = "clients-and-previous"`` (eq. 6): ``old-prompt-mean = "composite"``
    averages the zeta term over the composite batch, n_old / (n_new + n_old); ``"old"`` over
    the old latents alone, 1. ``"previous"`` (the authors' code, ``knowledge_distillation`` in
    their trainer): every squared error is summed over the batch, an old-class latent weighing 1
    for the previous server and a current-task latent of class y weighing n_y / N summed over
    the clients (client j's count of y over the round's samples): with the round's classes
    equally represented, 1 / num_classes. Per latent, the previous server then weighs
    ``num_classes`` times the clients together, which this weight reproduces:
    num_classes * client_weight * n_old / n_new (75 times the composite weight at CIFAR-100's
    10 classes per task, 5 clients and replay ratio 0.5).
    """
    if not n_old:
        return 0.0
    if opts.old_latent_teachers == "previous":
        return num_classes * client_weight * n_old / n_new
    return n_old / (n_new + n_old) if opts.old_prompt_mean == "composite" else 1.0


def set_sampling_mode(generators: list[LatentGenerator], mode: str) -> None:
    """BatchNorm mode of ``generators`` while they only produce latents (``"eval"`` | ``"train"``)."""
    for gen in generators:
        gen.train(mode == "train")


def distill(student: LatentStudent, opts: HePCoOptions,
            current: tuple[LatentGenerator, torch.Tensor, Teachers | list[TaskTeachers]],
            past: tuple[LatentGenerator, torch.Tensor, Teachers] | None, seen: torch.Tensor,
            rng: torch.Generator, use_grams: bool = True) -> dict[str, float]:
    """Latent distillation (sec. 5.3) of the student's trainable prompt components and head, in place.

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
    # alone ("old": the previous-task teacher 1/share times heavier); the authors' code's
    # weight with old-latent-teachers = "previous" (old_teacher_weight)
    old_weight = old_teacher_weight(opts, opts.distill_batch_size, n_old, len(classes),
                                    sum(g.teachers.total_weight for g in groups))
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
            # the latents the clients teach on: all of them (eq. 6), or the current task's only
            # (the authors' code: the previous server alone teaches the old-class latents)
            taught, y_taught = (z, y) if opts.old_latent_teachers == "clients-and-previous" else (z_new, y_new)
            # Distillation targets: teachers' final prompts (eq. 6), fixed for this step.
            direct = opts.distill_prompts and grams is None
            targets = ({l: [g.teachers.final_prompts(taught, l) for g in groups] for l in student.layers}
                       if direct else {})
            old_targets = ({l: past[2].final_prompts(z_old, l)[0] for l in student.layers}  # type: ignore[index]
                           if direct and n_old else {})
        if grams is not None:
            # Eq. 6: clients on every latent; zeta: the previous server on old-class latents only.
            loss_p = grams[0].mse(taught, y_taught)
            for more in grams[1:]:
                loss_p = loss_p + more.mse(taught, y_taught)
            loss_p = loss_p + (old_weight * grams_old.mse(z_old, y_old) if grams_old is not None else 0.0)
            prompt_opt.zero_grad(set_to_none=True)
            loss_p.backward()
            prompt_opt.step()
            last["prompt-loss"] = float(loss_p.detach())
        elif opts.distill_prompts:
            loss_p = z.new_zeros(())
            for l in student.layers:
                mine = student.final_prompts(z, l)
                for g, target in zip(groups, targets[l]):
                    loss_p = loss_p + g.teachers.weigh((mine[None, : len(taught)] - target).pow(2).mean(dim=(2, 3)),
                                                       y_taught)
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
