"""Chunked decoding (common/images.py): the same arrays as decoding everything at once."""

from __future__ import annotations

import numpy as np
import pytest

from promptfcl.common import images


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
    assert out.shape == (7, 3, 10, 10)
    expected = np.stack([images.to_uint8_chw(p, 10) for p in pictures])
    assert np.array_equal(out, expected)


def test_unreadable_file_names_it(tmp_path):
    from promptfcl.common.data import DataError

    bad = tmp_path / "x.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(DataError, match="cannot read image .*x.png"):
        images.decode_files([bad], 8)
