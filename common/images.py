"""Decoding images into uint8 (N, C, H, W) arrays, a chunk at a time.

A source's images are listed (files, or rows of a Hugging Face split) and their labels read
first; the rows a split keeps are chosen on the labels alone; only then are those rows
decoded, ``CHUNK`` at a time, straight into the output array. So decoding holds the output
and one chunk, never every decoded image at once (ImageNet-R's 30,000 photographs of a few
hundred pixels a side are about 14 GB as decoded images, 4.5 GB as 224-px uint8 rows).

Images keep their native size when all share it (the model resizes per batch, so one copy
serves any backbone); otherwise each is resized to ``image-size`` with ``resize-interpolation``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from promptfcl.common.errors import DataError
from promptfcl.common.files import class_folder

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}
#: images decoded at once
CHUNK = 256


def to_uint8_chw(img: object, size: int | None, interpolation: str = "bilinear") -> np.ndarray:
    """One image (PIL or array-like) as uint8 (C, H, W), C = 1 or 3, resized to ``size`` if given."""
    from PIL import Image

    if not isinstance(img, Image.Image):
        img = Image.fromarray(np.asarray(img))
    if img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    if size is not None and img.size != (size, size):
        img = img.resize((size, size), Image.Resampling[interpolation.upper()])
    arr = np.asarray(img, dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def decode_rows(count: int, fetch: Callable[[int, int], Sequence[object]], image_size: int,
                interpolation: str = "bilinear") -> np.ndarray:
    """``count`` images, ``fetch(start, stop)`` giving images ``start..stop-1``, as one uint8
    (N, C, H, W) array: native size when the first chunk shares one size and every later image
    has it too, else all resized to ``image_size``; grey images repeated to 3 channels when any
    image has colour."""
    if count == 0:
        return np.zeros((0, 1, image_size, image_size), np.uint8)
    first = [to_uint8_chw(im, None, interpolation) for im in fetch(0, min(CHUNK, count))]
    native = len({a.shape[1:] for a in first}) == 1
    channels = max(a.shape[0] for a in first)
    while True:  # at most twice per setting: a later image can only widen channels or force resizing
        size = None if native else image_size
        shape = first[0].shape[1:] if native else (image_size, image_size)
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
