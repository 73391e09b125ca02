"""Training-time augmentation of uint8 image batches (``augment``), seeded per client, task and round."""

from __future__ import annotations

import numpy as np


def augment_images(images: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """A random view of each image of a uint8 batch (N, C, H, W), drawn from ``rng``.

    ``"crop-flip"``: the usual CIFAR training augmentation, as HGP trains its clients
    ("Reducing Bias in Federated Class-Incremental Learning with Hierarchical Generative
    Prototypes", Appendix B.1: random cropping and horizontal flipping): zero-pad every side
    by 1/8 of the image side (at least one pixel: 4 on 32 px, as torchvision's
    ``RandomCrop(32, padding=4)``), crop a random window of the original size, and flip
    left-right with probability 1/2. Works at the stored resolution, before the per-batch
    resize, so a 32 px image resized to 224 px sees the same relative shift. ``"none"``
    returns ``images`` unchanged. The same ``rng`` state gives the same views.
    """
    if kind == "none" or len(images) == 0:
        return images
    if kind != "crop-flip":
        raise ValueError(f"unknown augmentation {kind!r}")
    n, _, h, w = images.shape
    pad_h, pad_w = max(1, h // 8), max(1, w // 8)
    padded = np.pad(images, ((0, 0), (0, 0), (pad_h, pad_h), (pad_w, pad_w)))
    top = rng.integers(0, 2 * pad_h + 1, size=n)
    left = rng.integers(0, 2 * pad_w + 1, size=n)
    flip = np.asarray(rng.random(n)) < 0.5
    rows = top[:, None] + np.arange(h)[None, :]  # (N, H)
    cols = left[:, None] + np.arange(w)[None, :]  # (N, W)
    cols = np.where(flip[:, None], cols[:, ::-1], cols)
    batch = np.arange(n)[:, None, None, None]
    channel = np.arange(images.shape[1])[None, :, None, None]
    return np.ascontiguousarray(padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]])  # type: ignore[call-overload]


