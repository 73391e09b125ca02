"""Decoding images into uint8 (N, C, H, W) arrays, a chunk at a time.

A source's images are listed (files, or rows of a Hugging Face split) and their labels read
first; the rows a split keeps are chosen on the labels alone; only then are those rows
decoded, ``CHUNK`` at a time, straight into the output array. So decoding holds the output
and one chunk, never every decoded image at once (ImageNet-R's 30,000 photographs of a few
hundred pixels a side are about 14 GB as decoded images, 5.9 GB as 256-px uint8 rows).

Images keep their native size when all share one square size (the model resizes per batch, so
one copy serves any backbone). Otherwise (ImageNet-R's photographs of mixed sizes and shapes)
each keeps its aspect ratio as torchvision's ``Resize(int)`` + ``CenterCrop`` keep it: resized
with ``resize-interpolation`` so that its shorter side is :func:`stored_side` (8/7 of
``image-size``: 256 px for 224), then its central square of that side kept. Evaluation's
``eval-crop = 0.875`` then takes exactly ``Resize(256)`` + ``CenterCrop(224)`` of the original
(common/model/preprocess.py; ``tests/test_images.py`` compares the two on non-square images).
Training crops (``augment = "resized-crop-flip"``) are drawn from that stored square, where the
authors' ``RandomResizedCrop`` draws from the whole original image: the strips of a long side
outside the central square are never seen in training, and the crop scale is a fraction of the
square's area (keeping every original would need one array per image size).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..files import class_folder

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}
#: images decoded at once
CHUNK = 256


def stored_side(image_size: int) -> int:
    """The side of the square in which images of mixed sizes are stored: ``image_size`` x 8/7
    (256 for 224), the margin of the ``Resize(256)`` + ``CenterCrop(224)`` evaluation
    transform of CODA-P's code on ImageNet-type data and FPPL's code (``eval-crop = 0.875``)."""
    return round(image_size * 8 / 7)


def to_uint8_chw(img: object, size: int | None, interpolation: str = "bilinear") -> np.ndarray:
    """One image (PIL or array-like) as uint8 (C, H, W), C = 1 or 3; with ``size``, resized so that
    its shorter side is ``size`` and cut to its central ``size`` x ``size`` square, exactly as
    torchvision's ``Resize(size)`` + ``CenterCrop(size)`` (a square image is just resized)."""
    # PIL: only decoding encoded images needs it
    from PIL import Image

    if not isinstance(img, Image.Image):
        img = Image.fromarray(np.asarray(img))
    if img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    if size is not None and img.size != (size, size):
        w, h = img.size
        # torchvision's _compute_resized_output_size: the longer side truncated, not rounded
        nw, nh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
        if (nw, nh) != (w, h):
            img = img.resize((nw, nh), Image.Resampling[interpolation.upper()])
        # torchvision's center_crop: offsets rounded half to even (Python's round)
        left, top = int(round((nw - size) / 2.0)), int(round((nh - size) / 2.0))
        if (nw, nh) != (size, size):
            img = img.crop((left, top, left + size, top + size))
    arr = np.asarray(img, dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def decode_rows(count: int, fetch: Callable[[int, int], Sequence[object]], image_size: int,
                interpolation: str = "bilinear") -> np.ndarray:
    """``count`` images, ``fetch(start, stop)`` giving images ``start..stop-1``, as one uint8
    (N, C, H, W) array: native size when the first chunk shares one square size and every later
    image has it too, else each resized, aspect kept, and centre-cropped to a square of side
    :func:`stored_side` (:func:`to_uint8_chw`); grey images repeated to 3 channels when any
    image has colour."""
    if count == 0:
        return np.zeros((0, 1, image_size, image_size), np.uint8)
    first = [to_uint8_chw(im, None, interpolation) for im in fetch(0, min(CHUNK, count))]
    shapes = {a.shape[1:] for a in first}
    native = len(shapes) == 1 and first[0].shape[1] == first[0].shape[2]
    channels = max(a.shape[0] for a in first)
    side = stored_side(image_size)
    while True:  # at most twice per setting: a later image can only widen channels or force resizing
        size = None if native else side
        shape = first[0].shape[1:] if native else (side, side)
        out = np.empty((count, channels, *shape), np.uint8)
        restart = False
        for start in range(0, count, CHUNK):
            for i, im in enumerate(fetch(start, min(start + CHUNK, count))):
                row = to_uint8_chw(im, size, interpolation)
                if row.shape[1:] != shape:  # sizes differ after all: resize every image
                    native, restart = False, True
                    break
                if row.shape[0] > channels:  # colour after grey: every image in 3 channels
                    channels, restart = 3, True
                    break
                out[start + i] = np.repeat(row, channels, axis=0) if row.shape[0] != channels else row
            if restart:
                break
        if not restart:
            return out


def image_listing(root: Path) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime) of every image under ``root``: a folder's identity for caches."""
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.suffix.lower() in IMAGE_EXTENSIONS:
                st = p.stat()
                out.append((str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    return sorted(out)


def class_folder_files(split_root: Path, names: list[str], skip_missing: bool) -> tuple[list[Path], np.ndarray]:
    """The image files of ``split_root/<class>/*`` (sorted per class) and their labels, by
    position in ``names``. A missing class folder is an error unless ``skip_missing``;
    ``names`` may come from the server (``class-names``): each must be one folder directly
    inside ``split_root`` (:func:`class_folder`), or nothing is listed."""
    files: list[Path] = []
    labels: list[int] = []
    folders = [class_folder(split_root, cls) for cls in names]  # every name checked before any listing
    for label, cls_dir in enumerate(folders):
        if not cls_dir.is_dir():
            if skip_missing:
                continue
            raise DataError(f"class folder {cls_dir} missing")
        for f in sorted(cls_dir.iterdir()):
            if f.suffix.lower() in IMAGE_EXTENSIONS:
                files.append(f)
                labels.append(label)
    return files, np.asarray(labels, dtype=np.int64)


def decode_files(files: Sequence[Path], image_size: int, interpolation: str = "bilinear") -> np.ndarray:
    """The images in ``files`` as one uint8 array (:func:`decode_rows`); an unreadable file is a
    DataError naming it."""
    # PIL: only decoding encoded images needs it
    from PIL import Image, UnidentifiedImageError

    def fetch(start: int, stop: int) -> list[object]:
        images: list[object] = []
        for f in files[start:stop]:
            try:
                with Image.open(f) as im:
                    im.load()
                    images.append(im.copy())
            except (OSError, UnidentifiedImageError) as exc:
                raise DataError(f"cannot read image {f}: {exc}") from exc
        return images

    return decode_rows(len(files), fetch, image_size, interpolation)
