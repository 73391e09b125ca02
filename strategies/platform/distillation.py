"""Distillation losses more than one method uses (Powder's dual distillation, C2Prompt's, which
keeps Powder's term): one definition each."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dual_distillation(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
                      weights: torch.Tensor | None = None, temperature: float = 1.0) -> torch.Tensor:
    """Eq. 5: sum_b beta_b KL(teacher_b || student_b) over the non-true classes.

    Parameters
    ----------
    student, teacher : (B, C) tensors
        Logits; classes outside the task are -inf (``masked_logits``) and take no part.
    labels : (B,) tensor
        True classes: their logit is removed from both distributions (FedNTD).
    weights : (B,) tensor, optional
        beta, summing to 1 over the batch (None: 1/B each, a plain mean).
    temperature : float
        Softening of both distributions; the loss is scaled by its square (as FedNTD).
    """
    keep = torch.isfinite(student) & torch.isfinite(teacher)
    keep[torch.arange(len(labels), device=labels.device), labels] = False
    per_row = keep.sum(dim=1)
    if len(labels) == 0 or int(per_row.max()) == 0:
        return student.new_zeros(())
    if not bool((per_row == per_row[0]).all()):
        raise ValueError("every sample must have the same classes in play")
    s = student[keep].view(len(labels), -1) / temperature
    t = teacher[keep].view(len(labels), -1) / temperature
    p_t = F.softmax(t, dim=1)
    kl = (p_t * (F.log_softmax(t, dim=1) - F.log_softmax(s, dim=1))).sum(dim=1)
    if weights is None:
        weights = torch.full_like(kl, 1.0 / len(kl))
    return temperature**2 * (weights * kl).sum()


def classic_distillation(student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Plain KD (the DIS ablation): mean KL(teacher || student) over all the task's classes."""
    keep = torch.isfinite(student[0]) & torch.isfinite(teacher[0])
    s, t = student[:, keep] / temperature, teacher[:, keep] / temperature
    kl = (F.softmax(t, dim=1) * (F.log_softmax(t, dim=1) - F.log_softmax(s, dim=1))).sum(dim=1)
    return temperature**2 * kl.mean()
