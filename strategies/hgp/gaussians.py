"""HGP's generative prototypes: per-class statistics on the wire, Gaussian mixtures, hierarchical
sampling and the rebalancing of the head (sections 3.2.2-3.3, eq. 7)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord

from ...common.records import to_array_record
from .options import HGPOptions

log = logging.getLogger("promptfcl")

#: absolute floor of the covariance ridge (a class seen once has a zero covariance)
ABS_EPS = 1e-6
FLOAT16_MAX = 65504.0


# ---------------------------------------------------------------------------- statistics on the wire
@dataclass
class ClassStats:
    """Per-class statistics of one client, decoded (float64 torch tensors).

    ``cov`` holds, by ``kind``: full -> (C, D, D); diag -> (C, D) variances;
    lowrank -> None with ``factor`` (C, D, r) and ``diag`` (C, D) residual variances.
    """

    kind: str
    classes: torch.Tensor  # int64 (C,)
    counts: torch.Tensor  # int64 (C,)
    means: torch.Tensor  # (C, D)
    cov: torch.Tensor | None = None
    factor: torch.Tensor | None = None
    diag: torch.Tensor | None = None


def _to_wire(x: torch.Tensor, dtype: str) -> np.ndarray:
    arr = x.detach().cpu().double().numpy()
    if dtype == "float16":  # clip first: an overflow would arrive as inf
        return np.clip(arr, -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16)
    return arr.astype(np.float32)


def class_statistics(features: torch.Tensor, labels: torch.Tensor, opts: HGPOptions) -> ArrayRecord:
    """Count, mean and covariance of ``features`` per label, encoded as a ``class-stats`` record.

    Parameters
    ----------
    features : Tensor (N, D)
        Prompted pre-logit features of the client's local samples.
    labels : Tensor (N,)
        Their labels.
    opts : HGPOptions
        Chooses the covariance encoding (``cov-type``, ``cov-rank``, ``cov-dtype``).

    A class seen once gets a zero covariance (the server's ridge makes it samplable).
    """
    x = features.detach().double().cpu()
    y = labels.detach().long().cpu()
    classes = torch.unique(y)
    dim = x.shape[1]
    counts, means, covs, factors, diags = [], [], [], [], []
    iu = torch.triu_indices(dim, dim)
    rank = min(opts.cov_rank, dim)
    for c in classes.tolist():
        xc = x[y == c]
        n = len(xc)
        mu = xc.mean(0)
        centred = (xc - mu) / math.sqrt(max(n - 1, 1))  # unbiased; all zeros when n == 1
        counts.append(n)
        means.append(mu)
        if opts.cov_type == "full":
            cov = centred.T @ centred
            if opts.cov_shrinkage == "ledoit-wolf" and n > 1:
                cov = ledoit_wolf(xc, cov)
            covs.append(cov[iu[0], iu[1]])
        elif opts.cov_type == "diag":
            diags.append((centred**2).sum(0))
        else:  # lowrank: top principal directions of the centred data (rank <= n - 1)
            _, sing, vh = torch.linalg.svd(centred, full_matrices=False)
            r = min(rank, len(sing))
            fac = torch.zeros(dim, rank, dtype=torch.float64)
            fac[:, :r] = vh[:r].T * sing[:r]
            factors.append(fac)
            diags.append(((centred**2).sum(0) - (fac**2).sum(1)).clamp_min(0.0))
    out: dict[str, np.ndarray] = {
        "classes": classes.numpy().astype(np.int64),
        "counts": np.asarray(counts, dtype=np.int64),
        "means": torch.stack(means).float().numpy(),
    }
    if opts.cov_type == "full":
        out["cov-triu"] = _to_wire(torch.stack(covs), opts.cov_dtype)
    if opts.cov_type in ("diag", "lowrank"):
        out["cov-diag"] = _to_wire(torch.stack(diags), opts.cov_dtype)
    if opts.cov_type == "lowrank":
        out["cov-factor"] = _to_wire(torch.stack(factors), opts.cov_dtype)
    return to_array_record(out)


def ledoit_wolf(samples: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """``cov`` shrunk toward mu I (mu: its mean variance) by the Ledoit-Wolf intensity of
    ``samples`` (scikit-learn's estimate, "A well-conditioned estimator for large-dimensional
    covariance matrices", Ledoit and Wolf 2004): (1 - s) cov + s mu I."""
    # scikit-learn is slow to import: only the shrinkage estimate needs it
    from sklearn.covariance import ledoit_wolf_shrinkage

    shrinkage = float(ledoit_wolf_shrinkage(samples.numpy()))
    mu = torch.diagonal(cov).mean()
    return (1 - shrinkage) * cov + shrinkage * mu * torch.eye(len(cov), dtype=cov.dtype)


#: the covariance arrays of each encoding on the wire
WIRE_ARRAYS = {"full": ("cov-triu",), "diag": ("cov-diag",), "lowrank": ("cov-factor", "cov-diag")}
#: the largest magnitude a class mean of prompted features can have: they leave the backbone's
#: final LayerNorm, so honest values are of order 1-10 (the covariances: this squared)
FEATURE_BOUND = 1e4


def check_class_stats(arrays: Mapping[str, np.ndarray], dim: int) -> str:
    """Validate a ``class-stats`` record (NumPy arrays) without unpacking it; return its kind.

    Raises ValueError for missing arrays, shapes that do not fit ``dim``, non-integer or
    negative counts, repeated classes, or non-finite values.
    """
    for name in ("classes", "counts", "means"):
        if name not in arrays:
            raise ValueError(f"class-stats lacks {name!r}")
    classes, counts, means = (np.asarray(arrays[k]) for k in ("classes", "counts", "means"))
    n = len(classes)
    if classes.ndim != 1 or counts.shape != (n,) or means.shape != (n, dim):
        raise ValueError(f"class-stats shapes do not fit {n} classes of dim {dim}: "
                         f"counts {counts.shape}, means {means.shape}")
    if not np.issubdtype(classes.dtype, np.integer) or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError("class-stats classes and counts must be integers")
    if (counts < 0).any():
        raise ValueError("class-stats has negative counts")
    if len(np.unique(classes)) != n:
        raise ValueError("class-stats repeats a class")
    expected: dict[str, tuple[int, ...]]
    if "cov-triu" in arrays:
        kind, expected = "full", {"cov-triu": (n, dim * (dim + 1) // 2)}
    elif "cov-factor" in arrays:
        rank = np.asarray(arrays["cov-factor"]).shape[-1]
        kind, expected = "lowrank", {"cov-factor": (n, dim, rank), "cov-diag": (n, dim)}
    elif "cov-diag" in arrays:
        kind, expected = "diag", {"cov-diag": (n, dim)}
    else:
        raise ValueError("class-stats carries no covariance (cov-triu, cov-diag or cov-factor)")
    for name, shape in expected.items():
        if name not in arrays or np.asarray(arrays[name]).shape != shape:
            got = np.asarray(arrays[name]).shape if name in arrays else None
            raise ValueError(f"{name} has shape {got}, expected {shape}")
        if not np.issubdtype(np.asarray(arrays[name]).dtype, np.floating):
            raise ValueError(f"{name} must be floating point")
    for name in ("means", *expected):
        if not np.isfinite(arrays[name]).all():
            raise ValueError(f"class-stats {name} has non-finite values")
    return kind


def decode_class_stats(arrays: Mapping[str, np.ndarray], dim: int) -> ClassStats:
    """Check and decode a ``class-stats`` record (as NumPy arrays); ValueError if malformed."""
    kind = check_class_stats(arrays, dim)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.float64))  # noqa: E731
    classes = torch.from_numpy(np.asarray(arrays["classes"]).astype(np.int64))
    counts = torch.from_numpy(np.asarray(arrays["counts"]).astype(np.int64))
    if kind == "full":
        iu = torch.triu_indices(dim, dim)
        cov = torch.zeros(len(classes), dim, dim, dtype=torch.float64)
        cov[:, iu[0], iu[1]] = t(arrays["cov-triu"])
        cov = cov + cov.transpose(1, 2) - torch.diag_embed(torch.diagonal(cov, dim1=1, dim2=2))
        return ClassStats(kind, classes, counts, t(arrays["means"]), cov=cov)
    if kind == "lowrank":
        return ClassStats(kind, classes, counts, t(arrays["means"]), factor=t(arrays["cov-factor"]),
                          diag=t(arrays["cov-diag"]))
    return ClassStats(kind, classes, counts, t(arrays["means"]), cov=t(arrays["cov-diag"]))


# ---------------------------------------------------------------------------- mixtures
@dataclass
class ClassMixture:
    """Tier 1: one class's Gaussian mixture over the clients that hold it.

    Component k (one client) is sampled as ``mu_k + F_k z1 + s_k * z2``; ``factor``
    (K, D, r) or ``std`` (K, D) may be None. ``counts`` are the clients' sample counts.
    """

    label: int
    counts: torch.Tensor  # float64 (K,), all > 0
    means: torch.Tensor  # float32 (K, D)
    factor: torch.Tensor | None  # float32 (K, D, r)
    std: torch.Tensor | None  # float32 (K, D)

    @property
    def total(self) -> float:
        return float(self.counts.sum())

    @property
    def weights(self) -> torch.Tensor:
        """Tier-1 component weights: each client's share of this class's samples."""
        return self.counts / self.counts.sum()

    def covariances(self) -> torch.Tensor:
        """(K, D, D) regularised covariance of every component (for tests and diagnostics)."""
        k, d = self.means.shape
        cov = torch.zeros(k, d, d, dtype=torch.float64)
        if self.factor is not None:
            f = self.factor.double()
            cov = cov + f @ f.transpose(1, 2)
        if self.std is not None:
            cov = cov + torch.diag_embed(self.std.double() ** 2)
        return cov


def _ridge(avg_var: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-component ridge: relative to its average variance, never below ABS_EPS."""
    return eps * avg_var.clamp_min(0.0) + ABS_EPS


def build_mixture(label: int, counts: torch.Tensor, means: torch.Tensor, kind: str,
                  cov: torch.Tensor | None, factor: torch.Tensor | None, diag: torch.Tensor | None,
                  eps: float) -> ClassMixture | None:
    """Regularise and factorise one class's components; drop those with zero count.

    Returns None when no component has a positive count.
    """
    keep = counts > 0
    if not bool(keep.any()):
        return None
    counts, means = counts[keep].double(), means[keep].double()
    dim = means.shape[1]
    fac = std = None
    if kind == "full":
        assert cov is not None
        c = cov[keep].double()
        c = 0.5 * (c + c.transpose(1, 2))  # float16 transport can break symmetry
        eye = torch.eye(dim, dtype=torch.float64)
        ridge = _ridge(torch.diagonal(c, dim1=1, dim2=2).mean(1), eps)
        fac, info = torch.linalg.cholesky_ex(c + ridge[:, None, None] * eye)
        bad = torch.nonzero(info).flatten()
        # Not positive definite (rounding, float16 transport): a 10x, 100x, 1000x larger ridge
        # first (Cholesky is cheap), then clamp the spectrum (eigh, slow but never fails).
        for boost in (10.0, 100.0, 1000.0):
            if len(bad) == 0:
                break
            retry, info = torch.linalg.cholesky_ex(c[bad] + (boost * ridge[bad])[:, None, None] * eye)
            fac[bad] = retry
            bad = bad[info != 0]
        if len(bad):
            evals, evecs = torch.linalg.eigh(c[bad])
            evals = evals.clamp_min(0.0) + ridge[bad][:, None]
            fac[bad] = evecs * evals.sqrt()[:, None, :]
            log.debug("class %d: %d covariance(s) not positive definite, spectrum clamped", label, len(bad))
    elif kind == "diag":
        assert cov is not None
        var = cov[keep].double().clamp_min(0.0)
        std = (var + _ridge(var.mean(1), eps)[:, None]).sqrt()
    elif kind == "lowrank":
        assert factor is not None and diag is not None
        f, d = factor[keep].double(), diag[keep].double().clamp_min(0.0)
        avg_var = ((f**2).sum((1, 2)) + d.sum(1)) / dim
        fac, std = f, (d + _ridge(avg_var, eps)[:, None]).sqrt()
    else:
        raise ValueError(f"unknown covariance kind {kind!r}")
    return ClassMixture(int(label), counts, means.float(), None if fac is None else fac.float(),
                        None if std is None else std.float())


def class_weights(mixtures: list[ClassMixture], scheme: str = "counts") -> torch.Tensor:
    """Tier-2 weights over ``mixtures``: normalised class counts (paper) or uniform."""
    if scheme == "uniform":
        w = torch.ones(len(mixtures), dtype=torch.float64)
    else:
        w = torch.tensor([m.total for m in mixtures], dtype=torch.float64)
    return w / w.sum()


def sample_features(mixtures: list[ClassMixture], weights: torch.Tensor, n: int, multiplier: float,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Hierarchical sampling: class (Tier 2) -> client component (Tier 1) -> feature.

    Parameters
    ----------
    mixtures : list of ClassMixture
        One per class that may be drawn.
    weights : Tensor (C,)
        Tier-2 class weights (need not be normalised).
    n : int
        Number of features.
    multiplier : float
        Every component's covariance is scaled by this (widens the synthetic set).
    generator : torch.Generator
        Source of randomness (seeded by the caller).

    Returns
    -------
    (features float32 (n, D), labels int64 (n,)), grouped by component (shuffle before use).
    """
    dim = mixtures[0].means.shape[1]
    kmax = max(len(m.counts) for m in mixtures)
    # Tier 2 then Tier 1, both vectorised: padded (C, Kmax) component weights
    comp_w = torch.zeros(len(mixtures), kmax, dtype=torch.float64)
    for i, m in enumerate(mixtures):
        comp_w[i, : len(m.counts)] = m.weights
    cls = torch.multinomial(weights.double(), n, replacement=True, generator=generator)
    comp = torch.multinomial(comp_w[cls], 1, replacement=True, generator=generator).squeeze(1)
    per_key = torch.bincount(cls * kmax + comp, minlength=len(mixtures) * kmax).view(len(mixtures), kmax)
    scale = math.sqrt(multiplier)
    feats, labels = [], []
    for i, m in enumerate(mixtures):
        for k in torch.nonzero(per_key[i]).flatten().tolist():
            count = int(per_key[i, k])
            x = torch.zeros(count, dim)
            if m.factor is not None:
                z1 = torch.randn(count, m.factor.shape[2], generator=generator)
                x = x + z1 @ m.factor[k].T
            if m.std is not None:
                x = x + torch.randn(count, dim, generator=generator) * m.std[k]
            feats.append(m.means[k] + scale * x)
            labels.append(torch.full((count,), m.label, dtype=torch.long))
    return torch.cat(feats), torch.cat(labels)


# ---------------------------------------------------------------------------- rebalancing
def rebalance_head(weight: torch.Tensor, bias: torch.Tensor, draw: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                   allowed: torch.Tensor, opts: HGPOptions,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit the head to synthetic features by CE over the ``allowed`` (seen) classes (eq. 7).

    Parameters
    ----------
    weight, bias : Tensor
        The averaged head (num_classes, D) and (num_classes,); not modified in place.
    draw : callable
        ``draw(epoch) -> (features, labels)``; the same set every epoch unless the
        caller resamples (``resample-each-epoch``).
    allowed : Tensor
        Class indices that compete in the softmax (all classes seen so far).
    opts : HGPOptions
        Optimiser, schedule and loss settings.
    generator : torch.Generator
        Shuffling.

    Returns
    -------
    (weight, bias) after ``rebalance-epochs`` epochs of SGD with momentum.
    """
    w = weight.detach().clone().float().requires_grad_(True)
    b = bias.detach().clone().float().requires_grad_(True)
    allowed = allowed.long()
    to_pos = torch.full((weight.shape[0],), -1, dtype=torch.long)
    to_pos[allowed] = torch.arange(len(allowed))
    optimizer = torch.optim.SGD([w, b], lr=opts.rebalance_lr, momentum=opts.rebalance_momentum)
    feats, labels = draw(0)
    steps_per_epoch = math.ceil(len(labels) / opts.rebalance_batch_size)
    per_epoch = opts.rebalance_schedule == "cosine-epoch"  # the lab code's stepping (options.py)
    scheduler = (
        torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer, T_max=opts.rebalance_epochs * (1 if per_epoch else steps_per_epoch))
        if opts.rebalance_schedule in ("cosine", "cosine-epoch")
        else None
    )
    for epoch in range(opts.rebalance_epochs):
        if epoch > 0 and opts.resample_each_epoch:
            feats, labels = draw(epoch)
        targets = to_pos[labels]
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(order), opts.rebalance_batch_size):
            idx = order[start : start + opts.rebalance_batch_size]
            logits = (feats[idx] @ w[allowed].T) + b[allowed]
            if opts.loss == "logit-norm":  # authors' code: decouple the logits' scale
                logits = logits / (logits.norm(dim=-1, keepdim=True) + 1e-12) / opts.logit_temperature
            loss = F.cross_entropy(logits, targets[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if scheduler is not None and not per_epoch:
                scheduler.step()
        if scheduler is not None and per_epoch:
            scheduler.step()
    return w.detach(), b.detach()


def _mixture_from_raw(label: int, raw: Mapping[str, np.ndarray], eps: float) -> ClassMixture | None:
    """One class's mixture from its stored components (as received: the platform has bounded them
    where the run is defended)."""
    arrays = {"classes": np.arange(len(raw["counts"]), dtype=np.int64), **raw}
    stats = decode_class_stats(arrays, int(raw["means"].shape[1]))
    counts, means, cov, factor, diag = stats.counts, stats.means, stats.cov, stats.factor, stats.diag
    return build_mixture(label, counts, means, stats.kind, cov, factor, diag, eps)
