"""Chunked decoding (common/data/images.py): the same arrays as decoding everything at once."""

from __future__ import annotations

import numpy as np
import pytest

from promptfcl.common.data import images


def _grey(h, w, v):
    return np.full((h, w), v, np.uint8)


def _colour(h, w, v):
    return np.full((h, w, 3), v, np.uint8)


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(images, "CHUNK", 4)


def test_native_size_kept_and_grey_rows_repeated_once_colour_appears_in_a_later_chunk(small_chunks):
    pictures = [_grey(6, 6, i) for i in range(9)] + [_colour(6, 6, 99)]
    fetched = []

    def fetch(a, b):
        fetched.append((a, b))
        return pictures[a:b]

    out = images.decode_rows(len(pictures), fetch, image_size=16)
    assert out.shape == (10, 3, 6, 6)  # native size, 3 channels because of the last image
    assert (out[3] == 3).all() and (out[9] == 99).all()
    assert max(b - a for a, b in fetched) == 4  # never more than a chunk at once


def test_a_later_image_of_another_size_resizes_every_image(small_chunks):
    pictures = [_colour(6, 6, i) for i in range(6)] + [_colour(8, 5, 7)]
    out = images.decode_rows(len(pictures), lambda a, b: pictures[a:b], image_size=10)
    side = images.stored_side(10)  # 8/7 of image-size: the margin of Resize(256) + CenterCrop(224)
    assert side == 11 and images.stored_side(224) == 256
    assert out.shape == (7, 3, side, side)
    expected = np.stack([images.to_uint8_chw(p, side) for p in pictures])
    assert np.array_equal(out, expected)


def test_images_of_one_non_square_size_are_stored_square_with_their_aspect_kept():
    pictures = [_colour(6, 9, i) for i in range(3)]
    out = images.decode_rows(len(pictures), lambda a, b: pictures[a:b], image_size=7)
    assert out.shape == (3, 3, 8, 8)  # not native: the pipeline would squash a non-square image


def _photo(h, w, seed):
    """A smooth, non-square colour image with some texture (a resize of noise would hide offsets)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (h + w)], -1)
    return np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def test_mixed_sizes_evaluate_exactly_as_torchvision_resize_256_centre_crop_224():
    """ImageNet-R's evaluation path (decode, then eval-crop 0.875 in the input pipeline) is
    torchvision's Resize(256) + CenterCrop(224) + ToTensor of the original image, which keeps its
    aspect ratio (CODA-P's and FPPL's test transform), for portrait, landscape and odd sizes."""
    import torch
    from PIL import Image
    from torchvision import transforms

    from promptfcl.common.model.preprocess import InputPipeline

    sizes = [(300, 200), (200, 333), (375, 500), (481, 257), (256, 256), (123, 171)]
    photos = [Image.fromarray(_photo(h, w, i)) for i, (h, w) in enumerate(sizes)]
    stored = images.decode_rows(len(photos), lambda a, b: photos[a:b], image_size=224)
    assert stored.shape == (len(photos), 3, 256, 256)

    pipeline = InputPipeline(224, 3, (0.0,) * 3, (1.0,) * 3, input_norm="unit", interpolation="bilinear",
                             eval_crop=0.875)
    ours = pipeline(torch.from_numpy(stored), evaluation=True)
    reference = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor()])
    theirs = torch.stack([reference(p) for p in photos])
    assert ours.shape == theirs.shape == (len(photos), 3, 224, 224)
    assert (ours - theirs).abs().max().item() * 255 < 0.01  # the same pixels (float rounding: 1/100 grey level)

    # the old path (squash to a square at decode) was not: a landscape image's content moves
    squashed = torch.from_numpy(np.array(photos[2].resize((224, 224), Image.Resampling.BILINEAR))).permute(2, 0, 1)
    assert (squashed.float() / 255 - theirs[2]).abs().mean().item() > 0.02


def test_unreadable_file_names_it(tmp_path):
    from promptfcl.common.data.sources import DataError

    bad = tmp_path / "x.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(DataError, match="cannot read image .*x.png"):
        images.decode_files([bad], 8)
