"""Task stream and client partitions: coverage, disjointness, skew, determinism, errors."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from promptfcl.common.config.experiment import ConfigError
from promptfcl.common.data.augment import augment_images
from promptfcl.common.data.partitions import client_indices
from promptfcl.common.data.sources import DataError, load_dataset
from promptfcl.common.data.tasks import class_order
from promptfcl.common.model.runtime import layout_of, partition_of
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def digits():
    return load_dataset(tiny_config(num_tasks=5))


def shares(data, cfg, task, round_=0):
    return [client_indices(data.train.labels, layout_of(cfg, data.num_classes), partition_of(cfg), c, task, round_) for c in range(cfg.federation.num_clients)]


def test_class_order_is_a_seeded_permutation():
    a, b, c = class_order(100, 0), class_order(100, 0), class_order(100, 1)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_labels_are_remapped_so_tasks_own_contiguous_classes(digits):
    assert digits.num_classes == 10
    five = tiny_config(num_tasks=5)
    assert list(layout_of(five, 10).classes(2)) == [4, 5]
    assert list(layout_of(five, 10).seen(2)) == list(range(6))
    # the remapping follows the class order: remapped label j holds original class order[j]
    order = class_order(10, 0)
    assert digits.class_names == [str(c) for c in order]
    assert set(np.unique(digits.train.labels)) == set(range(10))


def test_train_test_split_is_disjoint_and_seeded():
    a, b = load_dataset(tiny_config()), load_dataset(tiny_config())
    assert a.fingerprint == b.fingerprint
    assert len(a.train) + len(a.test) == 1797
    assert load_dataset(tiny_config(seed=1)).fingerprint != a.fingerprint


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "quantity", "quantity-skew"])
def test_static_partitions_cover_the_task_disjointly(digits, partition):
    cfg = tiny_config(num_tasks=5, num_clients=6, clients_per_round=2, partition=partition,
                      dirichlet_beta=0.5, min_partition_size=0, classes_per_client=1)
    parts = shares(digits, cfg, task=1)
    union = np.concatenate(parts)
    assert len(union) == len(np.unique(union)), "a sample was given to two clients"
    task_pool = np.flatnonzero(np.isin(digits.train.labels, layout_of(cfg, 10).classes(1)))
    assert set(union.tolist()) == set(task_pool.tolist()), "a sample of the task was given to no client"
    assert set(np.unique(digits.train.labels[union])) <= set(layout_of(cfg, 10).classes(1).tolist())
    # pure function of (seed, client, task): recomputed identically
    again = shares(digits, cfg, task=1)
    assert all(np.array_equal(x, y) for x, y in zip(parts, again))


def test_quantity_partition_gives_each_client_k_classes(digits):
    cfg = tiny_config(num_tasks=2, num_clients=6, partition="quantity", classes_per_client=2)
    for part in shares(digits, cfg, task=0):
        assert len(np.unique(digits.train.labels[part])) == 2


def _stream_labels(classes=100, per_class=500):
    """Labels of a CIFAR-100-like training set (classes x per_class samples)."""
    return np.repeat(np.arange(classes), per_class).astype(np.int64)


def test_quantity_partition_holds_every_class_of_every_task():
    """10 tasks x 10 classes, 10 clients, k in {1, 2}, seeds 0-4: every class of every task is held
    by some client (flwr-datasets' random assignment left 235 of these 1,000 task classes to no one)."""
    labels = _stream_labels()
    for k in (1, 2):
        for seed in range(5):
            cfg = tiny_config(num_tasks=10, num_clients=10, partition="quantity", classes_per_client=k, seed=seed)
            for task in range(10):
                parts = [client_indices(labels, layout_of(cfg, 100), partition_of(cfg), c, task, 0) for c in range(10)]
                assert [len(np.unique(labels[p])) for p in parts] == [k] * 10
                union = np.concatenate(parts)
                assert len(union) == len(np.unique(union)) == 5000  # every sample of the task, once
    # NIID-Bench's assignment when clients >= classes: client i holds the task's class i mod K first
    cfg = tiny_config(num_tasks=10, num_clients=25, partition="quantity", classes_per_client=1, seed=3)
    task_cls = layout_of(cfg, 100).classes(2)
    for c in range(25):
        assert set(labels[client_indices(labels, layout_of(cfg, 100), partition_of(cfg), c, 2, 0)]) == {task_cls[c % 10]}


def test_quantity_partition_refuses_when_clients_cannot_hold_every_class():
    cfg = tiny_config(num_tasks=10, num_clients=4, partition="quantity", classes_per_client=2)
    with pytest.raises(ConfigError, match="4 clients x classes-per-client 2 = 8 < its 10 classes"):
        client_indices(_stream_labels(), layout_of(cfg, 100), partition_of(cfg), 0, 0, 0)
    cfg = cfg.replace(classes_per_client=3)  # 12 >= 10: every class held, some by two clients
    parts = [client_indices(_stream_labels(), layout_of(cfg, 100), partition_of(cfg), c, 0, 0) for c in range(4)]
    assert len(np.unique(_stream_labels()[np.concatenate(parts)])) == 10


def test_dirichlet_as_niid_bench_min_size_balance_and_dataset_scope():
    """NIID-Bench's label skew (FPPL's code): redraw until every client holds min-partition-size,
    balancing caps a client at the average share, and partition-scope = dataset cuts the whole
    training set once (a client's task shares are parts of one share)."""
    labels = _stream_labels()
    base = tiny_config(num_tasks=10, num_clients=100, partition="dirichlet", dirichlet_beta=0.05, min_partition_size=0)

    def task_sizes(cfg, task=0):
        return np.array([len(client_indices(labels, layout_of(cfg, 100), partition_of(cfg), c, task, 0)) for c in range(100)])

    assert (task_sizes(base) == 0).sum() >= 2  # beta 0.05 leaves clients empty without a minimum
    few = base.replace(num_clients=20, min_partition_size=10)  # (100 clients cannot all reach 10 in one task)
    assert min(len(client_indices(labels, layout_of(few, 100), partition_of(few), c, 0, 0)) for c in range(20)) >= 10
    whole = base.replace(partition_scope="dataset", min_partition_size=10)
    totals = sum(task_sizes(whole, t) for t in range(10))
    assert totals.min() >= 10 and totals.sum() == len(labels)
    balanced = sum(task_sizes(whole.replace(dirichlet_balance=True), t) for t in range(10))
    assert balanced.sum() == len(labels)
    assert balanced.max() < totals.max() and balanced.std() < totals.std()  # the cap at N / clients
    # scope dataset: the same client's shares of two tasks come from one draw, and differ from
    # the per-task draws
    assert not np.array_equal(client_indices(labels, layout_of(whole, 100), partition_of(whole), 7, 3, 0), client_indices(labels, layout_of(base, 100), partition_of(base), 7, 3, 0))
    with pytest.raises(ConfigError, match="min-partition-size"):
        task_sizes(base.replace(min_partition_size=60))  # 100 x 60 > the task's 5000 samples


def _empty_clients_per_task(cfg, labels, num_classes=100):
    return np.array([sum(len(client_indices(labels, layout_of(cfg, num_classes), partition_of(cfg), c, t, 0)) == 0 for c in range(cfg.federation.num_clients))
                     for t in range(cfg.data.num_tasks)])


def test_balanced_dirichlet_cuts_classes_in_original_order_so_no_task_is_favoured():
    """FPPL's configuration (NIID-Bench's Dirichlet 0.5 over the whole training set, balancing,
    min 10, 10 clients) on an ImageNet-R-like set (200 classes x 120, 20 tasks), 4 seeds: cut in
    task order, the clients that reach the average share on the early tasks get nothing of the
    last ones (empty clients only in the last tasks, most in the very last); cut in the dataset's
    own label order, as NIID-Bench and FPPL's code do, the empty clients show no trend over tasks."""
    labels = _stream_labels(200, 120)
    fppl = tiny_config(num_tasks=20, num_clients=10, clients_per_round=10, partition="dirichlet", dirichlet_beta=0.5,
                       min_partition_size=10, dirichlet_balance=True, partition_scope="dataset")
    empty = {order: np.mean([_empty_clients_per_task(fppl.replace(seed=seed, partition_class_order=order), labels, 200)
                             for seed in range(4)], axis=0)
             for order in ("task", "original")}
    assert empty["task"][:10].sum() == 0 and empty["task"][-1] >= 1.5  # the old cut: the last tasks starve
    assert np.all(np.diff(empty["task"][-4:]) >= 0)
    assert abs(empty["original"][10:].mean() - empty["original"][:10].mean()) <= 0.1  # no trend
    assert empty["original"][-1] <= 0.5
    # without balancing the cut order changes nothing (the proportions are drawn in label order)
    plain = fppl.replace(dirichlet_balance=False)
    for task in (0, 19):
        for c in range(10):
            assert np.array_equal(client_indices(labels, layout_of(plain, 200), partition_of(plain), c, task, 0),
                                  client_indices(labels, layout_of(plain.replace(partition_class_order="task"), 200), partition_of(plain.replace(partition_class_order="task")), c, task, 0))


def test_dirichlet_skew_grows_as_beta_shrinks(digits):
    def mean_max_share(beta):  # a client's largest class share, averaged over clients and 6 seeds
        fractions = []
        for seed in range(6):
            cfg = tiny_config(num_tasks=2, num_clients=8, partition="dirichlet", dirichlet_beta=beta,
                              min_partition_size=0, seed=seed)
            for part in shares(digits, cfg, task=0):
                if len(part):
                    counts = np.bincount(digits.train.labels[part], minlength=10)
                    fractions.append(counts.max() / counts.sum())
        return np.mean(fractions)

    iid_like, skewed = mean_max_share(100.0), mean_max_share(0.05)
    assert iid_like < 0.3  # 5 classes per task: near-uniform shares (measured 0.22)
    assert skewed > 0.7  # mostly one class per client (measured 0.78)


def _label_distance(labels, part, pool):
    """Total-variation distance between a client's label histogram and its task's."""
    own = np.bincount(labels[part], minlength=10) / len(part)
    task = np.bincount(labels[pool], minlength=10) / len(pool)
    return 0.5 * np.abs(own - task).sum()


def test_quantity_skew_skews_sizes_and_keeps_each_clients_labels_like_the_tasks(digits):
    """NIID-Bench's quantity skew: sizes from Dir(beta) over clients, labels IID (not k classes each)."""
    pool = np.flatnonzero(np.isin(digits.train.labels, layout_of(tiny_config(num_tasks=2), 10).classes(0)))

    def split(beta, seed=0, partition="quantity-skew"):
        cfg = tiny_config(num_tasks=2, num_clients=10, partition=partition, dirichlet_beta=beta, seed=seed)
        return shares(digits, cfg, task=0)

    def size_spread(beta):  # coefficient of variation of the client sizes, over a few seeds
        return np.mean([np.std([len(p) for p in split(beta, seed)]) / np.mean([len(p) for p in split(beta, seed)])
                        for seed in range(4)])

    assert size_spread(100.0) < 0.2  # large beta: near-equal sizes
    assert size_spread(0.1) > 1.0  # small beta: a few clients hold most of the task
    assert size_spread(0.5) > 0.5
    for parts in (split(0.5), split(0.1)):
        assert sum(len(p) for p in parts) == len(pool)
        for part in parts:
            if len(part) >= 50:  # a sample of the task: its histogram is close to the task's
                assert _label_distance(digits.train.labels, part, pool) < 0.2
    # ... unlike Dirichlet label skew at the same beta, which gives every client its own mixture
    def mean_distance(partition):
        return np.mean([_label_distance(digits.train.labels, p, pool)
                        for seed in range(4) for p in split(0.5, seed, partition) if len(p) >= 20])
    assert mean_distance("quantity-skew") < 0.15 < 0.3 < mean_distance("dirichlet")  # measured: 0.09 and 0.43


def test_quantity_skew_redraws_until_every_client_has_min_partition_size(digits):
    cfg = tiny_config(num_tasks=2, num_clients=10, partition="quantity-skew", dirichlet_beta=0.5, min_partition_size=10)
    sizes = [len(p) for p in shares(digits, cfg, task=0)]
    assert min(sizes) >= 10 and np.std(sizes) > 10  # still skewed
    with pytest.raises(ConfigError, match="min-partition-size"):
        shares(digits, cfg.replace(min_partition_size=200), task=0)  # 10 x 200 > the task's samples


def test_crop_flip_is_a_seeded_padded_crop_and_horizontal_flip():
    rng = np.random.default_rng(0)
    images = rng.integers(1, 256, (64, 3, 16, 16)).astype(np.uint8)  # no zeros: padding is recognisable
    views = augment_images(images, "crop-flip", np.random.default_rng(7))
    assert views.shape == images.shape and views.dtype == np.uint8
    np.testing.assert_array_equal(views, augment_images(images, "crop-flip", np.random.default_rng(7)))
    assert not np.array_equal(views, augment_images(images, "crop-flip", np.random.default_rng(8)))
    assert augment_images(images, "none", rng) is images
    padded = np.pad(images, ((0, 0), (0, 0), (2, 2), (2, 2)))  # 1/8 of 16 px
    flips = 0
    for img, view in zip(padded, views):  # every view is a 16 x 16 window of the padded image, maybe mirrored
        windows = [(img[:, t : t + 16, l : l + 16], f) for t in range(5) for l in range(5) for f in (False, True)]
        matches = [f for w, f in windows if np.array_equal(w[:, :, ::-1] if f else w, view)]
        assert matches, "a view is not a padded crop (+ flip) of its image"
        flips += matches[0]
    assert 16 < flips < 48  # about half are flipped
    tiny = augment_images(images[:, :, :8, :8], "crop-flip", rng)  # 8 px digits: 1 px of padding
    assert tiny.shape == (64, 3, 8, 8)


def test_joint_centralised_client_holds_every_seen_task(digits):

    joint = tiny_config(num_tasks=5, centralised=True, centralised_mode="joint")
    incremental = tiny_config(num_tasks=5, centralised=True)
    idx = client_indices(digits.train.labels, layout_of(joint, 10), partition_of(joint), 0, 2, 0)
    assert set(np.unique(digits.train.labels[idx]).tolist()) == set(range(6))  # tasks 0..2
    assert len(idx) == np.isin(digits.train.labels, range(6)).sum()
    assert list(layout_of(joint, 10).training_classes(2)) == list(range(6))
    assert list(layout_of(incremental, 10).training_classes(2)) == [4, 5]
    with pytest.raises(ConfigError, match="centralised-mode = joint"):
        tiny_config(centralised_mode="joint")  # the joint reference is centralised


def test_partitions_differ_by_seed_and_task(digits):
    cfg0 = tiny_config(num_tasks=5, num_clients=4, partition="dirichlet", min_partition_size=0)
    cfg1 = tiny_config(num_tasks=5, num_clients=4, partition="dirichlet", min_partition_size=0, seed=1)
    assert not np.array_equal(shares(digits, cfg0, 0)[0], shares(digits, cfg1, 0)[0])


def test_stateless_population_draws_afresh_each_round(digits):
    cfg = tiny_config(num_tasks=2, num_clients=1000, partition="stateless", category_ratio=0.6,
                      split_ratio=0.1, imbalance_ratio=0.1)
    a = client_indices(digits.train.labels, layout_of(cfg, 10), partition_of(cfg), 17, 0, 0)
    b = client_indices(digits.train.labels, layout_of(cfg, 10), partition_of(cfg), 17, 0, 0)
    c = client_indices(digits.train.labels, layout_of(cfg, 10), partition_of(cfg), 17, 0, 1)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    labels = digits.train.labels[a]
    classes = np.unique(labels)
    assert len(classes) == 3  # round(0.6 * 5)
    counts = np.sort(np.bincount(labels)[classes])[::-1]
    assert counts[-1] < counts[0]  # long tail: beta = 0.1
    per_class_pool = np.sum(digits.train.labels == classes[0])
    assert counts[0] <= round(0.1 * per_class_pool) + 1  # split ratio


def test_centralised_client_holds_the_whole_task(digits):
    cfg = tiny_config(num_tasks=5, centralised=True)
    idx = client_indices(digits.train.labels, layout_of(cfg, 10), partition_of(cfg), 0, 3, 0)
    assert len(idx) == np.isin(digits.train.labels, [6, 7]).sum()


def test_class_count_must_divide_into_tasks():
    with pytest.raises(ConfigError, match="not divisible"):
        load_dataset(tiny_config(num_tasks=4, pool_size=4))


def test_unknown_dataset_and_missing_directories_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_dataset(tiny_config(dataset="imagenet"))
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(tiny_config(dataset="fashion-mnist", data_dir=str(tmp_path / "nowhere")))
    with pytest.raises(DataError, match="missing"):
        load_dataset(tiny_config(dataset="fashion-mnist", data_dir=str(tmp_path)))
    with pytest.raises(DataError, match="does not exist"):
        load_dataset(tiny_config(dataset=f"folder:{tmp_path / 'nope'}"))


def _write_idx(path, array):
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reader_on_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 40), ("t10k", 20)):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)))
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    data = load_dataset(tiny_config(dataset="fashion-mnist", data_dir=str(tmp_path)))
    assert data.train.images.shape == (40, 1, 28, 28) and len(data.test) == 20
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    good = labels.read_bytes()
    labels.write_bytes(b"corrupt")  # the error names the file, what is wrong, and the fix
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte.gz: not a readable idx file .*re-install"):
        load_dataset(tiny_config(dataset="fashion-mnist", data_dir=str(tmp_path)))
    labels.write_bytes(good[: len(good) // 2])  # cut short, as an interrupted download leaves it
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte.gz: truncated gzip \(EOFError"):
        load_dataset(tiny_config(dataset="fashion-mnist", data_dir=str(tmp_path)))


def test_folder_source_reads_one_folder_per_class(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(4):
        (tmp_path / f"class{c}").mkdir()
        for i in range(8):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(tmp_path / f"class{c}" / f"{i}.png")
    data = load_dataset(tiny_config(dataset=f"folder:{tmp_path}", num_tasks=2))
    assert data.num_classes == 4 and len(data.train) + len(data.test) == 32
    assert data.train.images.shape[1:] == (3, 12, 12)
    (tmp_path / "class0" / "bad.png").write_bytes(b"not an image")
    with pytest.raises(DataError, match="cannot read image"):
        load_dataset(tiny_config(dataset=f"folder:{tmp_path}", num_tasks=2))


def test_hub_unreachable_is_a_clear_error():
    """In a fresh process: Hugging Face's libraries read the offline switches when imported, and
    in this one they may be imported already (then the hub is tried, and retried, for real)."""
    import subprocess
    import sys

    code = ("from common.data.sources import DataError, load_dataset\n"
            "from tests.conftest import tiny_config\n"
            "try:\n    load_dataset(tiny_config(dataset='hf:cifar100'))\n"
            "except DataError as exc:\n    print('DataError:', exc)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    assert "DataError: cannot load Hugging Face dataset" in proc.stdout, proc.stderr[-2000:]


def test_hf_source_is_read_through_the_datasets_library(tmp_path):
    """``hf:`` sources go through ``datasets.load_dataset`` and its columns, features and
    ``select`` (the code a CIFAR-100 run takes): here on a local image folder, which the library
    loads offline, in a fresh process whose Hugging Face caches are under tmp_path."""
    import json
    import subprocess
    import sys

    from PIL import Image

    rng = np.random.default_rng(0)
    for split, count in (("train", 4), ("test", 2)):
        for name in ("ant", "bee", "cow"):
            (tmp_path / "images" / split / name).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)).save(
                    tmp_path / "images" / split / name / f"{i}.png")
    code = ("import json, sys\nfrom promptfcl.common.data.sources import load_dataset\nfrom tests.conftest import tiny_config\n"
            "d = load_dataset(tiny_config(dataset='hf:' + sys.argv[1], num_tasks=1))\n"
            "print(json.dumps({'names': d.class_names, 'train': list(d.train.images.shape), 'test': len(d.test),\n"
            "  'labels': sorted(set(d.train.labels.tolist())), 'split': d.split}))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "images")], capture_output=True, text=True,
                          timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(got["names"]) == ["ant", "bee", "cow"] and got["labels"] == [0, 1, 2]
    assert got["train"] == [12, 3, 10, 10] and got["test"] == 6  # one square size: kept native
    assert "splits 'train' (train) and 'test' (test)" in got["split"]


def test_task_rows_locate_a_tasks_pool_slice_and_head_rows():

    pool, head, other = np.zeros((12, 4, 3)), np.zeros((10, 3)), np.zeros((5, 3))
    four, five = tiny_config(num_tasks=4, pool_size=12), tiny_config(num_tasks=5, pool_size=10)
    assert layout_of(four, 10).task_rows("prompt.p0", pool, 2) == slice(6, 9)
    assert layout_of(five, 10).task_rows("head.weight", head, 1).tolist() == [2, 3]
    assert layout_of(five, 10).task_rows("prompt.fusion", other, 1) is None  # not pool-sized
    assert layout_of(five, 10).task_rows("head.weight", np.zeros((7, 3)), 1) is None  # not class-sized
