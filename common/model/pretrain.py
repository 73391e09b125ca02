"""Pretrain a small ViT backbone offline, once, and cache it.

No pretrained ViT weights are reachable offline, and a randomly initialised
backbone is a poor stand-in (a linear probe on its features reaches ~65% on
digits). ``promptfcl pretrain`` trains the configured small ViT supervised on a
labelled *source* dataset and stores it in the user cache; ``weights =
"pretrained:<source>"`` then loads it. The default pairs a Fashion-MNIST
backbone with the digits stream, so the evaluation classes were never seen in
pretraining.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config.experiment import ExperimentConfig
from ..data.sources import load_dataset
from .prompted import CodaPrompt, PromptedViT, build_backbone
from .weights import BackboneSpec, checkpoint_path

log = logging.getLogger("promptfcl")

def pretrain(cfg: ExperimentConfig, source: str, epochs: int = 2, batch_size: int = 128,
             lr: float = 2e-3, max_images: int = 0) -> Path:
    """Supervised pretraining of ``cfg``'s ViT on ``source``; returns the cached checkpoint path.

    AdamW with one-cycle schedule and small random shifts; the classification head
    is discarded, only the backbone is kept.
    """

    # backbone-cache-disk off: the backbone is trained here, so it stays timm's own model
    src_cfg = cfg.replace(dataset=source, num_tasks=1, pool_size=1, weights="random",
                          max_train_per_class=0, max_test_per_class=0, backbone_cache_disk="off")
    data = load_dataset(src_cfg)
    torch.manual_seed(cfg.run.seed)
    rng = np.random.default_rng(cfg.run.seed)
    backbone, _ = build_backbone(BackboneSpec.of(src_cfg.run, src_cfg.data, src_cfg.federation, src_cfg.model,
                                                 src_cfg.caching))
    for p in backbone.parameters():
        p.requires_grad_(True)
    backbone.train()
    # PromptedViT only for its preprocessing (resize, channels, normalisation)
    wrapper = PromptedViT(backbone, CodaPrompt(int(backbone.embed_dim), [0], 1, 2, 1), data.num_classes)
    head = torch.nn.Linear(int(backbone.embed_dim), data.num_classes)
    params = list(backbone.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05)
    n = len(data.train) if max_images <= 0 else min(max_images, len(data.train))
    steps_per_epoch = max(1, n // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps_per_epoch, pct_start=0.1)
    started = time.perf_counter()
    for epoch in range(epochs):
        order = rng.permutation(len(data.train))[:n]
        losses = []
        for step in range(steps_per_epoch):
            idx = order[step * batch_size : (step + 1) * batch_size]
            x = wrapper.preprocess(torch.from_numpy(data.train.images[idx]))
            dy, dx = (int(v) for v in rng.integers(-2, 3, size=2))
            x = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
            loss = F.cross_entropy(head(backbone(x)), torch.from_numpy(data.train.labels[idx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
        log.info("pretrain %s epoch %d/%d: loss %.3f (%.0f s)", source, epoch + 1, epochs,
                 float(np.mean(losses)), time.perf_counter() - started)
    backbone.eval()
    with torch.no_grad():
        correct = 0
        for start in range(0, len(data.test), 512):
            x = wrapper.preprocess(torch.from_numpy(data.test.images[start : start + 512]))
            correct += int((head(backbone(x)).argmax(1).numpy() == data.test.labels[start : start + 512]).sum())
    accuracy = 100.0 * correct / len(data.test)
    spec = BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching)
    path = checkpoint_path(spec, source)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"source": source, "epochs": epochs, "source_test_accuracy": accuracy,
            "seconds": time.perf_counter() - started, "architecture": spec.architecture()}
    tmp = path.with_suffix(".tmp")
    torch.save({"model": backbone.state_dict(), "meta": meta}, tmp)
    os.replace(tmp, path)
    log.info("pretrained backbone on %s: %.1f%% test accuracy on the source, saved to %s", source, accuracy, path)
    return path
