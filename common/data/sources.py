"""Datasets: the sources promptfcl reads, decoded once into uint8 arrays in the seeded class order.

Images are kept as uint8 arrays (N, C, H, W); the model resizes and normalises per batch, so
one copy of the data serves any backbone. Labels are remapped once by the seeded class order
(``common/data/tasks.py``), so task ``t`` owns classes ``[t*k, (t+1)*k)``. Client shares are in
``common/data/partitions.py``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import logging
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..config import sections as sections
from ..config.experiment import ConfigError, ExperimentConfig
from ..errors import DataError  # re-exported: the error of datasets
from .images import (
    class_folder_files,
    decode_files,
    decode_rows,
    image_listing,
)
from .rows import RowFile
from .splits import check_matches, read_splits
from .tasks import TaskLayout, class_order

log = logging.getLogger("promptfcl")

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
# Known Hugging Face names for the papers' datasets (any hub name works with hf:<name>).
HF_ALIASES = {
    "cifar100": "uoft-cs/cifar100",
    "tiny-imagenet": "zh-plus/tiny-imagenet",
    "imagenet-r": "axiong/imagenet-r",
    "domainnet": "wltjr1007/DomainNet",
    "cub200": "bentrevett/caltech-ucsd-birds-200-2011",
}
IMAGE_COLUMNS = ("img", "image", "pixel_values", "png", "jpg")
LABEL_COLUMNS = ("fine_label", "label", "labels", "class", "target")


@dataclass
class ArraySplit:
    """One split of a dataset held in memory."""

    images: np.ndarray | RowFile  # uint8 (N, C, H, W); indexing either gives an ndarray of those rows
    labels: np.ndarray  # int64 (N,)

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass
class Dataset:
    """Train and test splits with labels already remapped to the seeded class order."""

    name: str
    train: ArraySplit
    test: ArraySplit
    num_classes: int
    class_names: list[str]  # indexed by remapped label
    fingerprint: str  # identifies the exact arrays (for caches keyed by data)
    split: str = ""  # where train and test came from (recorded in results.json)


@dataclass(frozen=True)
class DataSource:
    """Where a dataset comes from and how it is decoded: what the data layer reads of a run.

    Parameters
    ----------
    dataset : str
        ``digits``, ``fashion-mnist``, ``hf:<name>`` or ``folder:<path>``.
    data_dir, hf_revision : str
        The source's folder (Fashion-MNIST) and the hub revision (``hf:``); "" for the default.
    seed : int
        Seeds the held-out split, the per-class caps and the class order.
    test_fraction : float
        Held-out share of a source with one split.
    image_size : int
        Side of the decoded images.
    resize_interpolation : str
        How images are resized on decoding.
    max_train_per_class, max_test_per_class : int
        Per-class caps (0: none).
    splits : str
        A splits file whose class order and data seed replace the drawn ones ("": none).
    cache : bool
        Map decoded arrays from the machine's data cache (``data-cache``).
    """

    dataset: str
    data_dir: str
    hf_revision: str
    seed: int
    test_fraction: float
    image_size: int
    resize_interpolation: str
    max_train_per_class: int
    max_test_per_class: int
    splits: str
    cache: bool

    @classmethod
    def of(cls, run: sections.RunSection, data: sections.DataSection, model: sections.ModelSection,
           caching: sections.CachingSection) -> DataSource:
        """The source a run of these sections reads."""
        return cls(data.dataset, data.data_dir, data.hf_revision, run.seed, data.test_fraction, model.image_size,
                   model.resize_interpolation, data.max_train_per_class, data.max_test_per_class, data.splits,
                   caching.data_cache)

    def as_recorded(self) -> DataSource:
        """This source with the data seed of its splits file, if it names one (the source split and
        caps of the run that wrote it)."""
        if not self.splits:
            return self
        from .splits import read_splits  # splits imports this module

        return dataclasses.replace(self, seed=read_splits(self.splits).data_seed)

    def keys(self) -> dict[str, object]:
        """This source's run-config keys (kebab-case) and values, for caches keyed by them."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class Source:
    """What a source reader gives: both splits, the class names, and how they were split."""

    train: ArraySplit
    test: ArraySplit
    names: list[str]
    split: str


def seeded_rows(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows) of a stratified split of one split, the same for the same seed
    (CODA-P's protocol splits ImageNet-R this way, 80/20); chosen on the labels alone."""
    # scikit-learn is slow to import: only the sources that split or load with it
    from sklearn.model_selection import train_test_split

    tr, te = train_test_split(np.arange(len(labels)), test_size=test_fraction, stratify=labels, random_state=seed)
    return tr, te


def seeded_split(full: ArraySplit, test_fraction: float, seed: int) -> tuple[ArraySplit, ArraySplit]:
    """:func:`seeded_rows` applied to a split held in memory."""
    tr, te = seeded_rows(full.labels, test_fraction, seed)
    return ArraySplit(full.images[tr], full.labels[tr]), ArraySplit(full.images[te], full.labels[te])


def _split_note(what: str, test_fraction: float, seed: int) -> str:
    return f"{what} split by seed {seed}, stratified: {1 - test_fraction:.0%} train / {test_fraction:.0%} test"


# ---------------------------------------------------------------------------- sources
def _digits(source: DataSource) -> Source:
    # scikit-learn is slow to import: only the sources that split or load with it
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # (N,1,8,8)
    full = ArraySplit(images, bunch.target.astype(np.int64))
    train, test = seeded_split(full, source.test_fraction, source.seed)
    names = [str(i) for i in range(10)]
    return Source(train, test, names, _split_note("scikit-learn's digits (one set)", source.test_fraction, source.seed))


def _read_idx(path: Path, fix: str) -> np.ndarray:
    """Read an idx file (optionally gzipped) as used by MNIST and Fashion-MNIST; ``fix`` says
    what to do when it is broken."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read()
        zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
        if zero != 0 or dtype_code != 0x08:
            raise ValueError("not an unsigned-byte idx file")
        shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
        expected = int(np.prod(shape)) + 4 + 4 * ndim
        if len(raw) != expected:
            raise ValueError(f"{len(raw)} bytes where its header promises {expected}")
        data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
        return data.reshape(shape)
    except EOFError as exc:
        raise DataError(f"{path}: truncated gzip ({type(exc).__name__}: {exc}); {fix}") from exc
    except (OSError, ValueError, struct.error) as exc:
        raise DataError(f"{path}: not a readable idx file ({type(exc).__name__}: {exc}); {fix}") from exc


def _fashion_mnist(source: DataSource) -> Source:
    root = Path(source.data_dir or FASHION_MNIST_DIR)
    if not root.is_dir():
        raise DataError(
            f"Fashion-MNIST directory {root} does not exist. Install it with "
            "`apt-get install -y dataset-fashion-mnist` or set data-dir to a folder holding "
            "{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]."
        )

    def find(stem: str) -> Path:
        for suffix in (".gz", ""):
            p = root / f"{stem}{suffix}"
            if p.is_file():
                return p
        raise DataError(f"Fashion-MNIST file {stem}[.gz] missing in {root}")

    fix = ("re-install the Debian package dataset-fashion-mnist (apt-get install --reinstall "
           "dataset-fashion-mnist) or point data-dir at a good copy")
    splits = []
    for prefix in ("train", "t10k"):
        x = _read_idx(find(f"{prefix}-images-idx3-ubyte"), fix)
        y = _read_idx(find(f"{prefix}-labels-idx1-ubyte"), fix).astype(np.int64)
        if x.ndim != 3 or len(x) != len(y):
            raise DataError(f"Fashion-MNIST {prefix}: {len(x)} images but {len(y)} labels")
        splits.append(ArraySplit(x[:, None].copy(), y))
    names = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
    return Source(splits[0], splits[1], names, f"the source's train (60,000) and t10k (10,000) files in {root}")


#: split names read as the test split, in order of preference
HF_TEST_SPLITS = ("test", "validation", "valid", "val")


def hf_splits(split_names: list[str], hub_name: str) -> tuple[str, str | None]:
    """(train split, test split or None = split the train split by seed).

    A dataset with only one split (whatever its name) is that one split, never train and
    test at once; several splits without a ``train`` are ambiguous and refused.
    """
    if len(split_names) == 1:
        return split_names[0], None
    if "train" not in split_names:
        raise DataError(f"{hub_name}: splits {split_names} have no 'train'; which one to train on is "
                        "ambiguous (use a dataset with a train split, or a folder: source)")
    return "train", next((s for s in HF_TEST_SPLITS if s in split_names), None)


def _huggingface(name: str, source: DataSource) -> Source:
    try:
        # the datasets library is slow to import: only a hub source needs it
        import datasets as hf
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise DataError("the `datasets` package is required for hf: sources") from exc
    hub_name = HF_ALIASES.get(name, name)
    revision = source.hf_revision or None
    try:
        dd = hf.load_dataset(hub_name, revision=revision)
    except Exception as exc:  # the hub raises many types (ConnectionError, OfflineModeIsEnabled, ...)
        raise DataError(
            f"cannot load Hugging Face dataset {hub_name!r} at revision {revision or 'main'} "
            f"({type(exc).__name__}: {exc}). The hub must be reachable (or the dataset in the local HF cache)."
        ) from exc
    train_name, test_name = hf_splits(list(dd.keys()), hub_name)
    first = dd[train_name]
    img_col = next((c for c in IMAGE_COLUMNS if c in first.column_names), None)
    lab_col = next((c for c in LABEL_COLUMNS if c in first.column_names), None)
    if img_col is None or lab_col is None:
        raise DataError(f"{hub_name}: cannot find image/label columns in {first.column_names}")
    feature = first.features[lab_col]
    names = list(getattr(feature, "names", []) or [])

    def convert(split: Any, rows: np.ndarray | None = None) -> ArraySplit:  # a datasets.Dataset
        """The split's ``rows`` (all: None), labels read first, images decoded a chunk at a time."""
        labels = np.asarray(split[lab_col], dtype=np.int64)
        chosen = split if rows is None else split.select(rows)
        images = decode_rows(len(chosen), lambda a, b: chosen[a:b][img_col], source.image_size,
                             source.resize_interpolation)
        return ArraySplit(images, labels if rows is None else labels[rows])

    where = f"Hugging Face {hub_name} at revision {revision or 'main (unpinned)'}"
    if test_name is None:  # the rows of each part chosen on the labels, before any image is decoded
        tr, te = seeded_rows(np.asarray(first[lab_col], dtype=np.int64), source.test_fraction, source.seed)
        train, test = convert(first, tr), convert(first, te)
        split = _split_note(f"{where}, its only split {train_name!r},", source.test_fraction, source.seed)
    else:
        train, test = convert(first), convert(dd[test_name])
        split = f"{where}, splits {train_name!r} (train) and {test_name!r} (test)"
    if not names:
        names = [str(i) for i in range(int(max(train.labels.max(), test.labels.max())) + 1)]
    return Source(train, test, names, split)


def _folder(path: str, source: DataSource) -> Source:
    """``root/<class>/*.png`` (split by test-fraction) or ``root/{train,test}/<class>/*``."""

    root = Path(path).expanduser()
    if not root.is_dir():
        raise DataError(f"folder dataset {root} does not exist")
    has_splits = (root / "train").is_dir() and (root / "test").is_dir()
    base = root / "train" if has_splits else root
    names = sorted(p.name for p in base.iterdir() if p.is_dir())
    if len(names) < 2:
        raise DataError(f"folder dataset {base} needs one sub-folder per class (found {len(names)})")
    def listed(split_root: Path) -> tuple[list[Path], np.ndarray]:
        files, labels = class_folder_files(split_root, names, skip_missing=False)
        if not files:
            raise DataError(f"no images under {split_root}")
        return files, labels

    def decoded(files: list[Path], labels: np.ndarray) -> ArraySplit:
        return ArraySplit(decode_files(files, source.image_size, source.resize_interpolation), labels)

    if has_splits:
        return Source(decoded(*listed(root / "train")), decoded(*listed(root / "test")), names,
                      f"the folders {root}/train and {root}/test")
    files, labels = listed(root)  # the rows of each part chosen on the labels, before any image is decoded
    tr, te = seeded_rows(labels, source.test_fraction, source.seed)
    train, test = decoded([files[i] for i in tr], labels[tr]), decoded([files[i] for i in te], labels[te])
    return Source(train, test, names, _split_note(f"the folder {root}", source.test_fraction, source.seed))


def read_class_folders(split_root: Path, names: list[str], image_size: int, skip_missing: bool,
                       interpolation: str = "bilinear") -> ArraySplit:
    """Images of ``split_root/<class>/*`` labelled by position in ``names`` (a node's own folders:
    :func:`promptfcl.common.data.images.class_folder_files`); no images gives an empty split."""
    files, labels = class_folder_files(split_root, names, skip_missing)
    return ArraySplit(decode_files(files, image_size, interpolation), labels)


def source_identity(source: DataSource) -> object:
    """What, besides the run's dataset keys, defines the decoded arrays: the source's files
    (names, sizes, times), the hub name and revision, the splits file."""
    name = source.dataset
    if name == "digits":
        # scikit-learn is slow to import: only the digits source needs it
        import sklearn

        ident: object = ["scikit-learn digits", sklearn.__version__]
    elif name == "fashion-mnist":
        root = Path(source.data_dir or FASHION_MNIST_DIR)
        ident = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.glob("*ubyte*")) \
            if root.is_dir() else str(root)
    elif name.startswith("hf:"):
        ident = [HF_ALIASES.get(name[3:], name[3:]), source.hf_revision or "main"]
    else:
        root = Path(name[len("folder:"):]).expanduser()
        ident = [str(root.resolve()), image_listing(root) if root.is_dir() else None]
    if source.splits:
        st = Path(source.splits).expanduser().stat() if Path(source.splits).expanduser().is_file() else None
        ident = [ident, source.splits, st and (st.st_size, st.st_mtime_ns)]
    return ident


def _cap_per_class(split: ArraySplit, cap: int, seed: int) -> ArraySplit:
    if cap <= 0:
        return split
    rng = np.random.default_rng(seed)
    keep = []
    for c in np.unique(split.labels):
        idx = np.flatnonzero(split.labels == c)
        keep.append(idx if len(idx) <= cap else np.sort(rng.choice(idx, cap, replace=False)))
    sel = np.sort(np.concatenate(keep))
    return ArraySplit(split.images[sel], split.labels[sel])


def check_source(dataset: str) -> None:
    """Cheap checks of the dataset name, without loading anything."""
    name = dataset
    if name in ("digits", "fashion-mnist") or name.startswith(("hf:", "folder:")):
        return
    raise ConfigError(
        f"unknown dataset {name!r}: use digits, fashion-mnist, hf:<name> "
        f"(aliases: {', '.join(HF_ALIASES)}) or folder:<path>"
    )


def load_dataset(cfg: ExperimentConfig) -> Dataset:
    """Run ``cfg``'s dataset (:func:`read_source`), its task stream checked."""
    check_source(cfg.data.dataset)
    source = DataSource.of(cfg.run, cfg.data, cfg.model, cfg.caching).as_recorded()
    data = read_source(source)
    # the stream checked with the seed the arrays were decoded with (a splits file's data seed)
    layout = TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, data.num_classes)
    check_task_stream(dataclasses.replace(layout, seed=source.seed), data)
    return data


def read_source(source: DataSource) -> Dataset:
    """Load a source and remap its labels to the seeded class order (no task stream checked)."""
    check_source(source.dataset)
    recorded = source.as_recorded()
    name = recorded.dataset
    if name == "digits":
        src = _digits(recorded)
    elif name == "fashion-mnist":
        src = _fashion_mnist(recorded)
    elif name.startswith("hf:"):
        src = _huggingface(name[3:], recorded)
    else:
        src = _folder(name[len("folder:"):], recorded)
    train, test, names = src.train, src.test, src.names
    check_distinct_splits(name, train, test)

    num_classes = int(max(train.labels.max(), test.labels.max())) + 1
    return ordered_dataset(recorded, name, train, test, num_classes, names, src.split)


def check_task_stream(layout: TaskLayout, data: Dataset) -> None:
    """The run's task stream (``layout``, of ``data``'s classes) fits the dataset's classes (run on
    every load, cached or not)."""
    name, num_classes = data.name, data.num_classes
    counts = np.bincount(data.train.labels, minlength=num_classes)
    if layout.random:
        layout.random_tasks()  # raises ConfigError when the tasks cannot be drawn
        if int(layout.task_data_fraction * int(counts.min())) == 0:
            raise ConfigError(f"{name}: a class has {int(counts.min())} training images, of which task-data-fraction "
                              f"= {layout.task_data_fraction} is none; raise task-data-fraction")
    elif num_classes % layout.num_tasks != 0:
        raise ConfigError(
            f"{name} has {num_classes} classes, not divisible into num-tasks = {layout.num_tasks} equal tasks"
        )
    missing = np.flatnonzero(counts == 0)
    if len(missing):
        raise DataError(f"{name}: classes {data.class_names and [data.class_names[c] for c in missing[:10]]} "
                        "have no training images")


def check_distinct_splits(name: str, train: ArraySplit, test: ArraySplit) -> None:
    """Refuse a source whose train and test resolve to the same data: every accuracy would be
    measured on training images."""
    if train.images.shape == test.images.shape and np.array_equal(train.labels, test.labels) \
            and np.array_equal(train.images, test.images):
        raise DataError(f"{name}: the train and test splits are the same {len(train)} images; "
                        "a test split must hold images not trained on")


def ordered_dataset(source: DataSource, name: str, train: ArraySplit, test: ArraySplit, num_classes: int,
                    names: list[str], split: str) -> Dataset:
    """Cap per class, remap labels to the seeded class order, and fingerprint the arrays.

    Shared by every source and by nodes' own folders (client/node_data.py), so all of them
    give the same class order and caches keyed by the same fingerprint.
    """
    train = _cap_per_class(train, source.max_train_per_class, source.seed)
    test = _cap_per_class(test, source.max_test_per_class, source.seed)
    order = class_order(num_classes, source.seed)
    if source.splits:  # another run's class order (common/data/splits.py)

        recorded = read_splits(source.splits)
        if len(recorded.class_order) != num_classes:
            raise DataError(f"splits file {source.splits} orders {len(recorded.class_order)} classes; "
                            f"{name} has {num_classes}")
        order = recorded.class_order
    remap = np.empty(num_classes, dtype=np.int64)
    remap[order] = np.arange(num_classes)
    train = ArraySplit(train.images, remap[train.labels])
    test = ArraySplit(test.images, remap[test.labels])
    if source.splits:
        check_matches(recorded, train.labels)
    ordered_names = [names[c] if c < len(names) else str(c) for c in order]
    digest = hashlib.sha1()
    for arr in (train.images, train.labels, test.images, test.labels):
        digest.update(np.ascontiguousarray(arr).data)
    return Dataset(name, train, test, num_classes, ordered_names, digest.hexdigest()[:16], split)
