"""Powder's task and class correlation (eq. 6-7), first-step aggregation (eq. 3) and top-k selection (eq. 4)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def correlation_matrix(alphas: np.ndarray, measured: np.ndarray, p: float) -> np.ndarray:
    """G (n, n): ``max(cos(alpha_i, alpha_j), 0) ** p`` between measured rows, identity elsewhere.

    Parameters
    ----------
    alphas : (n, W) array
        Average prompt-selection weights per task (or class); rows not measured are ignored.
    measured : (n,) bool array
        Which rows hold a measurement.
    p : float
        Sharpening exponent (the paper's 30).
    """
    n = len(alphas)
    g = np.eye(n, dtype=np.float64)
    idx = np.flatnonzero(np.asarray(measured, dtype=bool))
    if len(idx):
        a = np.asarray(alphas, dtype=np.float64)[idx]
        unit = a / np.maximum(np.linalg.norm(a, axis=1), 1e-12)[:, None]
        block = np.clip(unit @ unit.T, 0.0, 1.0) ** p
        np.fill_diagonal(block, 1.0)  # a task is fully correlated with itself (a zero alpha included)
        g[np.ix_(idx, idx)] = block
    return g


def sparsify_rows(g: np.ndarray, top: int) -> np.ndarray:
    """Keep the ``top`` largest entries of each row (ties: lower index first), rows renormalised to 1."""
    if top <= 0:
        return g
    out = np.zeros_like(g)
    for i, row in enumerate(g):
        keep = np.argsort(-row, kind="stable")[:top]
        out[i, keep] = row[keep]
    return out / np.maximum(out.sum(axis=1, keepdims=True), 1e-12)


def first_step_aggregation(state: Mapping[str, np.ndarray], g: np.ndarray, known: int, pool_size: int,
                           num_tasks: int) -> dict[str, np.ndarray]:
    """Eq. 3 on every prompt array: slice n of P_hat = sum_m G[n, m] * slice m of P, m < ``known``.

    Arrays that are not prompt pools (first dimension ``pool_size``) are returned unchanged;
    slices of tasks not yet known are copied as they are.
    """
    per_task = pool_size // num_tasks
    rows = known * per_task
    weights = np.asarray(g, dtype=np.float64)[:known, :known]
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        value = np.asarray(value)
        if not (name.startswith("prompt.") and value.ndim >= 1 and value.shape[0] == pool_size) or known == 0:
            out[name] = value
            continue
        slices = value[:rows].reshape(known, per_task, *value.shape[1:]).astype(np.float64)
        mixed = np.tensordot(weights, slices, axes=(1, 0)).reshape(rows, *value.shape[1:])
        merged = value.copy()
        merged[:rows] = mixed.astype(value.dtype)
        out[name] = merged
    return out


def select_tasks(row: np.ndarray, own: int, known: int, k: int, mode: str = "top-k",
                 rng: np.random.Generator | None = None) -> list[int]:
    """Eq. 4: the ``k`` known tasks most correlated with ``own`` (itself always in), ascending.

    ``mode = "random"`` (the w/o SEL ablation) takes ``own`` and k-1 other known tasks at random.
    Ties are broken towards the lower task index.
    """
    others = [m for m in range(known) if m != own]
    take = min(k, known) - 1
    if mode == "random":
        rng = rng or np.random.default_rng(0)
        chosen = rng.choice(len(others), size=take, replace=False).tolist() if take > 0 else []
        picked = [others[i] for i in chosen]
    else:
        order = sorted(others, key=lambda m: (-float(row[m]), m))
        picked = order[:take]
    return sorted([own] + picked)
