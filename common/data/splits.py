"""The reproducibility kit: a run's class order and every client's sample indices per task.

Every run whose server holds the data writes ``splits.npz`` beside results.json; another run
given ``splits = "path/to/splits.npz"`` trains on exactly those shares, in that class order,
whatever its seed draws. The file is plain NumPy (no pickles):

``class_order``
    original class ids in training order (position = remapped label).
``train_labels``
    the remapped training labels the indices point into; a run reusing the file must have
    exactly these, so the indices select the same samples.
``keys``, ``offsets``, ``indices``
    share ``i`` is client ``keys[i, 0]``'s in task ``keys[i, 1]`` and round ``keys[i, 2]``
    within the task (-1: every round), ``indices[offsets[i]:offsets[i + 1]]``.
``data_seed``
    the seed that split the source into train and test and capped it (the writer's seed); a
    run reusing the file splits its source with it, whatever its own seed.
``config``
    the JSON configuration of the run that drew them.
"""

from __future__ import annotations

import functools
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import DataError
from ..files import write_atomic

FILE_NAME = "splits.npz"
FORMAT = 1
#: a share that does not depend on the round
ANY_ROUND = -1


@dataclass(frozen=True)
class Splits:
    """A splits.npz read back."""

    path: str
    data_seed: int
    class_order: np.ndarray
    train_labels: np.ndarray
    shares: dict[tuple[int, int, int], np.ndarray]

    def share(self, client: int, task: int, round_: int) -> np.ndarray:
        """The recorded indices of ``client`` in ``task`` (and ``round_``, for per-round draws)."""
        found = self.shares.get((client, task, ANY_ROUND))
        if found is None:
            found = self.shares.get((client, task, round_))
        if found is None:
            raise DataError(f"splits file {self.path} holds no share for client {client}, task {task}, "
                            f"round {round_}: it was written by a run with another population or schedule")
        return found.copy()  # the cached arrays stay read-only


def write_splits(path: Path, data_seed: int, class_order: np.ndarray, train_labels: np.ndarray,
                 shares: dict[tuple[int, int, int], np.ndarray], config: dict) -> None:
    """Write splits.npz (compressed; readable by the group like the other results)."""

    keys = sorted(shares)
    sizes = [len(shares[k]) for k in keys]
    buf = io.BytesIO()
    np.savez_compressed(
        buf, format=np.int64(FORMAT), data_seed=np.int64(data_seed),
        class_order=np.asarray(class_order, np.int64), train_labels=np.asarray(train_labels, np.int32),
        keys=np.asarray(keys, np.int64).reshape(-1, 3),
        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        indices=np.concatenate([shares[k] for k in keys]).astype(np.int32) if keys else np.zeros(0, np.int32),
        config=np.array(json.dumps(config, sort_keys=True)))
    write_atomic(path, lambda fh: fh.write(buf.getvalue()), shared=True)


@functools.lru_cache(maxsize=2)
def read_splits(path: str) -> Splits:
    """splits.npz at ``path``, checked; a clear DataError naming the file otherwise."""
    try:
        with np.load(Path(path).expanduser(), allow_pickle=False) as doc:
            if int(doc["format"]) != FORMAT:
                raise DataError(f"splits file {path} has format {int(doc['format'])}; this version reads {FORMAT}")
            data_seed = int(doc["data_seed"])
            order, labels = doc["class_order"], doc["train_labels"].astype(np.int64)
            keys, offsets, indices = doc["keys"], doc["offsets"], doc["indices"].astype(np.int64)
    except DataError:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise DataError(f"splits file {path} unreadable ({type(exc).__name__}: {exc}); "
                        f"it must be a {FILE_NAME} written by a promptfcl run") from exc
    n = len(labels)
    if (sorted(order.tolist()) != list(range(len(order))) or keys.ndim != 2 or keys.shape[1] != 3
            or len(offsets) != len(keys) + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0)
            or offsets[-1] != len(indices) or (len(indices) and (indices.min() < 0 or indices.max() >= n))):
        raise DataError(f"splits file {path} is inconsistent (class order, share offsets or indices out of range)")
    shares = {(int(c), int(t), int(r)): indices[offsets[i]:offsets[i + 1]] for i, (c, t, r) in enumerate(keys)}
    for share in shares.values():
        share.setflags(write=False)
    return Splits(str(path), data_seed, order.astype(np.int64), labels, shares)


def check_matches(splits: Splits, train_labels: np.ndarray) -> None:
    """The run's training labels must be those the file's indices point into."""
    if len(train_labels) != len(splits.train_labels) or not np.array_equal(train_labels, splits.train_labels):
        raise DataError(f"splits file {splits.path} was written for other training data ({len(splits.train_labels)} "
                        f"labels, this run's dataset has {len(train_labels)} or orders them differently): use "
                        "the same dataset, test-fraction and max-train-per-class as the run that wrote it")
