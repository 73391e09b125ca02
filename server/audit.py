"""Privacy audit: how much of the clients' images the server can reconstruct from what it received.

``promptfcl audit --run DIR`` loads a run's configuration and checkpoint (kept with
``keep-checkpoint = true``), rebuilds the model with the global prompts and head, and inverts,
for each audited class, what the server holds about it:

* HGP: the class's uploaded Gaussian of each client (its strategy state keeps them per
  (class, client)): the client's mean feature (``mean``) and one draw from the client's
  Gaussian (``gaussian-sample``, the covariance unscaled: what the client sent, not the
  widened sampler of rebalancing);
* FPPL: the client's prototype of the class (its per-class mean feature; ``prototype``);
* FedAvg-Prompt, Fed-CPrompt, HePCo, Powder: no feature uploads; the target of a class is its
  row of the global head (``head-row``): model inversion that maximises the class's logit
  through the prompted model. Powder's server state holds task and class correlation weights
  averaged over the measuring clients; ``audit.json`` lists what they show (which tasks and
  classes have been measured), and its feature-level audit is the head inversion.

Inversion follows the feature inversion of "Reducing Bias in Federated Class-Incremental Learning
with Hierarchical Generative Prototypes" (HGP), Appendix D: an image, optimised from noise with
Adam, whose prompted features (frozen backbone, global prompts) match the target, plus a
total-variation prior. The image lives in the dataset's own resolution and channels (a sigmoid
keeps it in [0, 1]) and reaches the backbone through the model's own ``preprocess`` (resizing,
channel expansion, normalisation), as a real image does. The prompt query q(x) is recomputed
from the current image at every step without gradient: gradients flow through the prompted
pass, the pool's selection follows the image.

Scores: for each target, the best SSIM and PSNR of its reconstruction against the real training
images of that class held by the client(s) that sent it (``common.data.client_indices``), and the
same for a reconstruction from a random vector of the target's norm (the chance level). A
reconstruction that scores clearly above its chance level shows the upload carries
recognisable image content; one at chance shows the inversion recovered none.

The model inverted is the checkpoint's: the global prompts and head after the last round. A
client computed its upload with the model of its own round (for a class of an earlier task,
earlier prompts, and only the prompt slices of its task), so for older uploads the audit is an
approximation of the attack that would use the model of the upload's round.

The core (:func:`invert`, :func:`best_similarity`, :func:`audit_targets`) takes a features
callable and target vectors; :func:`audit_run` is the thin layer that loads a run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..common.config.experiment import ConfigError, ExperimentConfig
from ..common.data.partitions import client_indices
from ..common.files import write_atomic
from ..common.model.runtime import Runtime, get_runtime
from ..common.model.weights import BackboneSpec, check_weights
from ..strategies.registry import build_strategy, strategy_class
from . import checkpoint

log = logging.getLogger("promptfcl")

#: maps float images in [0, 1] (B, C, H, W) to features (B, D), differentiably
Features = Callable[[torch.Tensor], torch.Tensor]

LOSSES = ("cosine", "l2", "logit")


@dataclass(frozen=True)
class AuditSettings:
    """How targets are inverted and scored.

    Attributes
    ----------
    steps : int
        Adam steps per inversion.
    lr : float
        Adam learning rate (on the image's logits).
    tv_weight : float
        Weight of the total-variation prior (mean absolute difference of neighbouring pixels).
    distance : str
        Feature distance of feature targets: ``cosine`` or ``l2`` (head rows always use ``logit``).
    seed : int
        Seeds the starting noise, the chance vectors and the Gaussian draws.
    max_real : int
        At most this many real images per target are scored against.
    """

    steps: int = 300
    lr: float = 0.1
    tv_weight: float = 0.01
    distance: str = "cosine"
    seed: int = 0
    max_real: int = 256

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.lr <= 0 or self.tv_weight < 0:
            raise ConfigError(f"--lr must be > 0 and --tv-weight >= 0, got {self.lr} and {self.tv_weight}")
        if self.distance not in ("cosine", "l2"):
            raise ConfigError(f"--distance must be cosine or l2, got {self.distance!r}")
        if self.max_real < 1:
            raise ConfigError(f"--max-real must be >= 1, got {self.max_real}")


@dataclass
class Target:
    """One vector the server received, and the real images it is scored against.

    Attributes
    ----------
    label : int
        The class (remapped label).
    kind : str
        ``mean``, ``gaussian-sample``, ``prototype`` or ``head-row``.
    vector : ndarray (D,)
        The target feature (or head row).
    loss : str
        One of :data:`LOSSES`: feature distance, or ``logit`` (maximise the inner product).
    real : ndarray uint8 (N, C, H, W)
        The real training images of the class held by the client(s) that sent it.
    client : int
        The client that sent it; -1 when it is the server's aggregate (a head row).
    """

    label: int
    kind: str
    vector: np.ndarray
    loss: str
    real: np.ndarray
    client: int = -1
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- core
def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Per-image anisotropic total variation (B,): mean absolute difference of neighbouring pixels."""
    dh = (images[..., 1:, :] - images[..., :-1, :]).abs().flatten(1).mean(1)
    dw = (images[..., :, 1:] - images[..., :, :-1]).abs().flatten(1).mean(1)
    return dh + dw


def _objective(feats: torch.Tensor, targets: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-image loss (B,) of ``feats`` against ``targets`` (both (B, D))."""
    if loss == "cosine":
        return 1.0 - torch.nn.functional.cosine_similarity(feats, targets, dim=1)
    if loss == "l2":  # relative, so the TV weight means the same whatever the features' scale
        return (feats - targets).pow(2).sum(1) / targets.pow(2).sum(1).clamp_min(1e-12)
    if loss == "logit":  # the class logit's feature part (the bias does not depend on the image)
        return -(feats * targets).sum(1) / targets.norm(dim=1).clamp_min(1e-12)
    raise ValueError(f"unknown loss {loss!r}; one of {LOSSES}")


def invert(features: Features, targets: torch.Tensor, shape: tuple[int, int, int], loss: str,
           settings: AuditSettings, generator: torch.Generator) -> torch.Tensor:
    """Images in [0, 1] whose features match ``targets``, optimised from noise.

    Parameters
    ----------
    features : callable
        Float images in [0, 1] (B, C, H, W) -> features (B, D), differentiable in the images.
    targets : Tensor (B, D)
        One target per image; images are optimised jointly but independently (per-image losses).
    shape : (C, H, W)
        The dataset's image shape.
    loss : str
        One of :data:`LOSSES`.
    settings : AuditSettings
        Steps, learning rate, total-variation weight.
    generator : torch.Generator
        Source of the starting noise.

    Returns
    -------
    Tensor (B, C, H, W), float in [0, 1], detached.
    """
    targets = targets.detach().float()
    logits = torch.randn(len(targets), *shape, generator=generator).mul_(0.5).requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=settings.lr)
    every = max(settings.steps // 4, 1)
    for step in range(settings.steps):
        images = torch.sigmoid(logits)
        per_image = _objective(features(images), targets, loss)
        total = (per_image + settings.tv_weight * total_variation(images)).sum()
        # gradient for the image only: the model's parameters (shared with the process's runtime)
        # are neither touched nor given gradients
        (grad,) = torch.autograd.grad(total, [logits])
        logits.grad = grad
        opt.step()
        if step % every == 0 or step == settings.steps - 1:
            log.info("audit: %s inversion of %d targets, step %d/%d, %s %.4f", loss, len(targets), step + 1,
                     settings.steps, loss, float(per_image.detach().mean()))
    return torch.sigmoid(logits).detach()


def _ssim_kernel(height: int, width: int) -> tuple[int, float]:
    """Gaussian window for SSIM on small images: the standard 11 px, sigma 1.5 ("Image quality
    assessment: from error visibility to structural similarity", section III.C) where it fits,
    else the largest odd size that leaves a valid centre (the metric crops half a window at each
    border), sigma scaled with it."""
    size = min(11, max(3, (min(height, width) // 2) | 1))
    while size > 3 and min(height, width) - 2 * (size // 2) < 2:
        size -= 2
    return size, 1.5 * size / 11


def best_similarity(recon: torch.Tensor, real: torch.Tensor) -> tuple[float, float, int]:
    """Best SSIM and best PSNR (dB) of one reconstruction (C, H, W) over ``real`` (N, C, H, W), both
    in [0, 1]; and the index of the real image of the best SSIM."""
    # torchmetrics: only `promptfcl audit` scores reconstructions
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    preds = recon.unsqueeze(0).expand_as(real).contiguous()
    size, sigma = _ssim_kernel(real.shape[-2], real.shape[-1])
    ssim = structural_similarity_index_measure(preds, real, kernel_size=size, sigma=sigma, data_range=1.0,
                                               reduction="none")
    psnr = peak_signal_noise_ratio(preds, real, data_range=1.0, reduction="none", dim=(1, 2, 3))
    assert isinstance(ssim, torch.Tensor)  # reduction "none" without the full image: one tensor
    best = int(torch.argmax(ssim))
    return float(ssim[best]), float(psnr.max()), best


def chance_vectors(targets: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random directions with each target's norm: what an upload that carries nothing looks like."""
    noise = torch.randn(targets.shape, generator=generator)
    return noise / noise.norm(dim=1, keepdim=True) * targets.norm(dim=1, keepdim=True)


def audit_targets(features: Features, targets: list[Target], shape: tuple[int, int, int],
                  settings: AuditSettings) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Invert every target and a chance vector of the same norm; score both against the real images.

    Parameters
    ----------
    features : callable
        Float images in [0, 1] (B, C, H, W) -> features (B, D).
    targets : list of Target
        What to invert (each with its real images).
    shape : (C, H, W)
        The dataset's image shape.
    settings : AuditSettings
        Inversion and scoring settings.

    Returns
    -------
    (one record per target: label, kind, client, ssim, psnr, chance_ssim, chance_psnr, n_real;
    images for the figure: ``real`` (the best-SSIM real image), ``recon``, ``chance``, each (K, C, H, W)).
    """
    settings.validate()
    generator = torch.Generator().manual_seed(settings.seed)
    k = len(targets)
    recon = torch.zeros(k, *shape)
    chance = torch.zeros(k, *shape)
    for loss in sorted({t.loss for t in targets}):  # one joint optimisation per loss
        rows = [i for i, t in enumerate(targets) if t.loss == loss]
        vectors = torch.from_numpy(np.stack([targets[i].vector for i in rows])).float()
        both = torch.cat([vectors, chance_vectors(vectors, generator)])
        out = invert(features, both, shape, loss, settings, generator)
        recon[rows], chance[rows] = out[: len(rows)], out[len(rows):]
    records, best_real = [], torch.zeros(k, *shape)
    for i, t in enumerate(targets):
        real = torch.from_numpy(t.real).float().div(255.0)
        ssim, psnr, best = best_similarity(recon[i], real)
        c_ssim, c_psnr, _ = best_similarity(chance[i], real)
        best_real[i] = real[best]
        records.append({"class": t.label, "target": t.kind, "client": t.client, "ssim": ssim, "psnr": psnr,
                        "chance_ssim": c_ssim, "chance_psnr": c_psnr, "n_real": len(real), **t.extra})
    return records, {"real": best_real.numpy(), "recon": recon.numpy(), "chance": chance.numpy()}


def summarise(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean scores per target kind."""
    out = {}
    for kind in sorted({r["target"] for r in records}):
        rows = [r for r in records if r["target"] == kind]
        out[kind] = {m: float(np.mean([r[m] for r in rows])) for m in ("ssim", "psnr", "chance_ssim", "chance_psnr")}
        out[kind]["n"] = len(rows)
    return out


def plot_grid(images: dict[str, np.ndarray], records: list[dict[str, Any]], path: Path) -> None:
    """audit.png: one column per target; rows real (best match), reconstruction, chance."""
    # matplotlib is slow to import: only the audit's figure needs it
    import matplotlib

    matplotlib.use("Agg")
    # matplotlib is slow to import: only the audit's figure needs it
    import matplotlib.pyplot as plt

    k = len(records)
    fig, axes = plt.subplots(3, k, figsize=(max(1.1 * k, 3), 3.6), squeeze=False)
    for row, (name, title) in enumerate((("real", "real"), ("recon", "reconstruction"), ("chance", "chance"))):
        for col, rec in enumerate(records):
            img = images[name][col]
            ax = axes[row][col]
            if img.shape[0] == 1:
                ax.imshow(img[0], cmap="gray", vmin=0, vmax=1)
            else:
                ax.imshow(np.clip(img[:3].transpose(1, 2, 0), 0, 1))
            ax.set_xticks([]), ax.set_yticks([])
            if row == 0:
                ax.set_title(f"{rec['class']} {rec['target'][:6]}", fontsize=6)
            if row == 1:
                ax.set_xlabel(f"{rec['ssim']:.2f}", fontsize=6)
            if row == 2:
                ax.set_xlabel(f"{rec['chance_ssim']:.2f}", fontsize=6)
            if col == 0:
                ax.set_ylabel(title, fontsize=7)
    fig.suptitle("privacy audit: real / reconstruction (SSIM) / chance (SSIM)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- run directories
def prompted_features(model: Any) -> Features:
    """The model's real forward as a features callable: float images in [0, 1] at the dataset's size,
    through ``preprocess`` (which takes 0..255 values), q(x) from the unprompted backbone (no
    gradient, as in the model), then the prompted pre-logit features."""
    def features(images: torch.Tensor) -> torch.Tensor:
        x = model.preprocess(images * 255.0)
        return model.features(x, model.query(x))

    return features


def _real_images(rt: Runtime, label: int, client: int, max_real: int, virtual: bool) -> np.ndarray:
    """The class's training images held by ``client`` for the class's task, at most ``max_real``.

    Every training image of the class where one client's share is not known here: ``client`` -1
    (a head row), deployed nodes (their own data; ``virtual``: the run's clients are simulated),
    stateless shares (they change every round) and random tasks."""

    data, layout = rt.data, rt.layout
    labels = data.train.labels
    index = np.flatnonzero(labels == label)
    if client >= 0 and virtual and rt.partition.scheme != "stateless" and not layout.random:
        task = layout.task_of(label)
        own = client_indices(labels, layout, rt.partition, client, task, 0)
        index = own[labels[own] == label]
        if not len(index):  # a client the partition gives none of the class (a stale id): the class's images
            index = np.flatnonzero(labels == label)
    return data.train.images[np.sort(index)[:max_real]]


def audit_run(run: str | Path, settings: AuditSettings, classes: list[int] | None = None,
              max_classes: int = 0, out: str | Path | None = None) -> dict[str, Any]:
    """Audit the run in ``run``; write ``audit.json`` and ``audit.png`` to ``out`` (default: ``run``).

    Parameters
    ----------
    run : path
        A run directory holding a checkpoint (a finished run keeps it with ``keep-checkpoint = true``).
    settings : AuditSettings
        Inversion and scoring settings.
    classes : list of int, optional
        Only these classes (default: every class the server holds targets of).
    max_classes : int
        At most this many classes (0: no limit), the first in ascending order.
    out : path, optional
        Where the outputs go.

    Returns
    -------
    The audit.json document.
    """

    settings.validate()
    run = Path(run)
    ckpt = checkpoint.load(run)
    if ckpt is None:
        raise ConfigError(f"{run} holds no checkpoint ({checkpoint.FILENAME}): a finished run deletes it unless "
                          "run with --set keep-checkpoint=true (or stopped early with max-rounds)")
    try:
        cfg = ExperimentConfig.from_dict({**ckpt.config, "out-dir": str(run)})
    except ConfigError as exc:
        raise ConfigError(f"the checkpoint's configuration is not valid here: {exc}") from exc
    if cfg.per_task_head:
        raise ConfigError("runs with a head block per task (random tasks) are not audited: their head rows are "
                          "not classes")
    check_weights(BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching))
    method = strategy_class(cfg.run.strategy)
    started = time.perf_counter()
    rt = get_runtime(cfg, method.prompt_class)
    strategy = build_strategy(cfg, rt.data.num_classes)
    try:
        strategy.load_state_dict(ckpt.strategy_state)
        rt.model.load_trainable_state({k: torch.from_numpy(np.array(v, copy=True)) for k, v in ckpt.arrays.items()})
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"the checkpoint lacks what the audit needs ({type(exc).__name__}: {exc})") from exc
    model = rt.model
    model.eval()
    model.prompt.set_task(ckpt.task)
    seen = rt.layout.seen(ckpt.task).tolist() if not rt.layout.random else list(range(rt.data.num_classes))
    uploads = strategy.uploaded_features(seen, settings.seed + 1)  # None: no feature uploads, head rows
    available = seen if uploads is None else sorted({u["class"] for u in uploads})
    if classes is not None:
        missing = sorted(set(classes) - set(available))
        if missing:
            raise ConfigError(f"classes {missing} have no target in this checkpoint ({cfg.run.strategy}, "
                              f"after task {ckpt.task}); available: {available}")
        available = sorted(set(classes))
    if max_classes:
        available = available[:max_classes]
    if not available:
        raise ConfigError(f"the checkpoint holds no {cfg.run.strategy} targets to invert")
    if uploads is not None:  # again for the audited classes alone: the Gaussian draws follow the seed from there
        uploads = strategy.uploaded_features(available, settings.seed + 1)
    virtual = cfg.federation.population == "virtual"  # a client's own share is known here
    if uploads is None:
        weight = model.head.weight.detach().cpu().numpy()
        targets = [Target(c, "head-row", weight[c], "logit", _real_images(rt, c, -1, settings.max_real, virtual))
                   for c in available]
    else:
        targets = [Target(u["class"], u["kind"], np.asarray(u["vector"]), settings.distance,
                          _real_images(rt, u["class"], u["client"], settings.max_real, virtual), u["client"],
                          u["meta"]) for u in uploads]
    channels, height, width = rt.data.train.images.shape[1:]
    shape = (int(channels), int(height), int(width))
    log.info("audit: %s run %s after task %d round %d: %d targets of %d classes, image %s, %d steps",
             cfg.run.strategy, run, ckpt.task, ckpt.round, len(targets), len(available), "x".join(map(str, shape)),
             settings.steps)
    records, images = audit_targets(_on_device(prompted_features(model), rt.device), targets, shape, settings)
    doc: dict[str, Any] = {
        "run": str(run), "method": cfg.run.strategy, "task": ckpt.task, "round": ckpt.round,
        "settings": asdict(settings), "classes": records, "means": summarise(records),
        "seconds": time.perf_counter() - started,
    }
    doc.update(strategy.audit_notes())
    out = Path(out) if out is not None else run
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "audit.json", lambda fh: fh.write(json.dumps(doc, indent=1).encode()))
    plot_grid(images, records, out / "audit.png")
    for kind, m in doc["means"].items():
        log.info("audit: %-15s SSIM %.3f (chance %.3f), PSNR %.2f dB (chance %.2f), %d targets", kind, m["ssim"],
                 m["chance_ssim"], m["psnr"], m["chance_psnr"], m["n"])
    log.info("audit: wrote %s and %s (%.1f s)", out / "audit.json", out / "audit.png", doc["seconds"])
    return doc


def _on_device(features: Features, device: torch.device) -> Features:
    """``features`` with its images moved to ``device`` and its features back to the CPU."""
    return lambda images: features(images.to(device)).float().cpu()
