"""The machine's memory-mapped data cache (common/data/cache.py): decoded once, mapped by all."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.data import cache as data_cache
from promptfcl.common.data.rows import RowFile
from promptfcl.common.data.sources import load_dataset
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTFCL_CACHE", str(tmp_path / "cache"))
    data_cache._loaded.clear()
    yield tmp_path / "cache" / "data"
    data_cache._loaded.clear()


def _image_folder(root: Path, classes: int = 4, per_class: int = 6) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{i}.png")
    return root


def test_a_source_is_mapped_read_only_and_equals_the_decoded_arrays(cache):
    cfg = tiny_config()
    mapped = data_cache.load_dataset_cached(cfg)
    decoded = load_dataset(cfg)
    assert isinstance(mapped.train.images, RowFile)
    for a, b in ((mapped.train, decoded.train), (mapped.test, decoded.test)):
        assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)
    assert (mapped.fingerprint, mapped.split, mapped.class_names) == (decoded.fingerprint, decoded.split,
                                                                      decoded.class_names)
    assert len(list(cache.glob("*/meta.json"))) == 1
    data_cache._loaded.clear()  # a new process: maps the same entry, decodes nothing
    again = data_cache.load_dataset_cached(cfg)
    assert isinstance(again.train.images, RowFile) and len(list(cache.glob("*/meta.json"))) == 1


def test_processes_started_together_decode_once(cache, tmp_path):
    folder = _image_folder(tmp_path / "images")
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stderr)\n"
            "from promptfcl.common.data.cache import load_dataset_cached\n"
            "from tests.conftest import tiny_config\n"
            f"d = load_dataset_cached(tiny_config(dataset='folder:{folder}', num_tasks=2, image_size=12))\n"
            "print(type(d.train.images).__name__, len(d.train), d.fingerprint)\n")
    env = {**os.environ, "PROMPTFCL_CACHE": str(cache.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len({o[0] for o in outs}) == 1 and outs[0][0].startswith("RowFile 18 ")  # the same arrays, mapped
    assert sum(o[1].count("decoding folder:") for o in outs) == 1  # one process decoded, two waited


def test_a_truncated_entry_is_decoded_again_with_a_warning(cache, caplog):
    cfg = tiny_config()
    first = data_cache.load_dataset_cached(cfg)
    entry = next(cache.glob("*/meta.json")).parent
    images = entry / "train_images.npy"
    head = images.read_bytes()[:1000]
    images.unlink()  # a new, truncated file: `first` keeps mapping the old one
    images.write_bytes(head)
    data_cache._loaded.clear()
    with caplog.at_level(logging.WARNING, logger="promptfcl"):
        again = data_cache.load_dataset_cached(cfg)
    assert "unreadable" in caplog.text and str(entry) in caplog.text
    assert np.array_equal(again.train.images, first.train.images)


def test_an_unwritable_cache_leaves_the_data_in_memory_with_a_warning(cache, caplog):
    cache.parent.mkdir(parents=True)
    cache.parent.chmod(0o500)
    if os.access(cache.parent, os.W_OK):  # root ignores permissions
        cache.parent.chmod(0o700)
        cache.parent.rmdir()
        cache.parent.write_text("a file where the cache directory should be")
    try:
        with caplog.at_level(logging.WARNING, logger="promptfcl"):
            data = data_cache.load_dataset_cached(tiny_config())
    finally:
        if cache.parent.is_dir():
            cache.parent.chmod(0o700)
    assert "holding the decoded data in memory" in caplog.text
    assert isinstance(data.train.images, np.ndarray) and len(data.train) > 0


def test_changed_source_files_make_a_new_entry(cache, tmp_path):
    folder = _image_folder(tmp_path / "images")
    cfg = tiny_config(dataset=f"folder:{folder}", num_tasks=2, image_size=12)
    before = data_cache.load_dataset_cached(cfg)
    _image_folder(folder, per_class=7)  # one more image per class
    data_cache._loaded.clear()
    after = data_cache.load_dataset_cached(cfg)
    assert len(before.train) + len(before.test) == 24 and len(after.train) + len(after.test) == 28
    assert len(list(cache.glob("*/meta.json"))) == 2


def test_the_task_stream_is_checked_on_every_load(cache):
    data_cache.load_dataset_cached(tiny_config(num_tasks=2))
    bad = tiny_config(num_tasks=2, num_clients=2, clients_per_round=2, task_generator="random", num_rounds=4,
                      classes_per_task=2,
                      task_data_fraction=0.001, pool_size=4)
    with pytest.raises(ConfigError, match="raise task-data-fraction"):  # same arrays (cache hit), other stream
        data_cache.load_dataset_cached(bad)


def test_the_query_table_holds_only_the_rows_asked_for():
    """A client asks for its share: the q(x) table grows with the share, not the dataset."""
    import torch

    from promptfcl.common.data.sources import ArraySplit
    from promptfcl.common.model.runtime import QueryCache

    class Model:
        def preprocess(self, x, evaluation=False):
            return x.float()

        def query(self, x):
            return x.mean(dim=(1, 2, 3))[:, None].repeat(1, 8)

    split = ArraySplit(np.random.default_rng(0).integers(0, 255, (20_000, 1, 2, 2), dtype=np.uint8),
                       np.zeros(20_000, np.int64))
    cache = QueryCache(split, 8)
    share = np.random.default_rng(1).choice(20_000, 300, replace=False)
    for _ in range(3):  # rounds: nothing new is computed after the first
        got = cache.get(Model(), share, torch.device("cpu"))
    assert cache.computed == 300 and cache.size == 300 and len(cache.rows) <= 600
    torch.testing.assert_close(got[:, 0], torch.from_numpy(split.images[share].reshape(300, -1).mean(1)).float())


def test_row_file_indexes_like_the_array_it_stores(tmp_path):
    arr = np.random.default_rng(0).integers(0, 255, (50, 3, 4, 5), dtype=np.uint8)
    np.save(tmp_path / "a.npy", arr)
    rows = RowFile(tmp_path / "a.npy")
    assert (rows.shape, rows.dtype, len(rows), rows.ndim) == (arr.shape, arr.dtype, 50, 4)
    for key in (7, -1, slice(3, 9), slice(None, None, 7), slice(40, 90), np.array([4, 4, 0, 49]),
                np.array([[1, 2], [3, 4]]), [5, 6], np.zeros(0, np.int64)):
        assert np.array_equal(rows[key], arr[key]), key
    assert np.array_equal(np.asarray(rows), arr)
    with pytest.raises(IndexError):
        rows[np.array([50])]
    with pytest.raises(TypeError):
        rows[np.array([True] * 50)]
    (tmp_path / "b.npy").write_bytes((tmp_path / "a.npy").read_bytes()[:-10])
    with pytest.raises(ValueError, match="too short"):
        RowFile(tmp_path / "b.npy")
