"""Datasets, the class-incremental task stream, and client partitions.

Images are kept as uint8 arrays (N, C, H, W); the model resizes and normalises
per batch, so one copy of the data serves any backbone. Labels are remapped once
by the seeded class order, so task ``t`` owns classes ``[t*k, (t+1)*k)``.

Every client's share is a pure function of (seed, client id, task, round): the
server never stores per-client data state, and a ClientApp started fresh in any
process recomputes exactly the same indices.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from promptfcl.common.config import ConfigError, ExperimentConfig
from promptfcl.common.errors import DataError  # re-exported: the error of datasets
from promptfcl.common.files import class_folder

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

    images: np.ndarray  # uint8 (N, C, H, W)
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


# ---------------------------------------------------------------------------- sources
def _digits(cfg: ExperimentConfig) -> tuple[ArraySplit, ArraySplit, list[str]]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[:, None]  # (N,1,8,8)
    labels = bunch.target.astype(np.int64)
    tr, te = train_test_split(
        np.arange(len(labels)), test_size=cfg.test_fraction, stratify=labels, random_state=cfg.seed
    )
    names = [str(i) for i in range(10)]
    return ArraySplit(images[tr], labels[tr]), ArraySplit(images[te], labels[te]), names


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


def _fashion_mnist(cfg: ExperimentConfig) -> tuple[ArraySplit, ArraySplit, list[str]]:
    root = Path(cfg.data_dir or FASHION_MNIST_DIR)
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
    return splits[0], splits[1], names


def _to_uint8_chw(img: object, size: int | None) -> np.ndarray:
    from PIL import Image

    if not isinstance(img, Image.Image):
        img = Image.fromarray(np.asarray(img))
    if img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    if size is not None and img.size != (size, size):
        img = img.resize((size, size), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.uint8)
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def _stack_images(images: list[object], image_size: int) -> np.ndarray:
    """Keep native size when all images share it (resizing happens per batch); else resize."""
    from PIL import Image

    sizes = {im.size if isinstance(im, Image.Image) else np.asarray(im).shape[:2] for im in images[:256]}
    size = None if len(sizes) == 1 else image_size
    arrays = [_to_uint8_chw(im, size) for im in images]
    channels = max(a.shape[0] for a in arrays)
    if channels == 3:
        arrays = [np.repeat(a, 3, axis=0) if a.shape[0] == 1 else a for a in arrays]
    try:
        return np.stack(arrays)
    except ValueError:  # sizes differed beyond the first 256
        return np.stack([_to_uint8_chw(im, image_size) for im in images])


def _huggingface(name: str, cfg: ExperimentConfig) -> tuple[ArraySplit, ArraySplit, list[str]]:
    try:
        import datasets as hf
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise DataError("the `datasets` package is required for hf: sources") from exc
    hub_name = HF_ALIASES.get(name, name)
    try:
        dd = hf.load_dataset(hub_name)
    except Exception as exc:  # the hub raises many types (ConnectionError, OfflineModeIsEnabled, ...)
        raise DataError(
            f"cannot load Hugging Face dataset {hub_name!r} ({type(exc).__name__}: {exc}). "
            "The hub must be reachable (or the dataset in the local HF cache)."
        ) from exc
    split_names = list(dd.keys())
    train_name = "train" if "train" in dd else split_names[0]
    test_name = next((s for s in ("test", "validation", "valid", "val") if s in dd), None)
    first = dd[train_name]
    img_col = next((c for c in IMAGE_COLUMNS if c in first.column_names), None)
    lab_col = next((c for c in LABEL_COLUMNS if c in first.column_names), None)
    if img_col is None or lab_col is None:
        raise DataError(f"{hub_name}: cannot find image/label columns in {first.column_names}")
    feature = first.features[lab_col]
    names = list(getattr(feature, "names", []) or [])

    def convert(split: object) -> ArraySplit:
        return ArraySplit(
            _stack_images(list(split[img_col]), cfg.image_size),  # type: ignore[index]
            np.asarray(split[lab_col], dtype=np.int64),  # type: ignore[index]
        )

    if test_name is None:
        parts = first.train_test_split(test_size=cfg.test_fraction, seed=cfg.seed, stratify_by_column=lab_col)
        train, test = convert(parts["train"]), convert(parts["test"])
    else:
        train, test = convert(first), convert(dd[test_name])
    if not names:
        names = [str(i) for i in range(int(max(train.labels.max(), test.labels.max())) + 1)]
    return train, test, names


def _folder(path: str, cfg: ExperimentConfig) -> tuple[ArraySplit, ArraySplit, list[str]]:
    """``root/<class>/*.png`` (split by test-fraction) or ``root/{train,test}/<class>/*``."""

    root = Path(path).expanduser()
    if not root.is_dir():
        raise DataError(f"folder dataset {root} does not exist")
    has_splits = (root / "train").is_dir() and (root / "test").is_dir()
    base = root / "train" if has_splits else root
    names = sorted(p.name for p in base.iterdir() if p.is_dir())
    if len(names) < 2:
        raise DataError(f"folder dataset {base} needs one sub-folder per class (found {len(names)})")
    def read(split_root: Path) -> ArraySplit:
        split = read_class_folders(split_root, names, cfg.image_size, skip_missing=False)
        if not len(split):
            raise DataError(f"no images under {split_root}")
        return split

    if has_splits:
        return read(root / "train"), read(root / "test"), names
    full = read(root)
    from sklearn.model_selection import train_test_split

    tr, te = train_test_split(
        np.arange(len(full)), test_size=cfg.test_fraction, stratify=full.labels, random_state=cfg.seed
    )
    return ArraySplit(full.images[tr], full.labels[tr]), ArraySplit(full.images[te], full.labels[te]), names


IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


def read_class_folders(split_root: Path, names: list[str], image_size: int, skip_missing: bool) -> ArraySplit:
    """Images of ``split_root/<class>/*`` labelled by position in ``names``.

    A missing class folder is an error unless ``skip_missing`` (a node may hold only some
    classes); an unreadable image is always an error. No images gives an empty split.
    ``names`` may come from the server (``class-names``): each must be one folder directly
    inside ``split_root`` (:func:`class_folder`), or nothing is read.
    """
    from PIL import Image, UnidentifiedImageError

    images, labels = [], []
    folders = [class_folder(split_root, cls) for cls in names]  # every name checked before any read
    for label, cls_dir in enumerate(folders):
        if not cls_dir.is_dir():
            if skip_missing:
                continue
            raise DataError(f"class folder {cls_dir} missing")
        for f in sorted(cls_dir.iterdir()):
            if f.suffix.lower() not in IMAGE_EXTENSIONS:
                continue
            try:
                with Image.open(f) as im:
                    images.append(im.copy())
            except (OSError, UnidentifiedImageError) as exc:
                raise DataError(f"cannot read image {f}: {exc}") from exc
            labels.append(label)
    if not images:
        return ArraySplit(np.zeros((0, 1, image_size, image_size), np.uint8), np.zeros(0, np.int64))
    return ArraySplit(_stack_images(images, image_size), np.asarray(labels, dtype=np.int64))


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


def check_source(cfg: ExperimentConfig) -> None:
    """Cheap checks of the dataset name, without loading anything."""
    name = cfg.dataset
    if name in ("digits", "fashion-mnist") or name.startswith(("hf:", "folder:")):
        return
    raise ConfigError(
        f"unknown dataset {name!r}: use digits, fashion-mnist, hf:<name> "
        f"(aliases: {', '.join(HF_ALIASES)}) or folder:<path>"
    )


def load_dataset(cfg: ExperimentConfig) -> Dataset:
    """Load a source, remap labels to the seeded class order, and check the task split."""
    check_source(cfg)
    name = cfg.dataset
    if name == "digits":
        train, test, names = _digits(cfg)
    elif name == "fashion-mnist":
        train, test, names = _fashion_mnist(cfg)
    elif name.startswith("hf:"):
        train, test, names = _huggingface(name[3:], cfg)
    else:
        train, test, names = _folder(name[len("folder:"):], cfg)

    num_classes = int(max(train.labels.max(), test.labels.max())) + 1
    if cfg.task_generator == "random":
        random_tasks(cfg, num_classes)  # raises ConfigError when the tasks cannot be drawn
        smallest = int(np.bincount(train.labels, minlength=num_classes).min())
        if int(cfg.task_data_fraction * smallest) == 0:
            raise ConfigError(f"{name}: a class has {smallest} training images, of which task-data-fraction = "
                              f"{cfg.task_data_fraction} is none; raise task-data-fraction")
    elif num_classes % cfg.num_tasks != 0:
        raise ConfigError(
            f"{name} has {num_classes} classes, not divisible into num-tasks = {cfg.num_tasks} equal tasks"
        )
    missing = set(range(num_classes)) - set(np.unique(train.labels).tolist())
    if missing:
        raise DataError(f"{name}: classes {sorted(missing)[:10]} have no training images")
    return ordered_dataset(cfg, name, train, test, num_classes, names)


def ordered_dataset(cfg: ExperimentConfig, name: str, train: ArraySplit, test: ArraySplit, num_classes: int,
                    names: list[str]) -> Dataset:
    """Cap per class, remap labels to the seeded class order, and fingerprint the arrays.

    Shared by every source and by nodes' own folders (client/node_data.py), so all of them
    give the same class order and caches keyed by the same fingerprint.
    """
    train = _cap_per_class(train, cfg.max_train_per_class, cfg.seed)
    test = _cap_per_class(test, cfg.max_test_per_class, cfg.seed)
    order = class_order(num_classes, cfg.seed)
    remap = np.empty(num_classes, dtype=np.int64)
    remap[order] = np.arange(num_classes)
    train = ArraySplit(train.images, remap[train.labels])
    test = ArraySplit(test.images, remap[test.labels])
    ordered_names = [names[c] if c < len(names) else str(c) for c in order]
    digest = hashlib.sha1()
    for arr in (train.images, train.labels, test.images, test.labels):
        digest.update(np.ascontiguousarray(arr).data)
    return Dataset(name, train, test, num_classes, ordered_names, digest.hexdigest()[:16])


DATA_KEYS = ("dataset", "data-dir", "seed", "num-tasks", "test-fraction", "image-size",
             "max-train-per-class", "max-test-per-class")
_loaded: dict[str, Dataset] = {}


def load_dataset_cached(cfg: ExperimentConfig) -> Dataset:
    """Per-process cache keyed by the data-defining keys: a ClientApp in a long-lived
    Ray actor loads its data once, whatever the other settings of the run."""
    import json

    full = cfg.to_dict()
    key = json.dumps({k: full[k] for k in DATA_KEYS}, sort_keys=True)
    if key not in _loaded:
        _loaded.clear()  # one dataset per process is enough; keeps memory bounded
        _loaded[key] = load_dataset(cfg)
    return _loaded[key]


# ---------------------------------------------------------------------------- task stream
def class_order(num_classes: int, seed: int) -> np.ndarray:
    """Seeded permutation of the original class ids; position = remapped label."""
    return np.random.default_rng([seed, 0xC1A55]).permutation(num_classes)


def task_classes(cfg: ExperimentConfig, task: int, num_classes: int) -> np.ndarray:
    """The classes of ``task`` (remapped labels, ascending)."""
    if not 0 <= task < cfg.num_tasks:
        raise ValueError(f"task {task} out of range [0, {cfg.num_tasks})")
    if cfg.task_generator == "random":
        return random_tasks(cfg, num_classes)[task].copy()  # the cached tasks stay read-only
    k = num_classes // cfg.num_tasks
    return np.arange(task * k, (task + 1) * k)


def seen_classes(cfg: ExperimentConfig, task: int, num_classes: int) -> np.ndarray:
    """The union of the classes of tasks 0..``task``."""
    if cfg.task_generator == "random":
        return np.unique(np.concatenate(random_tasks(cfg, num_classes)[: task + 1]))
    return np.arange((task + 1) * (num_classes // cfg.num_tasks))


def head_size(cfg: ExperimentConfig, num_classes: int) -> int:
    """Outputs of the linear head: one per class, or (a per-task head, random tasks) a block of
    ``classes-per-task`` per task."""
    return cfg.num_tasks * cfg.classes_per_task if cfg.per_task_head else num_classes


def head_rows(cfg: ExperimentConfig, task: int, num_classes: int) -> np.ndarray:
    """The head rows scoring ``task``'s classes, in ``task_classes`` order: the classes' own rows
    (shared with every other task holding them), or ``task``'s own block (a per-task head)."""
    if cfg.per_task_head:
        return np.arange(task * cfg.classes_per_task, (task + 1) * cfg.classes_per_task)
    return task_classes(cfg, task, num_classes)


def head_targets(cfg: ExperimentConfig, task: int, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Labels of ``task``'s classes as the head rows that score them (their logit's index)."""
    if not cfg.per_task_head:
        return np.asarray(labels)
    classes = task_classes(cfg, task, num_classes)
    pos = np.searchsorted(classes, labels)
    if not np.array_equal(classes[np.minimum(pos, len(classes) - 1)], labels):
        raise ValueError(f"labels outside task {task}'s classes {classes.tolist()}")
    return head_rows(cfg, task, num_classes)[pos]


def training_classes(cfg: ExperimentConfig, task: int, num_classes: int) -> np.ndarray:
    """The classes a client learns while on ``task``: its data's classes and the CE's.

    The task's own classes, except for the joint upper bound (``centralised = true``,
    ``centralised-mode = "joint"``), which at task t trains on every class seen so far.
    """
    if cfg.centralised and cfg.centralised_mode == "joint":
        return seen_classes(cfg, task, num_classes)
    return task_classes(cfg, task, num_classes)


def task_rows(cfg: ExperimentConfig, name: str, value: np.ndarray, task: int,
              num_classes: int) -> slice | np.ndarray | None:
    """The rows of trainable array ``name`` that belong to ``task`` (None: not task-structured).

    A prompt array's first dimension is the pool, split evenly over the tasks (task t owns
    slice t); a head array's is the head's rows (``head_rows``: task t's classes, which with
    random tasks two tasks may share, or task t's own block). Methods that average, send or
    reply per task (Fed-CPrompt, Powder) locate a task's part with this.
    """
    if name.startswith("prompt.") and value.ndim >= 1 and value.shape[0] == cfg.pool_size:
        per_task = cfg.pool_size // cfg.num_tasks
        return slice(task * per_task, (task + 1) * per_task)
    if name.startswith("head.") and value.ndim >= 1 and value.shape[0] == head_size(cfg, num_classes):
        return head_rows(cfg, task, num_classes)
    return None


def random_tasks(cfg: ExperimentConfig, num_classes: int) -> tuple[np.ndarray, ...]:
    """Powder's tasks (Powder, section 5.1): ``num-tasks`` sets of ``classes-per-task`` classes.

    Task 0 draws its classes uniformly; every later task takes ``ceil(min-overlap * n)`` of
    its classes from those of earlier tasks (the paper's "least overlap tau"), the least
    reused ones first (ties broken at random) so that classes recur evenly, and draws the
    rest uniformly from the classes it has not taken yet. A pure function of the seed. With
    ``task-data-sharing = disjoint``, raises ConfigError when a class would be in more
    tasks than its images can give disjoint ``task-data-fraction`` shares to.
    """
    fraction = cfg.task_data_fraction if cfg.task_data_sharing == "disjoint" else 0.0
    return _random_tasks(cfg.num_tasks, num_classes, cfg.classes_per_task, cfg.min_overlap, fraction, cfg.seed)


@functools.lru_cache(maxsize=8)
def _random_tasks(num_tasks: int, num_classes: int, n: int, min_overlap: float, fraction: float,
                  seed: int) -> tuple[np.ndarray, ...]:
    """See ``random_tasks``; ``fraction`` 0 skips the disjoint-shares check."""
    if n > num_classes:
        raise ConfigError(f"classes-per-task ({n}) exceeds the dataset's {num_classes} classes")
    rng = np.random.default_rng([seed, 0x7A5C5])
    tasks: list[np.ndarray] = []
    holders = np.zeros(num_classes, dtype=np.int64)  # tasks holding each class so far
    for _ in range(num_tasks):
        old = np.flatnonzero(holders)
        take = min(int(np.ceil(min_overlap * n - 1e-9)), len(old)) if len(tasks) else 0
        chosen = old[np.lexsort((rng.random(len(old)), holders[old]))[:take]]  # least reused first
        rest = np.setdiff1d(np.arange(num_classes), chosen)
        chosen = np.concatenate([chosen, rng.choice(rest, n - take, replace=False)]).astype(np.int64)
        tasks.append(np.sort(chosen))
        tasks[-1].flags.writeable = False  # cached and handed out: nobody may change them
        holders[chosen] += 1
    if holders.max() * fraction > 1.0 + 1e-9:
        raise ConfigError(
            f"with this seed a class is in {holders.max()} of the {num_tasks} random tasks, but "
            f"{holders.max()} disjoint shares of task-data-fraction = {fraction} exceed its images; "
            f"lower task-data-fraction to <= {1.0 / holders.max():.3f} or min-overlap, or set "
            f"task-data-sharing = independent")
    return tuple(tasks)


def random_task_indices(labels: np.ndarray, cfg: ExperimentConfig, num_classes: int, task: int) -> np.ndarray:
    """Training indices of a random task: for each of its classes, the task's share.

    ``disjoint``: a class's images are shuffled once (seeded) and the tasks holding the
    class take consecutive shares of ``task-data-fraction`` of them in task order.
    ``independent``: every task draws its own share (two tasks' shares may overlap).
    """
    tasks = random_tasks(cfg, num_classes)
    out = []
    for y in tasks[task]:
        holders = [g for g in range(len(tasks)) if y in tasks[g]]
        j = holders.index(task)
        key = [cfg.seed, int(y), 0xDA7A] + ([] if cfg.task_data_sharing == "disjoint" else [task])
        idx = np.random.default_rng(key).permutation(np.flatnonzero(labels == y))
        share = int(cfg.task_data_fraction * len(idx))
        if share == 0:
            raise ConfigError(f"class {y} has {len(idx)} training images: a task-data-fraction of "
                              f"{cfg.task_data_fraction} of them is empty")
        start = j * share if cfg.task_data_sharing == "disjoint" else 0
        out.append(idx[start : start + share])
    return np.sort(np.concatenate(out))


# ---------------------------------------------------------------------------- partitions
def client_indices(
    labels: np.ndarray, cfg: ExperimentConfig, num_classes: int, client_id: int, task: int, round_: int
) -> np.ndarray:
    """Training indices of ``client_id`` for ``task`` (and, for stateless populations, ``round_``).

    A pure function of its arguments: the same inputs give the same indices in any process.
    """
    if not 0 <= client_id < max(cfg.num_clients, 1):
        raise ValueError(f"client id {client_id} outside the population of {cfg.num_clients}")
    if cfg.task_generator == "random":  # the task's client holds all of its data
        from promptfcl.common.schedule import task_schedule

        owner = task_schedule(cfg).owner(task)
        if client_id != owner:
            raise ValueError(f"random task {task} belongs to client {owner}, not {client_id}")
        return random_task_indices(labels, cfg, num_classes, task)
    classes = task_classes(cfg, task, num_classes)
    if cfg.centralised:  # the one client holds the task (joint upper bound: every seen task)
        return np.flatnonzero(np.isin(labels, training_classes(cfg, task, num_classes)))
    pool = np.flatnonzero(np.isin(labels, classes))
    if cfg.partition == "stateless":
        return _stateless_indices(labels, pool, classes, cfg, client_id, task, round_)
    parts = _static_partition(
        labels[pool].tobytes(), cfg.partition, cfg.num_clients, cfg.seed, task,
        cfg.dirichlet_beta, cfg.classes_per_client, cfg.min_partition_size,
    )
    return pool[parts[client_id]]


@functools.lru_cache(maxsize=16)
def _static_partition(
    task_labels_bytes: bytes, scheme: str, num_clients: int, seed: int, task: int,
    beta: float, classes_per_client: int, min_size: int,
) -> list[np.ndarray]:
    """Split one task's samples across the whole population, once per (seed, task).

    Uses flwr-datasets partitioners (quantity skew: see ``_quantity_skew``); returns
    positions into the task's sample pool.
    Cost is O(samples + clients) once per process, never per round.
    """
    import datasets as hf
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, PathologicalPartitioner

    task_labels = np.frombuffer(task_labels_bytes, dtype=np.int64)
    pos = np.arange(len(task_labels))
    part_seed = int(np.random.default_rng([seed, task, 0x9A27]).integers(2**31 - 1))
    if scheme == "iid":
        # IidPartitioner shards a shuffled dataset; shuffle by seed first.
        shuffled = np.random.default_rng(part_seed).permutation(pos)
        ds = hf.Dataset.from_dict({"label": task_labels[shuffled], "pos": shuffled})
        partitioner = IidPartitioner(num_partitions=num_clients)
    elif scheme == "dirichlet":
        ds = hf.Dataset.from_dict({"label": task_labels, "pos": pos})
        partitioner = DirichletPartitioner(
            num_partitions=num_clients, partition_by="label", alpha=beta,
            min_partition_size=min_size, self_balancing=False, shuffle=True, seed=part_seed,
        )
    elif scheme == "quantity-skew":
        return _quantity_skew(len(task_labels), num_clients, beta, min_size, part_seed, task)
    elif scheme == "quantity":
        n_classes = len(np.unique(task_labels))
        if classes_per_client > n_classes:
            raise ConfigError(f"classes-per-client = {classes_per_client} exceeds the {n_classes} classes of a task")
        ds = hf.Dataset.from_dict({"label": task_labels, "pos": pos})
        partitioner = PathologicalPartitioner(
            num_partitions=num_clients, partition_by="label",
            num_classes_per_partition=classes_per_client, class_assignment_mode="random",
            shuffle=True, seed=part_seed,
        )
    else:  # pragma: no cover - validated in config
        raise ConfigError(f"unknown partition {scheme!r}")
    partitioner.dataset = ds
    try:
        return [np.asarray(partitioner.load_partition(i)["pos"], dtype=np.int64) for i in range(num_clients)]
    except ValueError as exc:
        raise ConfigError(f"cannot partition task {task} with {scheme} over {num_clients} clients: {exc}") from exc


#: Dirichlet redraws allowed before a min-partition-size is declared out of reach
MAX_SIZE_DRAWS = 10_000


def _quantity_skew(n: int, num_clients: int, beta: float, min_size: int, seed: int, task: int) -> list[np.ndarray]:
    """Quantity skew as in NIID-Bench ("Federated Learning on Non-IID Data Silos: An
    Experimental Study", Li et al. 2022), the setting Fed-CPrompt's Table 2 follows.

    Client dataset sizes follow proportions drawn from Dir(beta) over the clients; the
    samples are shuffled and cut at those proportions, so labels are IID: each client's
    label histogram is a random sample of the task's. As in NIID-Bench, the proportions are
    drawn again until every client gets at least ``min_size`` samples (NIID-Bench uses 10).

    flwr-datasets' SizePartitioner cuts consecutive sizes in the same way but refuses empty
    partitions, which Dir(beta) gives at small beta; the cut is done here instead.

    Returns positions into the task's sample pool, one array per client (a pure function
    of its arguments).
    """
    if min_size * num_clients > n:
        raise ConfigError(f"cannot partition task {task} with quantity-skew: {num_clients} clients x "
                          f"min-partition-size {min_size} exceeds its {n} samples")
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    for _ in range(MAX_SIZE_DRAWS):
        proportions = rng.dirichlet(np.full(num_clients, beta))
        cuts = (np.cumsum(proportions) * n).astype(np.int64)[:-1]  # NIID-Bench's rounding
        sizes = np.diff(np.concatenate([[0], cuts, [n]]))
        if sizes.min() >= min_size:
            return [np.sort(part) for part in np.split(order, cuts)]
    raise ConfigError(f"cannot partition task {task} with quantity-skew: no Dir({beta}) draw in {MAX_SIZE_DRAWS} "
                      f"gave every one of {num_clients} clients >= {min_size} of its {n} samples; lower "
                      "min-partition-size or raise dirichlet-beta")


# ---------------------------------------------------------------------------- augmentation
def augment_images(images: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """A random view of each image of a uint8 batch (N, C, H, W), drawn from ``rng``.

    ``"crop-flip"``: the usual CIFAR training augmentation, as HGP trains its clients
    ("Reducing Bias in Federated Class-Incremental Learning with Hierarchical Generative
    Prototypes", Appendix B.1: random cropping and horizontal flipping): zero-pad every side
    by 1/8 of the image side (at least one pixel: 4 on 32 px, as torchvision's
    ``RandomCrop(32, padding=4)``), crop a random window of the original size, and flip
    left-right with probability 1/2. Works at the stored resolution, before the per-batch
    resize, so a 32 px image resized to 224 px sees the same relative shift. ``"none"``
    returns ``images`` unchanged. The same ``rng`` state gives the same views.
    """
    if kind == "none" or len(images) == 0:
        return images
    if kind != "crop-flip":
        raise ValueError(f"unknown augmentation {kind!r}")
    n, _, h, w = images.shape
    pad_h, pad_w = max(1, h // 8), max(1, w // 8)
    padded = np.pad(images, ((0, 0), (0, 0), (pad_h, pad_h), (pad_w, pad_w)))
    top = rng.integers(0, 2 * pad_h + 1, size=n)
    left = rng.integers(0, 2 * pad_w + 1, size=n)
    flip = rng.random(n) < 0.5
    rows = top[:, None] + np.arange(h)[None, :]  # (N, H)
    cols = left[:, None] + np.arange(w)[None, :]  # (N, W)
    cols = np.where(flip[:, None], cols[:, ::-1], cols)
    batch = np.arange(n)[:, None, None, None]
    channel = np.arange(images.shape[1])[None, :, None, None]
    return np.ascontiguousarray(padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]])


def _stateless_indices(
    labels: np.ndarray, pool: np.ndarray, classes: np.ndarray, cfg: ExperimentConfig,
    client_id: int, task: int, round_: int,
) -> np.ndarray:
    """HePCo's stateless population: each (client, round) draws afresh.

    A category ratio kappa of the task's classes, a split ratio gamma of each chosen
    class's images, then a long-tail profile with imbalance ratio beta (the
    rarest chosen class keeps a fraction beta of the most frequent one).
    """
    rng = np.random.default_rng([cfg.seed, client_id, task, round_, 0x57A7E])
    n_cls = max(1, int(round(cfg.category_ratio * len(classes))))
    chosen = rng.permutation(classes)[:n_cls]
    out = []
    for rank, c in enumerate(chosen):
        idx = pool[labels[pool] == c]
        n = max(1, int(round(cfg.split_ratio * len(idx))))
        # exponential long-tail profile over ranks: 1 -> beta
        frac = cfg.imbalance_ratio ** (rank / max(n_cls - 1, 1))
        n = max(1, int(round(n * frac)))
        out.append(rng.choice(idx, size=min(n, len(idx)), replace=False))
    return np.sort(np.concatenate(out))
