"""Honest splits and the reproducibility kit (common/data/sources.py's sources, common/data/splits.py).

Hugging Face sources are real ``datasets`` objects served by a patched ``load_dataset`` (the
hub is not reachable here); splits.npz is written and read by real in-process runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.data.partitions import client_indices, drawn_indices, drawn_shares
from promptfcl.common.data.sources import DataError, load_dataset
from promptfcl.common.data.splits import read_splits
from promptfcl.common.data.tasks import class_order
from promptfcl.common.model.runtime import layout_of, partition_of
from tests.conftest import tiny_config
from tests.helpers import simulate_in_process

datasets = pytest.importorskip("datasets")


def _images(n: int, classes: int, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    features = datasets.Features({"img": datasets.Image(),
                                  "label": datasets.ClassLabel(names=[f"c{i}" for i in range(classes)])})
    imgs = [rng.integers(0, 255, (8, 8, 3), dtype=np.uint8) for _ in range(n)]
    return datasets.Dataset.from_dict({"img": imgs, "label": [i % classes for i in range(n)]}, features=features)


@pytest.fixture
def hub(monkeypatch):
    """``datasets.load_dataset`` answering with the DatasetDict put in ``served``; records its calls."""
    served: dict = {}
    calls: list = []

    def load_dataset(name, revision=None, **kwargs):
        calls.append((name, revision))
        return datasets.DatasetDict(served)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return served, calls


def test_a_single_split_source_is_split_80_20_by_seed_and_recorded(hub):
    served, calls = hub
    served["test"] = _images(100, 4)  # the only split, named "test" (as some mirrors publish ImageNet-R)
    cfg = tiny_config(dataset="hf:someone/one-split", num_tasks=2, test_fraction=0.2, image_size=8,
                      hf_revision="0123abc")
    data = load_dataset(cfg)
    assert calls == [("someone/one-split", "0123abc")]  # the revision reaches the hub
    assert (len(data.train), len(data.test)) == (80, 20)
    assert np.bincount(data.test.labels).tolist() == [5, 5, 5, 5]  # stratified
    train_rows = {img.tobytes() for img in data.train.images}
    assert not any(img.tobytes() in train_rows for img in data.test.images)  # disjoint
    assert "only split 'test'" in data.split and "seed 0" in data.split and "80% train / 20% test" in data.split
    assert "0123abc" in data.split
    again = load_dataset(cfg)
    other = load_dataset(tiny_config(dataset="hf:someone/one-split", num_tasks=2, test_fraction=0.2, image_size=8,
                                     hf_revision="0123abc", seed=1))
    assert np.array_equal(again.test.images, data.test.images)  # same seed, same split
    assert not np.array_equal(np.sort(other.test.images, axis=0), np.sort(data.test.images, axis=0))


def test_train_and_test_splits_are_used_as_published(hub):
    served, _ = hub
    served["train"], served["validation"] = _images(40, 4, seed=1), _images(12, 4, seed=2)
    data = load_dataset(tiny_config(dataset="hf:someone/two-splits", num_tasks=2, image_size=8))
    assert (len(data.train), len(data.test)) == (40, 12)
    assert "'train' (train) and 'validation' (test)" in data.split and "unpinned" in data.split


def test_a_source_whose_train_and_test_are_the_same_data_is_refused(hub):
    served, _ = hub
    same = _images(40, 4)
    served["train"], served["test"] = same, same
    with pytest.raises(DataError, match="someone/same: the train and test splits are the same 40 images"):
        load_dataset(tiny_config(dataset="hf:someone/same", num_tasks=2, image_size=8))


def test_several_splits_without_train_are_ambiguous(hub):
    served, _ = hub
    served["test"], served["validation"] = _images(20, 4), _images(20, 4, seed=3)
    with pytest.raises(DataError, match=r"splits \['test', 'validation'\] have no 'train'"):
        load_dataset(tiny_config(dataset="hf:someone/no-train", num_tasks=2, image_size=8))


def test_folder_with_train_and_test_pointing_at_the_same_images_is_refused(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(4):
        (tmp_path / "train" / f"class{c}").mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(tmp_path / "train" / f"class{c}" / f"{i}.png")
    (tmp_path / "test").symlink_to(tmp_path / "train")
    with pytest.raises(DataError, match="the train and test splits are the same 12 images"):
        load_dataset(tiny_config(dataset=f"folder:{tmp_path}", num_tasks=2, image_size=8))


def test_every_run_writes_its_splits_and_another_run_reuses_them_exactly(tmp_path):
    first = simulate_in_process(tmp_path / "a", partition="dirichlet", seed=0)
    path = tmp_path / "a" / "splits.npz"
    assert first["dataset"]["splits_file"] == "splits.npz" and "split by seed 0" in first["dataset"]["split"]
    assert oct(path.stat().st_mode & 0o777) in ("0o644", "0o640", "0o600", "0o664")  # as the umask says
    recorded = read_splits(str(path))
    cfg = tiny_config(partition="dirichlet", seed=0, rounds_per_task=2, num_clients=3, clients_per_round=3)
    data = load_dataset(cfg)
    assert recorded.class_order.tolist() == class_order(10, 0).tolist()
    assert sorted(recorded.shares) == [(c, t, -1) for c in range(3) for t in range(2)]
    for (client, task, _), share in recorded.shares.items():
        assert share.tolist() == client_indices(data.train.labels, layout_of(cfg, 10), partition_of(cfg), client, task, 0).tolist()

    # seed 1 draws another class order and other shares ...
    drawn = simulate_in_process(tmp_path / "b", partition="dirichlet", seed=1)
    assert drawn["dataset"]["class_order_names"] != first["dataset"]["class_order_names"]
    # ... unless it is given the first run's splits: then it trains on exactly those
    reused = simulate_in_process(tmp_path / "c", partition="dirichlet", seed=1, splits=str(path))
    assert reused["dataset"]["class_order_names"] == first["dataset"]["class_order_names"]
    assert reused["config"]["splits"] == str(path)
    again = read_splits(str(tmp_path / "c" / "splits.npz"))
    assert again.class_order.tolist() == recorded.class_order.tolist()
    assert {k: v.tolist() for k, v in again.shares.items()} == {k: v.tolist() for k, v in recorded.shares.items()}
    assert json.loads(str(np.load(tmp_path / "a" / "splits.npz")["config"]))["seed"] == 0


def test_per_round_draws_are_recorded_per_round():
    cfg = tiny_config(partition="stateless", num_clients=4, rounds_per_task=3)
    digits = load_dataset(cfg)
    shares = drawn_shares(digits.train.labels, layout_of(cfg, digits.num_classes), partition_of(cfg))
    assert len(shares) == 4 * 2 * 3 and (1, 1, 2) in shares
    assert shares[(1, 1, 2)].tolist() == drawn_indices(digits.train.labels, layout_of(cfg, 10), partition_of(cfg), 1, 1, 2).tolist()
    assert shares[(1, 1, 2)].tolist() != shares[(1, 1, 1)].tolist()


def test_a_wrong_or_corrupt_splits_file_is_a_clear_error(tmp_path):
    simulate_in_process(tmp_path / "a", partition="iid")
    path = tmp_path / "a" / "splits.npz"
    with pytest.raises(DataError, match="splits file .* was written for other training data"):
        load_dataset(tiny_config(splits=str(path), max_train_per_class=20))  # fewer training images
    data = load_dataset(tiny_config(splits=str(path)))
    with pytest.raises(DataError, match="holds no share for client 4, task 1"):  # a larger population
        client_indices(data.train.labels, layout_of(tiny_config(splits=str(path), num_clients=5), 10), partition_of(tiny_config(splits=str(path), num_clients=5)), 4, 1, 0)
    with pytest.raises(ConfigError, match="outside the task"):  # another task stream over the same data
        client_indices(data.train.labels, layout_of(tiny_config(splits=str(path), num_tasks=5), 10), partition_of(tiny_config(splits=str(path), num_tasks=5)), 0, 0, 0)
    bad = tmp_path / "bad.npz"
    bad.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataError, match="splits file .*bad.npz unreadable"):
        load_dataset(tiny_config(splits=str(bad)))


def test_deployed_nodes_refuse_a_splits_file_named_by_the_server(tmp_path):
    from promptfcl.client.node_data import NodeDataError, node_data

    with pytest.raises(NodeDataError, match="a node does not open files the server names"):
        node_data(tiny_config(splits="/etc/passwd"), {"partition-id": 0, "num-partitions": 3, "data-from-run": True})
