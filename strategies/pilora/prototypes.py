"""PILoRA's prototype re-weighting (heterogeneity-aware aggregation; the authors' ``utils.compute_weight``,
fed-mammoth's ``PiLora.end_round_server``).

For one class k: every client i of the round uploaded a prototype ``c_i`` (its head row k) and the
clients j in P_k, those holding the class, a class mean ``mu_j``. Then

    s_i = sum_{j in P_k} ||c_i - mu_j||,  u_i = 1 / s_i,  u~ = (u - min u) / (max u - min u),
    w = softmax(u~ / tau),  c_k = sum_i w_i c_i

so the prototype nearest to the class means of every holder weighs most. Neither code guards
max u = min u (one client, or equal distances): here that gives uniform weights, never NaN.
"""

from __future__ import annotations

import numpy as np


def heterogeneity_weights(prototypes: np.ndarray, means: np.ndarray, temperature: float) -> np.ndarray:
    """The clients' weights w (n,) of one class: ``prototypes`` (n, D) the clients' ``c_i``,
    ``means`` (m, D) the holders' class means (m >= 1), ``temperature`` tau (module docstring).

    Uniform where the min-max normalisation is undefined (one client, or every s_i equal).
    """
    c = np.asarray(prototypes, dtype=np.float64)
    mu = np.asarray(means, dtype=np.float64)
    n = len(c)
    if n == 1 or len(mu) == 0:
        return np.full(n, 1.0 / n)
    s = np.linalg.norm(c[:, None, :] - mu[None, :, :], axis=-1).sum(axis=1)
    u = 1.0 / np.maximum(s, np.finfo(np.float64).tiny)  # a prototype on every mean: the largest u
    spread = float(u.max() - u.min())
    if not np.isfinite(spread) or spread <= 0 or spread <= 1e-12 * float(u.max()):
        return np.full(n, 1.0 / n)
    z = (u - u.min()) / spread / temperature
    w = np.exp(z - z.max())
    return w / w.sum()


def reweighted_prototypes(prototypes: np.ndarray, means: np.ndarray, holds: np.ndarray,
                          temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """Every class's re-weighted prototype from the clients' (module docstring).

    Parameters
    ----------
    prototypes : (n, K, D) each client's prototypes of the K classes.
    means : (n, K, D) each client's class means (rows where ``holds`` is False are ignored).
    holds : (n, K) bool, whether client i uploaded a mean of class k.
    temperature : tau.

    Returns
    -------
    (K, D) float64 prototypes, and (K, n) the weights. A class no client holds takes the uniform
    mean of the prototypes (the authors' code's uniform weights).
    """
    c = np.asarray(prototypes, dtype=np.float64)
    n, k = c.shape[:2]
    weights = np.full((k, n), 1.0 / n)
    for j in range(k):
        held = np.asarray(holds[:, j], dtype=bool)
        if held.any():
            weights[j] = heterogeneity_weights(c[:, j], np.asarray(means, dtype=np.float64)[held, j], temperature)
    return np.einsum("kn,nkd->kd", weights, c), weights
