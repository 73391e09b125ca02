"""HGP: Hierarchical Generative Prototypes ("Reducing Bias in Federated Class-Incremental Learning with
Hierarchical Generative Prototypes", section 3 and Appendix B).

Clients prompt a frozen ViT (a pool of prompts with keys; cosine scores of the query
against the keys, normalised, weigh the prompts; prefix-tuning; one head) and, after
local training, upload for every local class its sample count, mean and covariance
of the prompted features: a *generative prototype*. The server

1. averages prompts and head by sample count (FedAvg, eq. 3);
2. Tier 1: per class, a Gaussian mixture over the clients that hold it, component
   weights proportional to each client's count of that class;
3. Tier 2: a mixture over classes, weights proportional to the class counts;
   mixtures of earlier tasks are kept;
4. samples hierarchically (class -> client component -> feature, covariance scaled
   by a multiplier) and rebalances the whole head (all seen classes) by
   cross-entropy, SGD with momentum 0.9, 5 epochs, cosine schedule (eq. 7);
5. sends the rebalanced head with the averaged prompts back to the clients.

With asynchronous arrival (clients on different tasks in one round) the statistics are kept
per (class, client) under the client and task the server sent, newer replacing older (see
:meth:`HGPStrategy.ingest`), and rebalancing covers CR_old (tasks every client has left) and
CR_cur (tasks some client is on).

The wire format of the ``class-stats`` record (one row per local class) is defined
here, :func:`class_statistics` (client) and :func:`check_class_stats` /
:func:`decode_class_stats` (server), so both sides share it.
Covariance encodings, by option ``cov-type``:

* ``full``    packed upper triangle, D(D+1)/2 values per class (lossless);
* ``diag``    the D variances;
* ``lowrank`` a D x r factor F of the top principal directions plus the residual
  diagonal d, Sigma ~ F F^T + diag(d) (exact when the class has <= r+1 samples);

each in float32 or float16 (``cov-dtype``). Means are always float32.

Every component is sampled as ``x = mu + sqrt(m) * (F z1 + s * z2)`` with z1, z2
standard normal: full -> F = Cholesky factor, diag -> s = standard deviations,
lowrank -> both. Covariances are regularised (a ridge relative to their trace, grown
10x/100x/1000x where Cholesky fails, then eigenvalue clamping) so sampling never fails.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Message, RecordDict

from promptfcl.common.config import ConfigError, ExperimentConfig, MethodOptions
from promptfcl.common.data import seen_classes, task_classes
from promptfcl.common.model import CodaPrompt
from promptfcl.common.privacy import PrivateRecord
from promptfcl.common.records import ARRAYS, METRICS, from_array_record, to_array_record
from promptfcl.strategies.platform.strategy import PromptStrategy

log = logging.getLogger("promptfcl")

#: name of the record carrying a client's per-class statistics
STATS = "class-stats"
COV_TYPES = ("full", "diag", "lowrank")
COV_DTYPES = ("float32", "float16")
LOSSES = ("ce", "logit-norm")
CLASS_WEIGHTS = ("counts", "uniform")
SCHEDULES = ("cosine", "constant")
LOGIT_SETS = ("seen", "sampled")
#: absolute floor of the covariance ridge (a class seen once has a zero covariance)
ABS_EPS = 1e-6
FLOAT16_MAX = 65504.0


# ---------------------------------------------------------------------------- options
@dataclass(frozen=True)
class HGPOptions(MethodOptions):
    """HGP's options (run-config keys ``hgp.<key>``, kebab-case).

    Defaults follow the paper; values its copy leaves blank come from the authors'
    code (marked "code"). Authors'-code behaviours are available as options.
    """

    prefix = "hgp"

    cov_type: str = "full"  # "full" (paper), "diag" (authors' code default), "lowrank"
    cov_rank: int = 16  # r of the low-rank-plus-diagonal encoding
    cov_dtype: str = "float32"  # transport precision of the covariance: "float32" or "float16"
    cov_multiplier: float = 3.0  # covariance scale when sampling (code: 3)
    cov_eps: float = 1e-4  # ridge, relative to a component's average variance
    samples_per_class: int = 256  # average synthetic features per class (code: 256)
    class_weights: str = "counts"  # Tier 2: "counts" (paper) or "uniform" (authors' code)
    rebalance_old: bool = True  # CR_old: synthetic features of earlier tasks' classes
    rebalance_cur: bool = True  # CR_cur: synthetic features of the current task's classes
    # classes competing in the rebalancing softmax: all seen so far, or only those sampled
    # (differs only in the CR ablations: CR_cur alone with "seen" pushes every old class down)
    rebalance_logits: str = "seen"
    rebalance_epochs: int = 5
    rebalance_lr: float = 0.01
    rebalance_momentum: float = 0.9
    rebalance_batch_size: int = 256  # (code: 256)
    rebalance_schedule: str = "cosine"  # "cosine" (paper) or "constant" (authors' code)
    resample_each_epoch: bool = False  # a fresh synthetic set every epoch (authors' code)
    loss: str = "ce"  # "ce" (paper) or "logit-norm" (authors' code: logits / ||logits|| / T)
    logit_temperature: float = 0.1  # T of the logit-normalised CE
    # With augment = crop-flip: class statistics over the stored images (false), the features the
    # head is scored on, or over one augmented view of each image (true: the augmenting training
    # pipeline's views, wider covariances and shifted means). The paper does not say; on the
    # offline benchmark true costs 26 points of A_N (README, HGP). No effect with augment = none.
    stats_augment: bool = False

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError("hgp." + msg)

        need(self.cov_type in COV_TYPES, f"cov-type must be one of {COV_TYPES}, got {self.cov_type!r}")
        need(self.cov_dtype in COV_DTYPES, f"cov-dtype must be one of {COV_DTYPES}, got {self.cov_dtype!r}")
        need(self.cov_rank >= 1, f"cov-rank must be >= 1, got {self.cov_rank}")
        need(self.cov_multiplier > 0, f"cov-multiplier must be > 0, got {self.cov_multiplier}")
        need(self.cov_eps >= 0, f"cov-eps must be >= 0, got {self.cov_eps}")
        need(self.samples_per_class >= 1, f"samples-per-class must be >= 1, got {self.samples_per_class}")
        need(self.class_weights in CLASS_WEIGHTS, f"class-weights must be one of {CLASS_WEIGHTS}")
        need(self.rebalance_epochs >= 1, "rebalance-epochs must be >= 1")
        need(self.rebalance_lr > 0, "rebalance-lr must be > 0")
        need(0 <= self.rebalance_momentum < 1, "rebalance-momentum must be in [0, 1)")
        need(self.rebalance_batch_size >= 1, "rebalance-batch-size must be >= 1")
        need(self.rebalance_schedule in SCHEDULES, f"rebalance-schedule must be one of {SCHEDULES}")
        need(self.rebalance_logits in LOGIT_SETS, f"rebalance-logits must be one of {LOGIT_SETS}")
        need(self.loss in LOSSES, f"loss must be one of {LOSSES}, got {self.loss!r}")
        need(self.logit_temperature > 0, "logit-temperature must be > 0")


class HGPPrompt(CodaPrompt):
    """A pool of prompts with keys, weighted by normalised cosine scores (paper 3.2.1).

    Weight of prompt m: ``s_m = cos(q, K_m)`` (no attention vectors), normalised to
    ``alpha_m = s_m / sum_j |s_j|`` so that the prompt's scale does not grow with the
    pool ("these scores are then normalized"; the paper does not say how, and the
    authors' public code does not use keys at all). Task slices, freezing of earlier
    slices and orthogonal initialisation are CODA-P's, as in the shared base.
    """

    kinds = "pk"  # no attention vectors: they are neither trained nor transmitted

    def weights(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """alpha (B, M_active): cosine of the query with each key, L1-normalised over the pool."""
        keys = self._active("k", layer, self.training)
        scores = F.normalize(query, dim=-1) @ F.normalize(keys, dim=-1).T
        return scores / scores.abs().sum(dim=-1, keepdim=True).clamp_min(1e-8)

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
            covs.append((centred.T @ centred)[iu[0], iu[1]])
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
        var = cov[keep].double().clamp_min(0.0)
        std = (var + _ridge(var.mean(1), eps)[:, None]).sqrt()
    elif kind == "lowrank":
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
                   allowed: torch.Tensor, opts: HGPOptions, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
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
    scheduler = (torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=opts.rebalance_epochs * steps_per_epoch)
                 if opts.rebalance_schedule == "cosine" else None)
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
            if scheduler is not None:
                scheduler.step()
    return w.detach(), b.detach()


# ---------------------------------------------------------------------------- the strategy
class HGPStrategy(PromptStrategy):
    """FedAvg of prompts and head, then classifier rebalancing on hierarchical generative prototypes.

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's configuration.
    num_classes : int
        Classes of the whole stream.
    options : dict, optional
        ``hgp.*`` options, see :class:`HGPOptions`.
    """

    per_task_in_flight = True  # asynchronous arrival: a task's slice over the clients on it

    name = "hgp"
    random_tasks = False  # CR_old / CR_cur follow the stream's task order
    prompt_class = HGPPrompt
    reply_records = frozenset({ARRAYS, METRICS, STATS})
    options_class = HGPOptions
    # With dp.clip = C the client clips every feature to norm C before its statistics
    # (client/hgp.py), so a class mean has norm <= C, and the unbiased covariance, positive
    # semi-definite with trace sum ||x - mu||^2 / (n - 1) = n / (n - 1) (mean ||x||^2 - ||mu||^2)
    # <= 2 C^2 (n >= 2; zero for n = 1), has Frobenius norm, and so upper-triangle and diagonal
    # norms, <= 2 C^2. Classes and counts are the label histogram, sent in the clear.
    private_records = {STATS: PrivateRecord(bounded={"means": (1, 1.0), "cov-triu": (2, 2.0), "cov-diag": (2, 2.0)},
                                            public=("classes", "counts"))}

    @classmethod
    def privacy_refusal(cls, cfg: ExperimentConfig) -> str:
        """Low-rank covariances are refused: noise on SVD factors is not noise on a bounded covariance."""
        if HGPOptions.from_options(cfg.method_options(cls.name)).cov_type == "lowrank":
            return ("hgp.cov-type = lowrank uploads SVD factors, a nonlinear function of the covariance; "
                    "use cov-type full or diag")
        return ""

    def uploaded_features(self, classes: list[int], seed: int) -> list[dict[str, Any]]:
        """Per class, the Gaussian of the client with most samples of it: its mean and one draw from
        it (covariance unscaled: what the client sent, not the widened sampler of rebalancing)."""
        generator = torch.Generator().manual_seed(seed)
        out = []
        for c in (c for c in classes if c in self.class_stats):
            raw = self.class_stats[c]
            k = int(np.argmax(raw["counts"]))
            row = {name: np.asarray(v)[k : k + 1] for name, v in raw.items()}
            stats = decode_class_stats({**row, "classes": np.zeros(1, np.int64)}, int(row["means"].shape[1]))
            client, meta = int(row["clients"][0]), {"count": int(row["counts"][0]), "covariance": stats.kind}
            out.append({"class": c, "kind": "mean", "vector": stats.means[0].numpy(), "client": client, "meta": meta})
            mixture = build_mixture(c, stats.counts, stats.means, stats.kind, stats.cov, stats.factor, stats.diag,
                                    self.opts.cov_eps)
            if mixture is not None:
                draw, _ = sample_features([mixture], torch.ones(1), 1, 1.0, generator)
                out.append({"class": c, "kind": "gaussian-sample", "vector": draw[0].numpy(), "client": client,
                            "meta": meta})
        return out

    def __init__(self, cfg: ExperimentConfig, num_classes: int, options: dict[str, Any] | None = None) -> None:
        super().__init__(cfg, num_classes, options)
        self.opts = HGPOptions.from_options(self.options)
        self.task = 0  # the newest task some client has started
        # per class: its clients' statistics as received, one row per client, with the client
        # ("clients") and the server round it arrived in ("rounds") (checkpointed), and the
        # prepared mixture (a cache rebuilt from them)
        self.class_stats: dict[int, dict[str, np.ndarray]] = {}
        self._mixtures: dict[int, ClassMixture | None] = {}
        self.last_rebalance: dict[str, float] = {}

    # ------------------------------------------------------------------ hooks
    def on_task_start(self, task: int, arrays: ArrayRecord) -> ArrayRecord:
        self.task = task
        return super().on_task_start(task, arrays)

    def check_reply(self, msg: Message) -> str | None:
        """The base checks, then the class statistics: well-formed (:func:`check_class_stats`), in
        the configured encoding, for classes of the current task, counting exactly the reply's
        samples, with values a layer-normed feature can have. A bad record excludes the reply whole."""
        reason = super().check_reply(msg)
        if reason is not None or int(msg.content[METRICS]["num-examples"]) == 0:
            return reason
        if STATS not in msg.content.array_records:
            return f"{STATS!r} is not an array record"
        arrays = from_array_record(msg.content[STATS])
        dim = int(self.sent_arrays["head.weight"].shape[1]) if self.sent_arrays is not None else \
            int(np.asarray(arrays.get("means", np.zeros((0, 0)))).shape[-1])
        try:
            kind = check_class_stats(arrays, dim)
        except ValueError as exc:
            return f"class statistics: {exc}"
        if kind != self.opts.cov_type:
            return f"class statistics carry a {kind} covariance, the run uses {self.opts.cov_type}"
        expected = {"classes", "counts", "means"} | set(WIRE_ARRAYS[kind])
        if set(arrays) != expected:
            return f"class statistics hold {sorted(arrays)}, expected {sorted(expected)}"
        if int(arrays["counts"].sum()) != int(msg.content[METRICS]["num-examples"]):
            # the counts weigh the mixtures: they must be the samples the client trained on
            return (f"class counts sum to {int(arrays['counts'].sum())}, "
                    f"num-examples is {int(msg.content[METRICS]['num-examples'])}")
        task = self.assigned_task(msg)
        if task is None:
            if not self.schedule.synchronous:
                return "cannot tell which task this reply trained (no matching message sent this round)"
            task = self.task
        outside = set(arrays["classes"].tolist()) - set(task_classes(self.cfg, task, self.num_classes).tolist())
        if outside:
            return f"class statistics for classes {sorted(outside)[:5]} outside the task it was sent"
        for name, bound in (("means", FEATURE_BOUND), *((k, FEATURE_BOUND**2) for k in WIRE_ARRAYS[kind])):
            if np.abs(arrays[name]).max(initial=0.0) > bound:
                return f"class statistics {name} beyond {bound:g}, impossible for layer-normed features"
        return None

    def consolidate(self, server_round: int, arrays: ArrayRecord, replies: list[RecordDict]) -> ArrayRecord:
        """Update this round's class mixtures from the replies, then rebalance the head."""
        started = time.perf_counter()
        state = from_array_record(arrays)
        dim = int(state["head.weight"].shape[1])
        origins = self.reply_origins(replies)
        if origins is not None:  # unknown clients (-1, -2, ...): each one distinct
            origins = [(-1 - i if client is None else client, self.task if task is None else task)
                       for i, (client, task) in enumerate(origins)]
        self.ingest(replies, server_round, origins)
        in_flight = None if self.schedule.synchronous else self.tasks_in_flight(server_round - 1)
        mixtures = self.rebalance_mixtures(in_flight)
        if not mixtures:
            return arrays
        gen = torch.Generator().manual_seed(int(np.random.default_rng([self.cfg.seed, server_round, 0x46B]).integers(2**31)))
        weights = class_weights(mixtures, self.opts.class_weights)
        n = self.opts.samples_per_class * len(mixtures)
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def draw(epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
            if epoch not in cache:
                cache.clear()
                cache[epoch] = sample_features(mixtures, weights, n, self.opts.cov_multiplier, gen)
            return cache[epoch]

        if self.opts.rebalance_logits == "seen":
            newest = self.task if in_flight is None else in_flight[-1]
            allowed = torch.as_tensor(seen_classes(self.cfg, newest, self.num_classes))
        else:
            allowed = torch.tensor(sorted(m.label for m in mixtures))
        sampled = time.perf_counter()
        w, b = rebalance_head(torch.from_numpy(state["head.weight"]), torch.from_numpy(state["head.bias"]),
                              draw, allowed, self.opts, gen)
        state["head.weight"] = w.numpy().astype(state["head.weight"].dtype)
        state["head.bias"] = b.numpy().astype(state["head.bias"].dtype)
        self.last_rebalance = {"classes": len(mixtures), "samples": n,
                               "prepare_seconds": sampled - started, "seconds": time.perf_counter() - started}
        log.info("hgp round %d: head rebalanced on %d synthetic features of %d classes in %.2fs",
                 server_round, n, len(mixtures), self.last_rebalance["seconds"])
        return to_array_record(state)

    # ------------------------------------------------------------------ mixtures
    def ingest(self, replies: list[RecordDict], server_round: int = 0,
               origins: list[tuple[int, int]] | None = None) -> None:
        """Tier 1: keep each (class, client)'s newest statistics.

        Parameters
        ----------
        replies : list of RecordDict
            Accepted replies (``check_reply`` has validated their statistics).
        server_round : int
            The round they arrived in.
        origins : list of (client id, task), optional
            The client and task the server assigned each reply (:meth:`reply_origins`);
            None: distinct unknown clients on the newest task.

        A client's statistics for a class replace its older ones. A round's reports of a
        class also replace the statistics of the clients that are still on the class's task
        (their model has moved on since), so a class's mixture holds the freshest report of
        every client that has left its task and this round's reports from the clients still
        on it. With synchronous arrival every client is on the task until it ends, so a
        reported class's mixture is this round's components, as HGP's Tier 1 (section 3)
        builds it from the round's clients. Classes no client reported this round keep their
        mixture (earlier tasks' classes, or classes missing from a partial round).
        """
        if origins is None:
            origins = [(-1 - i, self.task) for i in range(len(replies))]
        fresh: dict[int, list[tuple[dict[str, np.ndarray], int, int]]] = {}
        for (client, task), content in zip(origins, replies):
            if STATS not in content.array_records:
                continue
            allowed = set(task_classes(self.cfg, task, self.num_classes).tolist())
            arrays = from_array_record(content[STATS])  # stored as received, decoded when a mixture is built
            for row, c in enumerate(arrays["classes"].tolist()):
                if c in allowed and int(arrays["counts"][row]) > 0:
                    fresh.setdefault(c, []).append((arrays, row, client))
        for c, rows in fresh.items():
            encodings = {tuple((k, a[k].dtype.str, a[k].shape[1:]) for k in sorted(a) if k.startswith("cov-"))
                         for a, _, _ in rows}
            kept = self._kept_rows(c, {client for _, _, client in rows}, server_round)
            if kept is not None:
                encodings.add(tuple((k, v.dtype.str, v.shape[1:]) for k, v in sorted(kept.items())
                                    if k.startswith("cov-")))
            if len(encodings) != 1:
                log.warning("hgp: class %d received mixed covariance encodings; skipped this round", c)
                continue
            new = {k: np.stack([a[k][r] for a, r, _ in rows]) for k in rows[0][0] if k != "classes"}
            new["clients"] = np.array([client for _, _, client in rows], np.int64)
            new["rounds"] = np.full(len(rows), server_round, np.int64)
            self.class_stats[c] = new if kept is None else {k: np.concatenate([kept[k], new[k]]) for k in new}
            self._mixtures.pop(c, None)

    def _kept_rows(self, label: int, reporters: set[int], server_round: int) -> dict[str, np.ndarray] | None:
        """The stored rows of ``label`` that this round's reports leave in place (None: none).

        Dropped: the reporters' own older rows, and those of clients still on the class's task.
        """
        stored = self.class_stats.get(label)
        if stored is None or "clients" not in stored:
            return None
        task = label // (self.num_classes // self.cfg.num_tasks)  # the stream's tasks own contiguous classes
        keep = np.array([c not in reporters and c >= 0 and self.client_position(int(c), server_round - 1) > task
                         for c in stored["clients"].tolist()], dtype=bool)
        if not keep.any():
            return None
        return {k: v[keep] for k, v in stored.items()}

    def mixture(self, label: int) -> ClassMixture | None:
        """The prepared Tier-1 mixture of ``label`` (None if never reported)."""
        if label not in self._mixtures:
            raw = self.class_stats.get(label)
            self._mixtures[label] = None if raw is None else _mixture_from_raw(
                label, {k: v for k, v in raw.items() if k not in ("clients", "rounds")}, self.opts.cov_eps)
        return self._mixtures[label]

    def rebalance_mixtures(self, in_flight: range | None = None) -> list[ClassMixture]:
        """Mixtures of the classes the rebalancing samples.

        CR_old: the classes of the tasks every client has left; CR_cur: the classes of the
        tasks some client is on, ``in_flight`` (None: the current task alone, as with
        synchronous arrival). Together they cover every class any client has reported so far.
        """
        in_flight = range(self.task, self.task + 1) if in_flight is None else in_flight
        labels: list[int] = []
        if self.opts.rebalance_old:
            labels += seen_classes(self.cfg, in_flight.start - 1, self.num_classes).tolist() if in_flight.start else []
        if self.opts.rebalance_cur:
            labels += [c for t in in_flight for c in task_classes(self.cfg, t, self.num_classes).tolist()]
        return [m for m in (self.mixture(c) for c in labels) if m is not None]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Every class's statistics as received (all mixtures, earlier tasks included)."""
        out: dict[str, Any] = {"task": self.task}
        for c, raw in self.class_stats.items():
            out.update({f"class{c}.{k}": v for k, v in raw.items()})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.task = int(state.get("task", 0))
        self.class_stats, self._mixtures = {}, {}
        for key, value in state.items():
            if key.startswith("class") and "." in key:
                label, name = key[5:].split(".", 1)
                self.class_stats.setdefault(int(label), {})[name] = np.asarray(value)
        for raw in self.class_stats.values():  # a checkpoint from before per-client rows: clients unknown
            n = len(raw["counts"])
            raw.setdefault("clients", np.arange(-1, -1 - n, -1, dtype=np.int64))
            raw.setdefault("rounds", np.zeros(n, np.int64))


def _mixture_from_raw(label: int, raw: Mapping[str, np.ndarray], eps: float) -> ClassMixture | None:
    arrays = {"classes": np.arange(len(raw["counts"]), dtype=np.int64), **raw}
    stats = decode_class_stats(arrays, int(raw["means"].shape[1]))
    return build_mixture(label, stats.counts, stats.means, stats.kind, stats.cov, stats.factor, stats.diag, eps)
