"""Partial arrays completed from whole ones: the one place a payload or reply that carries only
some rows of some arrays (Powder's local pool and task rows, FPPL's own task prompt) is put back
into full-size arrays.

Used on both sides: a client completes what it was sent (Powder's learner), the server completes
what a client replied with the arrays it sent (Powder's and FPPL's strategies).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

#: the rows of array ``name`` (value: the whole array) that the partial arrays hold, as a slice or
#: index array; None: the partial arrays hold the whole array
Rows = Callable[[str, np.ndarray], "slice | np.ndarray | None"]


def completed(partial: Mapping[str, np.ndarray], whole: Mapping[str, np.ndarray], rows: Rows) -> dict[str, np.ndarray]:
    """Every array of ``whole`` (in its order) with ``partial``'s rows in place.

    Parameters
    ----------
    partial : mapping of name to array
        The arrays as they travelled: of each array of ``whole``, its ``rows`` or, where
        ``rows`` gives None, the whole array (KeyError when one is missing).
    whole : mapping of name to array
        What the rows that did not travel are taken from (copied; dtypes kept: the partial
        rows are cast to them).
    rows : callable
        ``rows(name, whole[name])``: the rows of the array that ``partial`` holds.
    """
    out: dict[str, np.ndarray] = {}
    for name, value in whole.items():
        value = np.asarray(value)
        held = rows(name, value)
        if held is None:
            out[name] = np.asarray(partial[name])
            continue
        out[name] = value.copy()
        out[name][held] = partial[name]
    return out


__all__ = ["Rows", "completed"]
