"""The class histograms of prompt selections (figure (d), H) and class-aware prompt aggregation
(figure (b), CPA, "EQ. (6)").

The paper's equation could not be read. For one task and one prompted block, with K clients, N
components each (the task's slice, or the client's part of it with ``cpa-pool = "keep-all"``)
and C classes:

* client k's histogram H_k (N x C): row n counts, per class, the client's images that selected
  component n (``histogram``);
* similarity of copies (k, n) and (k', n'): the cosine of rows H_k[n] and H_k'[n'] (histograms are
  non-negative, so in [0, 1]; 0 where a row is empty), every copy similar to itself (1);
* W, the figures' correlation matrix, (K N) x (K N) over every client's prompts (``scope =
  "all"``, the figures'; ``"component"`` keeps only n = n', the project's earlier reading):
  "cosine" (reading): the similarity times the column copy's weight w_k' (its reply's sample
  weight, or 1), rows normalised to sum 1; "softmax" (a paper note's W = softmax(H H^T / tau), H's
  rows of unit length): row-wise softmax of similarity / tau, each entry times w_k' first;
* every copy is replaced by its row's combination, p*_(k,n) = sum W[(k,n),(k',n')] p_(k',n'): the
  figures' P_g^{t*} = W_g^t * P_g^t, K N rows (``cpa_copies``). With cosine, component scope and
  identical histograms every copy becomes the weighted mean (FedAvg); clients whose classes are
  disjoint share nothing (W block-diagonal by client) under either scope;
* ``keep-all`` keeps those K N rows (the figures'); ``merge`` (the project's) keeps one copy of
  each component: p_n = sum_k pi_(k,n) p*_(k,n), pi_(k,n) proportional to w_k times client k's share
  of its selections that fell on n (``collapse = "usage"``), or to w_k (``"samples"``); a
  component no client selected falls back to w_k.
"""

from __future__ import annotations

import numpy as np
import torch


def selection_histogram(weights: torch.Tensor, positions: np.ndarray, num_classes: int, mode: str,
                        k: int) -> np.ndarray:
    """H (N, C) of one prompted block: ``weights`` (B, N) the soft weights of the client's
    components of the task per image, ``positions`` (B,) each image's class position among the
    task's classes.

    ``top-k``: each image adds 1 to each of its k highest-weighted components (row sums: images x
    k); ``mass``: each image adds its positive weights normalised to sum 1 (uniform where none is
    positive; row sums: images).
    """
    w = weights.detach().double().cpu()
    if mode == "top-k":
        chosen = torch.zeros_like(w)
        chosen.scatter_(1, w.topk(min(k, w.shape[1]), dim=1).indices, 1.0)
    elif mode == "mass":
        pos = w.clamp_min(0.0)
        total = pos.sum(1, keepdim=True)
        chosen = torch.where(total > 0, pos / total.clamp_min(1e-300), torch.full_like(w, 1.0 / w.shape[1]))
    else:
        raise ValueError(f"unknown histogram {mode!r}")
    onehot = np.zeros((len(positions), num_classes))
    onehot[np.arange(len(positions)), positions] = 1.0
    return chosen.numpy().T @ onehot


def cpa_matrix(hists: np.ndarray, weights: np.ndarray, scope: str = "all", similarity: str = "cosine",
               tau: float = 0.1) -> np.ndarray:
    """W ((K N) x (K N), row (k, n) at k N + n) from the clients' histograms ``hists`` (K, N, C)
    of one block and their weights (K,); rows sum to 1 (module docstring)."""
    hists = np.clip(np.asarray(hists, dtype=np.float64), 0.0, None)  # DP noise can make counts negative
    k, n, _ = hists.shape
    rows = hists.reshape(k * n, -1)
    norms = np.linalg.norm(rows, axis=1)
    unit = np.divide(rows, norms[:, None], out=np.zeros_like(rows), where=norms[:, None] > 0)
    sim = unit @ unit.T
    np.fill_diagonal(sim, 1.0)
    if scope == "component":
        component = np.tile(np.arange(n), k)
        allowed = component[:, None] == component[None, :]
    elif scope == "all":
        allowed = np.ones_like(sim, dtype=bool)
    else:
        raise ValueError(f"unknown CPA scope {scope!r}")
    column = np.repeat(np.asarray(weights, dtype=np.float64), n)[None, :]
    if similarity == "cosine":
        w = np.where(allowed, sim, 0.0) * column
    elif similarity == "softmax":
        logits = np.where(allowed, sim / tau, -np.inf)
        w = np.exp(logits - logits.max(1, keepdims=True)) * column  # the diagonal is allowed: max finite
    else:
        raise ValueError(f"unknown CPA similarity {similarity!r}")
    return w / w.sum(1, keepdims=True)


def cpa_copies(values: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """P* = W P: ``values`` (K, N, ...) the clients' rows, ``matrix`` W ((K N) x (K N)); (K, N, ...), float64."""
    v = np.asarray(values, dtype=np.float64)
    return (matrix @ v.reshape(v.shape[0] * v.shape[1], -1)).reshape(v.shape)


def collapse_weights(hists: np.ndarray, weights: np.ndarray, mode: str = "usage") -> np.ndarray:
    """pi (N, K): each component's weights over the clients' CPA copies, summing to 1 per component."""
    hists = np.clip(np.asarray(hists, dtype=np.float64), 0.0, None)
    w = np.asarray(weights, dtype=np.float64)
    base = np.tile(w, (hists.shape[1], 1))  # (N, K)
    if mode == "samples":
        return base / base.sum(1, keepdims=True)
    if mode != "usage":
        raise ValueError(f"unknown CPA collapse {mode!r}")
    usage = hists.sum(2)  # (K, N): selections of each component
    per_client = usage.sum(1, keepdims=True)
    share = np.divide(usage, per_client, out=np.zeros_like(usage), where=per_client > 0)
    pi = share.T * w[None, :]
    empty = pi.sum(1) <= 0
    pi[empty] = base[empty]
    return pi / pi.sum(1, keepdims=True)


def class_aware_aggregate(values: np.ndarray, hists: np.ndarray, weights: np.ndarray, scope: str = "all",
                          collapse: str = "usage", similarity: str = "cosine",
                          tau: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """One block's component array aggregated by CPA into one pool (``merge``): ``values`` (K, N, ...)
    the clients' copies of the task's slice rows; returns (global rows (N, ...), the CPA copies
    (K, N, ...)). Float64."""
    copies = cpa_copies(values, cpa_matrix(hists, weights, scope, similarity, tau))
    pi = collapse_weights(hists, weights, collapse)  # (N, K)
    return np.einsum("nk,kn...->n...", pi, copies), copies
