"""From stored uint8 images to backbone inputs: channels, crop and resize, normalisation.

The papers feed their ViTs differently, and the choice changes results (``input-norm``,
``resize-interpolation``, ``augment``, ``eval-crop``; each paper config says whose choice it
follows):

* CODA-P's code (which HePCo, Fed-CPrompt and Powder build on) and FPPL's code feed [0, 1]
  inputs (``ToTensor`` without ``Normalize``: ``input-norm = "unit"``) and train on
  ``RandomResizedCrop(224)`` + horizontal flip (``augment = "resized-crop-flip"``; FPPL's code
  from 5% of the area, ``augment-crop-scale = 0.05``, torchvision: 8%). CODA-P's code tests
  ImageNet-type data (ImageNet-R, DomainNet) on ``Resize(256)`` + ``CenterCrop(224)``
  (``eval-crop = 0.875``, on images stored with that margin, aspect kept: common/data/images.py) but
  CIFAR-100 on the whole image resized to 224 (``eval-crop = 1.0``): its
  ``dataloaders/utils.py`` ``get_transform`` crops only datasets named ``ImageNet*`` or
  ``DomainNet``, and HePCo's and Fed-CPrompt's code resize CIFAR-100 whole alike. FPPL's code
  tests every dataset on ``Resize(256)`` (bicubic) + ``CenterCrop(224)``;
* HGP's text resizes bicubically (``resize-interpolation = "bicubic"``) and trains on random
  crops and flips (``augment = "crop-flip"``);
* ``input-norm = "backbone"`` normalises with the mean and std the backbone was pretrained with
  (timm's ``pretrained_cfg``), the default.

Crops are drawn on the host (seeded, :func:`random_resized_crops`) and applied on the device in
one resampling step to the backbone's size (:meth:`InputPipeline.forward`), so a 32 px image
cropped and resized to 224 px is sampled once, as torchvision does on the image itself.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config.checks import INPUT_NORMS, INTERPOLATIONS


def random_resized_crops(n: int, height: int, width: int, rng: np.random.Generator,
                         scale: tuple[float, float] = (0.08, 1.0),
                         ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> np.ndarray:
    """``n`` crops as torchvision's ``RandomResizedCrop.get_params`` draws them, plus a flip.

    Per image: up to 10 tries of an area fraction in ``scale`` and a log-uniform aspect ratio
    in ``ratio``, the first that fits taken at a uniform position; none fits: the central crop
    at the nearest allowed ratio. Returns (n, 5) float32 rows [top, left, height, width, flip]
    in pixels of the stored image (flip 1: mirrored left-right, with probability 1/2).
    """
    area = height * width
    out = np.zeros((n, 5), np.float32)
    tries = 10
    target = area * rng.uniform(scale[0], scale[1], (n, tries))
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), (n, tries)))
    w = np.rint(np.sqrt(target * aspect))
    h = np.rint(np.sqrt(target / aspect))
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    u = rng.random((n, 2))
    for i in range(n):
        hit = np.flatnonzero(fits[i])
        if len(hit):
            ch, cw = h[i, hit[0]], w[i, hit[0]]
        else:  # torchvision's fallback: the central crop, aspect clamped into ratio
            in_ratio = width / height
            cw, ch = ((width, round(width / ratio[0])) if in_ratio < ratio[0] else
                      (round(height * ratio[1]), height) if in_ratio > ratio[1] else (width, height))
            ch, cw = min(ch, height), min(cw, width)
        top = math.floor(u[i, 0] * (height - ch + 1)) if len(hit) else (height - ch) // 2
        left = math.floor(u[i, 1] * (width - cw + 1)) if len(hit) else (width - cw) // 2
        out[i, :4] = (top, left, ch, cw)
    out[:, 4] = rng.random(n) < 0.5
    return out


def centre_crops(n: int, height: int, width: int, fraction: float) -> np.ndarray:
    """``n`` copies of the central crop keeping ``fraction`` of each side (no flip): the
    ``Resize(256)`` + ``CenterCrop(224)`` of a test transform is ``fraction = 224 / 256`` of an
    image stored as the central square of its 256 px shorter side (common/data/images.py)."""
    ch, cw = height * fraction, width * fraction
    return np.tile(np.array([(height - ch) / 2, (width - cw) / 2, ch, cw, 0.0], np.float32), (n, 1))


def resample(x: torch.Tensor, crops: torch.Tensor, size: int, mode: str) -> torch.Tensor:
    """Each image's crop (rows [top, left, height, width, flip] in pixels), resized to ``size``
    with ``mode`` interpolation in one step (an affine sampling grid)."""
    b, _, h, w = x.shape
    top, left, ch, cw, flip = crops.to(x).unbind(1)
    # output edges -1 / +1 (align_corners=False) onto the crop's pixel edges
    sx, sy = cw / w, ch / h
    cx, cy = (2 * left + cw) / w - 1, (2 * top + ch) / h - 1
    sx = torch.where(flip > 0.5, -sx, sx)
    zero = torch.zeros_like(sx)
    theta = torch.stack([torch.stack([sx, zero, cx], 1), torch.stack([zero, sy, cy], 1)], 1)
    grid = F.affine_grid(theta, [b, x.shape[1], size, size], align_corners=False)
    return F.grid_sample(x, grid, mode=mode, padding_mode="border", align_corners=False)


class InputPipeline(nn.Module):
    mean: torch.Tensor  # buffers (register_buffer), typed for the checker
    std: torch.Tensor
    """uint8 (B, C, H, W) -> float inputs at the backbone's size, channels and normalisation.

    Parameters
    ----------
    image_size, in_chans : int
        The backbone's input side and channels (a grey image is repeated over channels).
    mean, std : sequence of float
        The backbone's pretraining normalisation, used with ``input_norm = "backbone"``.
    input_norm : str
        ``"backbone"`` (``(x - mean) / std`` on [0, 1] pixels) or ``"unit"`` ([0, 1] as they are).
    interpolation : str
        ``"bilinear"`` or ``"bicubic"``: every resize (and crop) to ``image_size``.
    eval_crop : float
        Evaluation inputs keep this central fraction of each side before the resize (1: all).
    """

    def __init__(self, image_size: int, in_chans: int, mean: tuple[float, ...], std: tuple[float, ...],
                 input_norm: str = "backbone", interpolation: str = "bilinear", eval_crop: float = 1.0) -> None:
        super().__init__()
        if input_norm not in INPUT_NORMS or interpolation not in INTERPOLATIONS or not 0 < eval_crop <= 1:
            raise ValueError(f"input pipeline {input_norm!r}, {interpolation!r}, eval-crop {eval_crop}")
        self.image_size, self.in_chans = image_size, in_chans
        self.input_norm, self.interpolation, self.eval_crop = input_norm, interpolation, eval_crop
        if input_norm == "unit":
            mean, std = (0.0,) * len(mean), (1.0,) * len(std)
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def identity(self, evaluation: bool) -> str:
        """What decides the inputs of a split beyond the images (names query caches)."""
        crop = f"-crop{self.eval_crop:g}" if evaluation and self.eval_crop < 1 else ""
        return f"{self.input_norm}-{self.interpolation}{crop}"

    def forward(self, images: torch.Tensor, crops: torch.Tensor | None = None,
                evaluation: bool = False) -> torch.Tensor:
        """``crops``: (B, 5) rows of :func:`random_resized_crops` (training views); ``evaluation``:
        the central ``eval_crop`` (when no crops are given)."""
        x = images.float().div_(255.0)
        if x.shape[1] != self.in_chans:
            x = x.expand(-1, self.in_chans, -1, -1) if x.shape[1] == 1 else x[:, : self.in_chans]
        if crops is None and evaluation and self.eval_crop < 1:
            crops = torch.from_numpy(centre_crops(len(x), x.shape[-2], x.shape[-1], self.eval_crop))
        if crops is not None:
            x = resample(x, crops, self.image_size, self.interpolation)
        elif x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode=self.interpolation, align_corners=False)
        return (x - self.mean) / self.std
