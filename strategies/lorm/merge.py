"""LoRM's closed forms, in float64 NumPy (the code solves in float64: ``reg_dtype_64``).

Notation: a frozen weight W0 (out x in), an adapter ``Delta W = B A`` with B (out x r) and A
(r x in); client i's inputs to the layer X_i (tokens x in) and its Gram ``G_i = X_i^T X_i``, full
(in x in) or its diagonal (in,); ``S = sum_i G_i`` (unweighted: a client weighs by its tokens).

* B-round, A shared: ``min_B sum_i ||X_i A^T B^T - X_i A^T B_i^T||^2`` gives
  ``B* = (sum_i B_i A G_i A^T) (A S A^T)^+``, an r x r solve;
* A-round, B shared: ``min_A sum_i ||B A X_i^T - B A_i X_i^T||^2`` gives, when ``B^T B`` is
  invertible (B cancels), ``A* = (sum_i A_i G_i) S^+``; with diagonal Grams a per-column weighted
  mean of the clients' A;
* the head: RegMean ``W* = (sum_i W_i G'_i) (sum_i G'_i)^-1`` with ``G' = a G + (1 - a) diag G``;
* across tasks (diagonal Grams ``d_tau``): ``W_eval = W0 + (sum_tau Delta W_tau D_tau) (sum D)^+``,
  that is column weights ``w_tau = d_tau / sum_tau' d_tau'`` on each task's set.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _diagonal(gram: np.ndarray) -> bool:
    return np.ndim(gram) == 1


def _times_gram(m: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """``m @ G`` for a full Gram or its diagonal."""
    return m * gram[None, :] if _diagonal(gram) else m @ gram


def merge_b(a: np.ndarray, bs: Sequence[np.ndarray], grams: Sequence[np.ndarray]) -> np.ndarray:
    """B-round closed form: ``B* = (sum_i B_i A G_i A^T) (A S A^T)^+`` (out x r)."""
    a = np.asarray(a, np.float64)
    grams = [np.asarray(g, np.float64) for g in grams]
    numerator = sum(np.asarray(b, np.float64) @ (_times_gram(a, g) @ a.T) for b, g in zip(bs, grams))
    total = sum(grams)
    return np.asarray(numerator) @ np.linalg.pinv(_times_gram(a, np.asarray(total)) @ a.T, rcond=1e-15)


def merge_a(as_: Sequence[np.ndarray], grams: Sequence[np.ndarray], keep: np.ndarray | None = None) -> np.ndarray:
    """A-round closed form: ``A* = (sum_i A_i G_i) S^+`` (r x in), independent of B.

    Diagonal Grams give the per-column weighted mean ``sum_i A_i[:, j] d_ij / sum_i d_ij``; a column no
    client's data reaches (``S_jj = 0``) keeps ``keep``'s (the arrays sent: every client's equals it,
    no gradient reaches it), where the code's pseudo-inverse would zero it.
    """
    grams = [np.asarray(g, np.float64) for g in grams]
    numerator = np.asarray(sum(_times_gram(np.asarray(a, np.float64), g) for a, g in zip(as_, grams)))
    total = np.asarray(sum(grams))
    if not _diagonal(total):
        return numerator @ np.linalg.pinv(total, rcond=1e-15, hermitian=True)
    reached = total > 0
    out = np.zeros_like(numerator) if keep is None else np.array(keep, np.float64)
    out[:, reached] = numerator[:, reached] / total[reached]
    return out


def regularised(gram: np.ndarray, alpha: float) -> np.ndarray:
    """``G' = alpha G + (1 - alpha) diag(G)`` (the code's ``alpha_regmean``)."""
    gram = np.asarray(gram, np.float64)
    return alpha * gram + (1.0 - alpha) * np.diag(np.diag(gram))


def regmean_head(weights: Sequence[np.ndarray], grams: Sequence[np.ndarray], alpha: float) -> np.ndarray:
    """RegMean of the head's weights (C x D): ``(sum_i W_i G'_i) (sum_i G'_i)^-1`` (the code's
    ``torch.inverse``; the pseudo-inverse where the sum is singular)."""
    regs = [regularised(g, alpha) for g in grams]
    numerator = sum(np.asarray(w, np.float64) @ g for w, g in zip(weights, regs))
    total = sum(regs)
    try:  # W* S = N, S symmetric: solve S W*^T = N^T
        return np.linalg.solve(total, np.asarray(numerator).T).T
    except np.linalg.LinAlgError:
        return np.asarray(numerator) @ np.linalg.pinv(total, rcond=1e-15, hermitian=True)


def task_weights(diagonals: Sequence[np.ndarray] | np.ndarray, mode: str) -> np.ndarray:
    """Column weights (tasks x in) of the sets of tasks 0..t, from each task's Gram diagonal.

    ``"regmean"``: ``d_tau / sum d`` (0 where no task's data reaches a column: the pseudo-inverse);
    one task keeps its delta whole (the code's t = 0 case); ``"running-mean"``: ``1 / (t + 1)``;
    ``"sum"``: ones.
    """
    d = np.asarray(diagonals, np.float64)
    if mode == "sum" or (mode == "regmean" and len(d) == 1):
        return np.ones_like(d)
    if mode == "running-mean":
        return np.full_like(d, 1.0 / len(d))
    if mode != "regmean":
        raise ValueError(f"unknown task merge {mode!r}")
    total = d.sum(0)
    return np.divide(d, total[None, :], out=np.zeros_like(d), where=total[None, :] > 0)


def unpack_triu(packed: np.ndarray, dim: int) -> np.ndarray:
    """The symmetric D x D matrix whose upper triangle (row-major) is ``packed``."""
    out = np.zeros((dim, dim), np.float64)
    row, col = np.triu_indices(dim)
    out[row, col] = packed
    out[col, row] = packed
    return out


def pack_triu(matrix: np.ndarray) -> np.ndarray:
    """The upper triangle (row-major) of a square matrix."""
    return np.asarray(matrix)[np.triu_indices(len(matrix))]
