"""The input pipeline: torchvision's RandomResizedCrop draw, one-step crop-and-resize, the
normalisations and interpolations the papers use, evaluation's central crop, and query caches
kept apart per pipeline."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from promptfcl.common.config.experiment import ConfigError, ExperimentConfig
from promptfcl.common.model.preprocess import InputPipeline, centre_crops, random_resized_crops


def images(n=4, side=32, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, 3, side, side)).astype(np.uint8))


def test_random_resized_crops_follow_torchvisions_distribution():
    crops = random_resized_crops(4000, 32, 48, np.random.default_rng(0), scale=(0.08, 1.0))
    top, left, h, w, flip = crops.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 32).all() and (left + w <= 48).all()
    area = h * w / (32 * 48)
    assert area.min() >= 0.07 and area.max() <= 1.0  # within scale, up to pixel rounding
    assert 0.4 < area.mean() < 0.56  # uniform area in [0.08, 1], a little lower where a try does not fit
    ratio = w / h
    assert ratio.min() > 0.6 and ratio.max() < 1.5  # log-uniform in [3/4, 4/3], rounded
    assert 0.45 < flip.mean() < 0.55
    again = random_resized_crops(4000, 32, 48, np.random.default_rng(0), scale=(0.08, 1.0))
    np.testing.assert_array_equal(crops, again)  # seeded
    fppl = random_resized_crops(4000, 32, 48, np.random.default_rng(0), scale=(0.05, 1.0))
    assert (fppl[:, 2] * fppl[:, 3]).min() < (crops[:, 2] * crops[:, 3]).min()  # FPPL's code: from 5%


def test_crop_and_resize_is_one_exact_resampling():
    x = images()
    unit = InputPipeline(16, 3, (0.5,) * 3, (0.5,) * 3, input_norm="unit")
    quadrant = torch.tensor([[0, 0, 16, 16, 0], [16, 16, 16, 16, 1]] * 2, dtype=torch.float32)
    out = unit(x, quadrant)
    expected = x[:, :, :16, :16].float() / 255  # the top-left quadrant at its own size: the pixels themselves
    torch.testing.assert_close(out[0], expected[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[1], (x[1, :, 16:, 16:].float() / 255).flip(-1), atol=1e-6, rtol=0)  # mirrored
    # the whole image as a crop is the plain resize
    big = InputPipeline(64, 3, (0.5,) * 3, (0.5,) * 3)
    whole = torch.tensor([[0, 0, 32, 32, 0]] * 4, dtype=torch.float32)
    torch.testing.assert_close(big(x, whole), big(x), atol=1e-5, rtol=0)


def test_normalisation_interpolation_and_evaluation_crop():
    x = images()
    backbone = InputPipeline(64, 3, (0.5,) * 3, (0.5,) * 3)
    unit = InputPipeline(64, 3, (0.5,) * 3, (0.5,) * 3, input_norm="unit")
    torch.testing.assert_close(backbone(x), unit(x) * 2 - 1)  # (x - 0.5) / 0.5
    assert unit(x).min() >= 0 and unit(x).max() <= 1
    bicubic = InputPipeline(64, 3, (0.5,) * 3, (0.5,) * 3, interpolation="bicubic")
    expected = (F.interpolate(x.float() / 255, size=(64, 64), mode="bicubic", align_corners=False) - 0.5) / 0.5
    torch.testing.assert_close(bicubic(x), expected)
    assert (bicubic(x) - backbone(x)).abs().max() > 0.05
    # eval-crop 0.875 on 32 px: the central 28 px, resized (Resize(256) + CenterCrop(224))
    cropped = InputPipeline(56, 3, (0.0,) * 3, (1.0,) * 3, input_norm="unit", eval_crop=0.875)
    resized = F.interpolate(x.float() / 255, size=(64, 64), mode="bilinear", align_corners=False)  # Resize(64)
    centre = resized[:, :, 4:60, 4:60]  # CenterCrop(56)
    torch.testing.assert_close(cropped(x, evaluation=True), centre, atol=1e-5, rtol=0)
    assert not torch.allclose(cropped(x), cropped(x, evaluation=True))  # training inputs keep the whole image
    assert cropped.identity(evaluation=True) != cropped.identity(evaluation=False) == "unit-bilinear"
    np.testing.assert_allclose(centre_crops(1, 32, 32, 0.875)[0], [2, 2, 28, 28, 0])


@pytest.mark.parametrize("key, value", [("input_norm", "imagenet"), ("resize_interpolation", "nearest"),
                                        ("eval_crop", 0.0), ("augment", "autoaugment"), ("augment_crop_scale", 1.5)])
def test_bad_pipeline_settings_are_refused(key, value):
    with pytest.raises(ConfigError, match=key.replace("_", "-")):
        ExperimentConfig().replace(**{key: value})


def test_resized_crop_views_are_seeded_per_fit():
    """Local training's views: the same (client, task, round) sees the same crops in any process."""
    from promptfcl.strategies.platform.learner import LocalLearner

    class Stub:
        cfg = ExperimentConfig().replace(augment="resized-crop-flip", augment_crop_scale=0.05)

    learner = LocalLearner.__new__(LocalLearner)
    learner.training, learner.seed = Stub.cfg.training, [0, 3, 1, 2]
    a, b = learner.augmentation(), learner.augmentation()
    np.testing.assert_array_equal(random_resized_crops(8, 32, 32, a, (0.05, 1)), random_resized_crops(8, 32, 32, b, (0.05, 1)))
    assert math.isclose(Stub.cfg.training.augment_crop_scale, 0.05)
