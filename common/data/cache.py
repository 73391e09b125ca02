"""Decode once per machine: a node-local cache of decoded datasets that every process reads rows of.

A source is decoded (and split, capped, put in class order) by the first process that needs
it; the arrays go to ``<cache dir>/data/<key>/`` as plain ``.npy`` files, and every process on
the machine (Ray actors, ClientApp processes, the server) reads from them only the rows it
indexes (:class:`RowFile`, positioned reads into the process's own buffers). A client reads
only the rows of its share, batch by batch, so its memory does not grow with the dataset, and
the machine's page cache holds one copy for all of them. (A memory map would share the same
pages, but the kernel maps whole large folios and read-ahead windows into each process that
touches a row: 70 MB of a 90 MB file resident in a client that read 11 MB of rows, measured
here with an 8 MB read-ahead.)

The key is everything that defines the arrays: the run's dataset keys and the source's
identity (file names, sizes and times; the hub name and revision). A process that finds the
entry being written waits for it (a file lock) instead of decoding again; a truncated or
unreadable entry is decoded again, with a warning; a cache directory that cannot be written
leaves the decoded arrays in memory, with a warning. Entries are never changed in place (a
new one is written beside and renamed), so removing the cache while runs map it is safe;
truncating a mapped file in place is not (the kernel stops the process that reads it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..config.experiment import ExperimentConfig, keys_of
from ..model.weights import cache_dir
from . import images as image_decoding
from . import sources as decoding
from .rows import RowFile
from .sources import ArraySplit, Dataset, DataSource, check_task_stream, read_source, source_identity
from .tasks import TaskLayout

log = logging.getLogger("promptfcl")

ARRAYS = ("train_images", "train_labels", "test_images", "test_labels")


def code_identity(*modules: object) -> str:
    """A digest of the decoding code itself: a changed reader never maps arrays an older one wrote."""
    digest = hashlib.sha1()
    for module in modules:
        digest.update(Path(str(getattr(module, "__file__", ""))).read_bytes())
    return digest.hexdigest()[:12]


def entry_dir(root: Path, key: Any) -> Path:
    """Where the arrays keyed by ``key`` (any JSON value) live under ``root``."""
    # both modules that turn sources into arrays: a change in how images are resized or cropped
    # (common/data/images.py) never maps arrays decoded the old way
    digest = hashlib.sha1(json.dumps([key, code_identity(decoding, image_decoding)], sort_keys=True,
                                     default=str).encode())
    return root / digest.hexdigest()[:20]


def mapped_dataset(root: Path, key: Any, build: Callable[[], Dataset], what: str) -> Dataset:
    """The dataset keyed by ``key``, mapped from ``root`` (built by ``build`` and written there
    if absent or unreadable); ``what`` names it in the log."""
    entry = entry_dir(root, key)
    found = _open(entry)
    if found is not None:
        return found
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(entry.with_suffix(".lock"), "a")  # noqa: SIM115 - held by the with below
    except OSError as exc:  # a read-only or full cache dir: decode in memory, as without a cache
        log.warning("cannot use the data cache %s (%s); holding the decoded data in memory", root, exc)
        return build()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process decodes; the others wait, then map
        found = _open(entry)
        if found is not None:
            return found
        log.info("decoding %s into the data cache %s (once per machine)", what, entry)
        data = build()
        try:
            _write(entry, data)
        except OSError as exc:
            log.warning("cannot write the data cache %s (%s); holding the decoded data in memory", entry, exc)
            return data
    del data  # this process keeps the mapped copy, like every other
    mapped = _open(entry)
    assert mapped is not None, entry
    return mapped


def _write(entry: Path, data: Dataset) -> None:
    """Arrays and metadata to a temporary directory, synced, then renamed to ``entry``."""
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}."))
    try:
        arrays = dict(zip(ARRAYS, (data.train.images, data.train.labels, data.test.images, data.test.labels)))
        for name, arr in arrays.items():
            with open(tmp / f"{name}.npy", "wb") as fh:
                np.save(fh, np.ascontiguousarray(arr), allow_pickle=False)
                fh.flush()
                os.fsync(fh.fileno())
        meta = {"name": data.name, "num_classes": data.num_classes, "class_names": data.class_names,
                "fingerprint": data.fingerprint, "split": data.split,
                "shapes": {k: list(v.shape) for k, v in arrays.items()}}
        (tmp / "meta.json").write_text(json.dumps(meta))  # written last: its presence marks a whole entry
        if entry.exists():  # an unreadable entry being replaced
            shutil.rmtree(entry, ignore_errors=True)
        os.replace(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _open(entry: Path) -> Dataset | None:
    """The entry's arrays mapped read-only, or None when it is absent or unreadable."""
    if not (entry / "meta.json").is_file():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        images = {name: RowFile(entry / f"{name}.npy") for name in ("train_images", "test_images")}
        labels = {name: np.load(entry / f"{name}.npy", allow_pickle=False)  # small: held in memory
                  for name in ("train_labels", "test_labels")}
        for name, arr in [*images.items(), *labels.items()]:
            if list(arr.shape) != meta["shapes"][name]:
                raise ValueError(f"{name} has shape {arr.shape}, metadata says {meta['shapes'][name]}")
    except (OSError, ValueError, KeyError, TypeError) as exc:  # truncated file, bad header, bad metadata
        log.warning("data cache entry %s unreadable (%s); decoding the source again", entry, exc)
        return None
    return Dataset(meta["name"], ArraySplit(images["train_images"], labels["train_labels"]),
                   ArraySplit(images["test_images"], labels["test_labels"]), int(meta["num_classes"]),
                   list(meta["class_names"]), str(meta["fingerprint"]), str(meta["split"]))


# ----------------------------------------------------------------------------- a run's dataset
DATA_KEYS = keys_of("dataset")
_loaded: dict[str, Dataset] = {}


def load_dataset_cached(cfg: ExperimentConfig) -> Dataset:
    """Run ``cfg``'s dataset (:func:`load_source_cached`), its task stream checked on every load."""
    data = load_source_cached(DataSource.of(cfg.run, cfg.data, cfg.model, cfg.caching), cfg.data.num_tasks)
    check_task_stream(TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, data.num_classes), data)
    return data


def load_source_cached(source: DataSource, num_tasks: int) -> Dataset:
    """``source``'s dataset: mapped from the machine's data cache (``data-cache``, decoded once
    per machine), held once per process (a ClientApp in a long-lived Ray actor loads its data
    once, whatever the other settings of the run). ``num_tasks`` is one of the run's dataset
    keys (``keys_of("dataset")``) the cache is keyed by."""
    full = {**source.keys(), "num-tasks": num_tasks}
    keys = {k: full[k] for k in DATA_KEYS}
    text = json.dumps(keys, sort_keys=True)
    if text not in _loaded:
        _loaded.clear()  # one dataset per process is enough; keeps memory bounded
        if source.cache:
            _loaded[text] = mapped_dataset(cache_dir() / "data", [keys, source_identity(source)],
                                           lambda: read_source(source), source.dataset)
        else:
            _loaded[text] = read_source(source)
    return _loaded[text]
