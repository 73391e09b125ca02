"""Global class distributions (figure (a), "EQ. (1) (2)") and the LCDC loss L_d (figure (c)).

The paper's equations could not be read. The project's reading: each client sends, per class of
its task, the count, mean and diagonal population variance of the frozen backbone's q(x); the
server pools them into one diagonal Gaussian per class, the count-weighted mean and the law of
total variance, which are exactly the mean and variance of the union of the clients' samples.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ArrayRecord

from ...common.records import to_array_record


def class_statistics(features: np.ndarray, labels: np.ndarray) -> ArrayRecord:
    """Per label: count, mean and diagonal population variance (ddof 0) of ``features`` (N, D).

    The record's arrays: ``classes`` int64 (C,), ``counts`` int64 (C,), ``means`` float32 (C, D),
    ``var`` float32 (C, D).
    """
    x = np.asarray(features, dtype=np.float64)
    classes = np.unique(labels).astype(np.int64)
    counts = np.array([(labels == c).sum() for c in classes], dtype=np.int64)
    means = np.stack([x[labels == c].mean(0) for c in classes]) if len(classes) else np.zeros((0, x.shape[1]))
    var = np.stack([x[labels == c].var(0) for c in classes]) if len(classes) else np.zeros((0, x.shape[1]))
    return to_array_record({"classes": classes, "counts": counts, "means": means.astype(np.float32),
                            "var": var.astype(np.float32)})


def empty_statistics(dim: int) -> ArrayRecord:
    """The statistics record of a reply the server did not ask for them (no rows)."""
    return to_array_record({"classes": np.zeros(0, np.int64), "counts": np.zeros(0, np.int64),
                            "means": np.zeros((0, dim), np.float32), "var": np.zeros((0, dim), np.float32)})


def pool_statistics(counts: np.ndarray, means: np.ndarray, var: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """One class's clients (K of them) pooled: (N, mean, variance) of the union of their samples.

    ``mean = sum_k n_k mu_k / N``; ``var = sum_k n_k (var_k + (mu_k - mean)^2) / N`` (law of total
    variance, population variances). Clients with zero count are left out; noisy (DP) negative
    variances are clamped at 0 first. Float64.
    """
    n = np.asarray(counts, dtype=np.float64)
    keep = n > 0
    n, mu, v = n[keep], np.asarray(means, np.float64)[keep], np.clip(np.asarray(var, np.float64)[keep], 0.0, None)
    total = float(n.sum())
    if total <= 0:
        raise ValueError("no samples to pool")
    mean = (n[:, None] * mu).sum(0) / total
    variance = (n[:, None] * (v + (mu - mean) ** 2)).sum(0) / total
    return total, mean, variance


def compensation_loss(features: torch.Tensor, means: torch.Tensor, var: torch.Tensor | None, kind: str,
                      floor: float, labels: torch.Tensor | None = None) -> torch.Tensor:
    """L_d of a batch of compensated features (B, D) against their classes' global Gaussians
    (``means``, ``var``: (B, D), each row its sample's class; ``var`` None: unit variance).

    ``nll``: mean over samples of 0.5 sum_d ((f - mu)^2 / s^2 + log s^2) (the constant dropped);
    ``mse``: mean over samples of sum_d (f - mu)^2; ``kl``: per class of ``labels`` holding two
    samples or more, KL(N(batch mean, batch variance) || N(mu, s^2)), summed over dimensions and
    averaged over those classes (zero where none has two).
    """
    f = features.float()
    mu = means.to(f)
    s2 = torch.ones_like(mu) if var is None else var.to(f).clamp_min(floor)
    if kind == "mse":
        return ((f - mu) ** 2).sum(1).mean()
    if kind == "nll":
        return 0.5 * (((f - mu) ** 2) / s2 + s2.log()).sum(1).mean()
    if kind != "kl":
        raise ValueError(f"unknown compensation loss {kind!r}")
    assert labels is not None
    terms = []
    for c in torch.unique(labels):
        rows = labels == c
        if int(rows.sum()) < 2:
            continue
        m, v = f[rows].mean(0), f[rows].var(0, unbiased=False).clamp_min(floor)
        g_mu, g_s2 = mu[rows][0], s2[rows][0]
        terms.append(0.5 * (v / g_s2 + (m - g_mu) ** 2 / g_s2 - 1.0 + g_s2.log() - v.log()).sum())
    return torch.stack(terms).mean() if terms else f.sum() * 0.0
