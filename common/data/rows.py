"""Rows of an array stored in a ``.npy`` file, read on demand (the data cache's images).

Positioned reads (``os.preadv``) into the caller's new array: nothing is mapped, so a process
holds only the rows it asked for, while the machine's page cache keeps one copy for every
process reading the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


class RowFile:
    """A read-only (N, ...) array in a ``.npy`` file, read row by row on indexing.

    ``rows[index]`` (an integer, a slice, or an integer array) reads exactly those rows into
    a new ndarray; ``np.asarray(rows)`` reads the whole array. ``shape``, ``dtype``, ``ndim``
    and ``len`` are those of the stored array.
    """

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                raise ValueError(f"{path}: .npy format {version} (np.save writes 1.0 or 2.0)")
            self.offset = fh.tell()
        if fortran or dtype.hasobject or not shape:
            raise ValueError(f"{path}: not a C-ordered array of rows")
        self.path, self.shape, self.dtype = path, tuple(shape), dtype
        self.ndim = len(self.shape)
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * dtype.itemsize
        size = os.stat(path).st_size
        if size < self.offset + self.shape[0] * self.row_bytes:
            raise ValueError(f"{path}: {size} bytes, too short for {self.shape}")
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.shape[0]

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def __getitem__(self, key: Any) -> np.ndarray:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.shape[0])
            if step == 1:
                return self._read_block(start, max(stop - start, 0))
            key = np.arange(start, stop, step)
        rows = np.asarray(key)
        if rows.dtype.kind not in "iu":
            raise TypeError(f"RowFile rows are indexed by integers or slices, not {rows.dtype}")
        flat = rows.reshape(-1).astype(np.int64)
        flat = np.where(flat < 0, flat + self.shape[0], flat)
        if len(flat) and (flat.min() < 0 or flat.max() >= self.shape[0]):
            raise IndexError(f"row index out of range for {self.shape[0]} rows")
        out = np.empty((len(flat), *self.shape[1:]), self.dtype)
        view, size = out.reshape(-1).view(np.uint8).data, self.row_bytes
        for i, row in enumerate(flat.tolist()):
            self._read_into(view[i * size : (i + 1) * size], self.offset + row * size)
        return out.reshape(*rows.shape, *self.shape[1:])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self._read_block(0, self.shape[0])
        return whole if dtype is None else whole.astype(dtype)

    def _read_block(self, start: int, count: int) -> np.ndarray:
        out = np.empty((count, *self.shape[1:]), self.dtype)
        if count:
            self._read_into(out.reshape(-1).view(np.uint8).data, self.offset + start * self.row_bytes)
        return out

    def _read_into(self, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < len(buffer):  # pread may return less than asked
            n = os.preadv(self._fd, [buffer[done:]], offset + done)
            if n == 0:
                raise OSError(f"{self.path}: unexpected end of file at byte {offset + done}")
            done += n
