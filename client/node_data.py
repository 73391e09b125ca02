"""A deployed node's own data: what ``--node-config`` says, loaded, checked and cached.

With ``population = "nodes"`` every Flower node is one client and brings its own data.
The SuperNode's ``--node-config`` says where it is (values are TOML: quote strings):

* ``data-dir="/srv/data"``  a folder of images, ``<class>/*.png`` (split into train and
  held-out test by ``test-fraction``) or ``train/<class>/*`` + ``test/<class>/*``. Class
  folders are matched to the run's classes *by name* (``class-names`` in the run config);
  a node may lack some classes, but a folder that is not one of the run's classes is an error.
* ``dataset="fashion-mnist" data-dir="/srv/fmnist"``  any source promptfcl can read
  (``digits``, ``fashion-mnist``, ``hf:<name>``, ``folder:<path>``) held by this node.
* ``partition-id=0 num-partitions=3 dataset="digits"``  a simulated share of the run's own
  dataset, of which this node holds a copy (``dataset``, and ``data-dir`` where the source
  needs one): train data by the run's partition scheme, held-out data as the disjoint test
  shard ``test[partition-id::num-partitions]``. The node's ``dataset`` must be the run's.
  Flower's simulation sets ``partition-id``/``num-partitions`` itself, and its nodes read the
  run's ``dataset``/``data-dir`` (``data-from-run``, client/node_policy.py).

A node never takes a data location from the run unless its node config says
``data-from-run=true``: the run config comes from the server.

Optional: ``device="cuda"|"mps"|"cpu"|"auto"``, ``threads=N`` (torch threads),
``client-id=N`` (seeds this node's local training; default: the partition id, or a
number derived from the data's fingerprint).

A node whose data is missing, unreadable or not the run's classes refuses with a
:class:`NodeDataError` that says what to fix; ``python -m client.node_data`` runs the
same checks before a SuperNode is started (``deploy/start-client.sh`` does). The error's text
goes back to the server (client/app.py, ``report_errors``), so it never names what the run did
not ask for: this node's other class folders or classes, its image files. Those are in this
node's log only (:func:`refusal`); the server could otherwise probe the node's folders by name.

Decoded folder datasets are cached as ``.npz`` under ``<cache dir>/node-data`` (keyed by
the file listing and the data-defining run keys), so a fresh ClientApp process does not
decode every image again.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..common.config.experiment import DEVICES, ConfigError, ExperimentConfig, keys_of
from ..common.data.cache import code_identity, load_source_cached, mapped_dataset
from ..common.data.images import IMAGE_EXTENSIONS, image_listing
from ..common.data.partitions import Partition
from ..common.data.sources import (
    ArraySplit,
    DataError,
    Dataset,
    DataSource,
    check_task_stream,
    ordered_dataset,
    read_class_folders,
    read_source,
)
from ..common.data.tasks import TaskLayout, class_order
from ..common.flower_internals import internal
from ..common.model.weights import BackboneSpec, cache_dir, check_weights
from ..common.text import escape_log_args
from ..strategies.platform.run_checks import load_config
from .node_policy import POLICY_KEYS, NodePolicy, NodeRefusal

# class names come from the server: escaped where they are logged
log = escape_log_args()

NODE_KEYS = ("data-dir", "dataset", "partition-id", "num-partitions", "device", "threads", "client-id", *POLICY_KEYS)
# Run-config keys that decide what a node's folder data decodes to.
FOLDER_KEYS = keys_of("node-folder")


class NodeDataError(DataError):
    """A node's data is missing, unreadable or does not match the run (its text may reach the server)."""


def refusal(public: str, local: str, *args: object) -> NodeDataError:
    """A :class:`NodeDataError` saying ``public`` (what the server is told), with the names of this
    node's own that the run did not ask for (``local % args``: its other class folders, its files)
    logged here for the node's operator only."""
    log.warning(local, *args)
    return NodeDataError(public)


@dataclass(frozen=True)
class NodeSpec:
    """Where a node's data comes from, parsed from its ``--node-config``."""

    kind: str  # "local" (its own data) or "partition" (a simulated share of the run's dataset)
    dataset: str = ""  # local: the source name ("folder:<dir>", "fashion-mnist", ...)
    data_dir: str = ""  # local: the source's directory ("" for sources that need none)
    partition_id: int = -1
    num_partitions: int = 0
    device: str = ""  # "" = the run config's
    threads: int = 0  # 0 = the run config's
    client_id: int | None = None
    data_from_run: bool = False  # may read the run's dataset / data-dir (client/node_policy.py)


HOW_TO = ("start the SuperNode with --node-config 'data-dir=\"/path/to/images\"' (its own data, "
          "<class>/*.png or train|test/<class>/*.png) or 'partition-id=I num-partitions=N' "
          "(a simulated share of the run's dataset)")


def parse_node_config(node_config: Mapping[str, Any], policy: NodePolicy | None = None) -> NodeSpec:
    """Read a node's data location, device and id from its node config.

    Raises
    ------
    NodeDataError
        Unknown keys, missing data, a directory that does not exist, bad values.
    """
    unknown = sorted(set(node_config) - set(NODE_KEYS))
    if unknown:
        raise NodeDataError(f"unknown node-config keys {unknown}; known keys: {', '.join(NODE_KEYS)}")
    device = str(node_config.get("device", ""))
    if device and device not in DEVICES:
        raise NodeDataError(f"node-config device must be one of {DEVICES}, got {device!r}")
    threads = _int(node_config, "threads", 0)
    if threads < 0:
        raise NodeDataError("node-config threads must be >= 0")
    client_id = _int(node_config, "client-id", -1)
    try:
        policy = policy or NodePolicy.from_node_config(node_config)
    except NodeRefusal as exc:
        raise NodeDataError(str(exc)) from None
    common: dict[str, Any] = {"device": device, "threads": threads, "client_id": client_id if client_id >= 0 else None,
              "data_from_run": policy.data_from_run}

    if "partition-id" in node_config:
        pid, n = _int(node_config, "partition-id", -1), _int(node_config, "num-partitions", 0)
        if n < 1 or not 0 <= pid < n:
            raise NodeDataError(f"node-config partition-id={pid} num-partitions={n}: need 0 <= partition-id < "
                                "num-partitions")
        data_dir = str(node_config.get("data-dir", ""))
        if data_dir and not Path(data_dir).expanduser().is_dir():
            raise NodeDataError(f"this node's data directory {data_dir} does not exist; {HOW_TO}")
        return NodeSpec("partition", dataset=str(node_config.get("dataset", "")), data_dir=data_dir,
                        partition_id=pid, num_partitions=n,
                        **{**common, "client_id": common["client_id"] if common["client_id"] is not None else pid})
    if "data-dir" in node_config or "dataset" in node_config:
        data_dir = str(node_config.get("data-dir", ""))
        dataset = str(node_config.get("dataset", "")) or "folder"
        if dataset == "folder":
            if not data_dir:
                raise NodeDataError(f"node-config dataset=\"folder\" needs data-dir; {HOW_TO}")
            dataset = f"folder:{data_dir}"
        if data_dir and not Path(data_dir).expanduser().is_dir():
            raise NodeDataError(f"this node's data directory {data_dir} does not exist; {HOW_TO}")
        if dataset.startswith("folder:") and not Path(dataset[7:]).expanduser().is_dir():
            raise NodeDataError(f"this node's data directory {dataset[7:]} does not exist; {HOW_TO}")
        return NodeSpec("local", dataset=dataset, data_dir=data_dir, **common)
    raise NodeDataError(f"this node was started without data: {HOW_TO}")


def _int(node_config: Mapping[str, Any], key: str, default: int) -> int:
    value = node_config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise NodeDataError(f"node-config {key} must be an integer, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------- the node's view of a run
@dataclass
class NodeData:
    """What a node trains and evaluates on, and how the learner must see it."""

    spec: NodeSpec
    data: Dataset
    cfg: ExperimentConfig  # the run config with this node's own device, threads and data location
    client_id: int  # seeds local training; indexes the partition for "partition" nodes
    partition: Partition  # how the run's clients share ``data`` (data of its own: all of it this node's)


_loaded: dict[str, NodeData] = {}


def node_data(cfg: ExperimentConfig, node_config: Mapping[str, Any], policy: NodePolicy | None = None) -> NodeData:
    """This node's data for run ``cfg`` (cached per process); checked against the run's classes
    (``policy``: the node's, already parsed from ``node_config``; None: parsed here).

    Raises
    ------
    NodeDataError
        The data is missing, unreadable, or not the run's classes.
    """
    spec = parse_node_config(node_config, policy)
    key = json.dumps([cfg.fingerprint(), dataclasses.asdict(spec)], sort_keys=True, default=str)
    if key not in _loaded:
        _loaded.clear()
        _loaded[key] = _load(cfg, spec)
    return _loaded[key]


def _load(cfg: ExperimentConfig, spec: NodeSpec) -> NodeData:
    if cfg.data.splits:
        raise NodeDataError(f"the run names a splits file ({cfg.data.splits!r}); a node does not open files the "
                            "server names (reuse splits in simulation)")
    node_cfg = cfg
    if spec.device:
        node_cfg = node_cfg.replace(device=spec.device)
    if spec.threads:
        node_cfg = node_cfg.replace(threads=spec.threads)

    run_source = DataSource.of(cfg.run, cfg.data, cfg.model, cfg.caching)
    run_names = cfg.data.class_name_list
    if spec.kind == "partition":
        if spec.num_partitions != cfg.federation.num_clients:
            raise NodeDataError(
                f"this node is partition {spec.partition_id} of {spec.num_partitions}, but the run has "
                f"num-clients = {cfg.federation.num_clients} nodes: start the nodes with "
                f"num-partitions={cfg.federation.num_clients}")
        full = load_source_cached(partition_source(run_source, spec), cfg.data.num_tasks)
        check_task_stream(TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, full.num_classes), full)
        check_classes(full.num_classes, original_names(full, cfg.run.seed), "the run's dataset", cfg.data.num_classes,
                      run_names)
        # Held-out data: a disjoint shard of the test split, so the nodes' counts add up
        # to exactly the central evaluation over the whole test split.
        shard = np.arange(spec.partition_id, len(full.test), spec.num_partitions)
        test = ArraySplit(full.test.images[shard], full.test.labels[shard])
        fp = hashlib.sha1(f"{full.fingerprint} test {spec.partition_id}/{spec.num_partitions}".encode())
        data = dataclasses.replace(full, test=test, fingerprint=fp.hexdigest()[:16])
        return NodeData(spec, data, node_cfg, spec.partition_id, Partition.of(cfg.run, cfg.data, cfg.federation))

    what = f"this node's data ({spec.dataset})"
    if spec.dataset.startswith("folder:"):
        data = load_folder(run_source, run_names, Path(spec.dataset[len("folder:"):]).expanduser())
        check_classes(data.num_classes, original_names(data, cfg.run.seed), what, cfg.data.num_classes, run_names)
    else:
        source = dataclasses.replace(run_source, dataset=spec.dataset, data_dir=spec.data_dir)  # never the run's
        try:
            data = read_source(source)
            # the run's classes first: the task stream's errors name classes, by then the run's own
            check_classes(data.num_classes, original_names(data, cfg.run.seed), what, cfg.data.num_classes, run_names)
            check_task_stream(TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, data.num_classes), data)
        except ConfigError as exc:
            raise NodeDataError(f"{what}: {exc}") from exc
    if len(data.train) == 0:
        raise NodeDataError(f"{what} has no training images")
    client_id = spec.client_id if spec.client_id is not None else int(data.fingerprint[:7], 16)
    # The node's data is all its own: every sample of a task's classes is its share (with random
    # tasks the node plays the schedule's client the server names, drawn as the run draws it)
    # (the runtime's data location is the node's own, never the run's)
    node_cfg = node_cfg.replace(dataset=spec.dataset, data_dir=spec.data_dir)
    return NodeData(spec, data, node_cfg, client_id, Partition.of(cfg.run, cfg.data, cfg.federation).own())


def partition_source(run_source: DataSource, spec: NodeSpec) -> DataSource:
    """The run's source at the dataset location of a partition node: its own copy of the run's
    dataset (``dataset``, ``data-dir`` of its node config), or, with ``data-from-run``, the run's."""
    if spec.data_from_run and not spec.dataset:
        return run_source
    if not spec.dataset:
        raise NodeDataError(f"this node is partition {spec.partition_id} of the run's dataset "
                            f"{run_source.dataset!r}, but its node-config does not name the copy it holds: add "
                            "dataset=\"...\" (and data-dir=\"...\" where the source needs one), or data-from-run=true "
                            "to read the run's location")
    if spec.dataset != run_source.dataset:
        raise NodeDataError(f"this node holds dataset {spec.dataset!r}, but the run partitions {run_source.dataset!r}")
    return dataclasses.replace(run_source, data_dir=spec.data_dir)


def original_names(data: Dataset, seed: int) -> list[str]:
    """Class names in original label order (``Dataset.class_names`` is in the seeded order)."""
    order = class_order(data.num_classes, seed)
    names = [""] * data.num_classes
    for position, original in enumerate(order):
        names[original] = data.class_names[position]
    return names


def check_classes(num_classes: int, names: list[str], what: str, run_num_classes: int = 0,
                  run_names: Sequence[str] = ()) -> None:
    """Refuse data whose classes are not the run's.

    ``run_num_classes`` is the run's ``num-classes`` (or, where that is unset, the head size the
    server sent; 0: not checked); ``run_names`` its ``class-names`` (empty: not checked).
    """
    expected = run_num_classes
    if expected and num_classes != expected:
        raise NodeDataError(f"{what} has {num_classes} classes but the run has {expected}; "
                            "every node must hold data of the run's classes")
    wanted = list(run_names)
    if wanted and names != wanted:
        extra = [n for n in names if n not in wanted]
        if extra:  # names of this node's own: its log has them, the server hears only that there are some
            raise refusal(f"{what} does not match the run's classes: it has classes that are not among the run's "
                          "class-names (this node's log names them)",
                          "%s has classes %s that are not among the run's class-names", what, extra)
        raise NodeDataError(f"{what} does not match the run's classes: class order {names[:5]}... differs from "
                            f"class-names {wanted[:5]}...")


# ---------------------------------------------------------------------------- folder data
def load_folder(source: DataSource, class_names: list[str], root: Path) -> Dataset:
    """A node's image folder as a Dataset in the run's class order (decoded once per machine,
    then mapped from the data cache: common/data/cache.py), decoded as the run's ``source`` is.

    Layout ``root/<class>/*`` or ``root/{train,test}/<class>/*``; classes are matched by
    folder name to ``class_names`` (the run's ``class-names``) when set, else taken as the
    sorted folders.
    """
    if not root.is_dir():
        raise NodeDataError(f"this node's data directory {root} does not exist; {HOW_TO}")

    full = {**source.keys(), "class-names": ",".join(class_names)}
    try:
        listing = image_listing(root)
    except OSError as exc:  # a dangling link, a file gone while listed: its name is this node's
        raise refusal(f"this node's data {root} cannot be listed ({type(exc).__name__}; this node's log names the "
                      "file)", "this node's data %s cannot be listed: %s", root, exc) from exc
    if not listing:
        raise NodeDataError(f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) under {root}; {HOW_TO}")
    key = ["node folder", code_identity(sys.modules[__name__]), str(root.resolve()),
           {k: full[k] for k in FOLDER_KEYS}, class_names, listing]
    if not source.cache:
        return _decode_folder(source, class_names, root)
    return mapped_dataset(cache_dir() / "data", key, lambda: _decode_folder(source, class_names, root),
                          f"this node's folder {root}")


def _decode_folder(source: DataSource, class_names: list[str], root: Path) -> Dataset:
    has_splits = (root / "train").is_dir() and (root / "test").is_dir()
    base = root / "train" if has_splits else root
    folders = sorted(p.name for p in base.iterdir() if p.is_dir())
    names = class_names or folders
    extra = [f for f in folders if f not in names]
    if extra:
        run_classes = f"{names[:10]}{'...' if len(names) > 10 else ''}"
        raise refusal(f"this node's data {base} has class folders that are not among the run's classes "
                      f"{run_classes} (this node's log names them)",
                      "this node's data %s has class folders %s that are not among the run's classes %s",
                      base, extra, run_classes)
    if len(names) < 2:
        raise NodeDataError(f"this node's data {base} needs one sub-folder per class (found {len(names)}); "
                            "or set the run's class-names")
    if has_splits:
        train, test = _read_split(root / "train", names, source), _read_split(root / "test", names, source)
    else:
        train, test = _split(_read_split(root, names, source), source.test_fraction, source.seed)
    return _as_dataset(source, root, names, train, test)


def _read_split(split_root: Path, names: list[str], source: DataSource) -> ArraySplit:
    """The node's images of the run's classes (a node may lack some classes)."""
    try:
        return read_class_folders(split_root, names, source.image_size, skip_missing=True,
                                  interpolation=source.resize_interpolation)
    except DataError as exc:
        if isinstance(exc.__cause__, OSError):  # an image file that cannot be read: its name is this node's
            raise refusal(f"this node's data {split_root} holds an image that cannot be read "
                          f"({type(exc.__cause__).__name__}; this node's log names the file)", "%s", exc) from exc
        raise NodeDataError(str(exc)) from exc  # a class name the run sent, refused


def _split(full: ArraySplit, test_fraction: float, seed: int) -> tuple[ArraySplit, ArraySplit]:
    """Seeded per-class held-out split by ``test-fraction`` (classes with one image stay in train)."""
    rng = np.random.default_rng([seed, 0x7E57])
    test_idx = []
    for c in np.unique(full.labels):
        idx = np.flatnonzero(full.labels == c)
        n_test = int(round(test_fraction * len(idx))) if len(idx) > 1 else 0
        test_idx.append(rng.permutation(idx)[:n_test])
    test_mask = np.zeros(len(full), dtype=bool)
    test_mask[np.concatenate(test_idx) if test_idx else []] = True
    return (ArraySplit(full.images[~test_mask], full.labels[~test_mask]),
            ArraySplit(full.images[test_mask], full.labels[test_mask]))


def _as_dataset(source: DataSource, root: Path, names: list[str], train: ArraySplit, test: ArraySplit) -> Dataset:
    """A node's folders as a Dataset, ordered exactly as ``load_dataset`` orders a source."""
    num_classes = len(names)
    if len(test) and train.images.shape[1:] != test.images.shape[1:]:
        raise NodeDataError(f"{root}: train images {train.images.shape[1:]} and test images "
                            f"{test.images.shape[1:]} differ in shape")
    if (root / "train").is_dir() and (root / "test").is_dir():
        split = f"this node's folders {root}/train and {root}/test"
    else:
        split = f"this node's folder {root} split by seed {source.seed} per class, {source.test_fraction:.0%} held out"
    return ordered_dataset(source, f"folder:{root}", train, test, num_classes, names, split)


# ---------------------------------------------------------------------------- export (demo data)
def export_digits(out: Path, nodes: int, seed: int = 0) -> list[Path]:
    """Write scikit-learn's digits as ``out/node<i>/{train,test}/<digit>/*.png``, one disjoint share per node.

    For trying a deployment without a dataset of one's own: each node gets a stratified
    share of the digits' train and test images.
    """
    # only the sources that need them: PIL for image folders, scikit-learn for digits
    from PIL import Image
    from sklearn.datasets import load_digits

    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    bunch = load_digits()
    images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)
    labels = bunch.target
    rng = np.random.default_rng([seed, 0xE4])
    dirs = [out / f"node{i}" for i in range(nodes)]
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n_test = len(idx) // 4
        for split, part in (("test", idx[:n_test]), ("train", idx[n_test:])):
            for i, share in enumerate(np.array_split(part, nodes)):
                folder = dirs[i] / split / str(c)
                folder.mkdir(parents=True, exist_ok=True)
                for j in share:
                    Image.fromarray(images[j], mode="L").save(folder / f"{j:04d}.png")
    return dirs


# ---------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
    """``python -m client.node_data check|export-digits``: check a node's data before starting it."""
    parser = argparse.ArgumentParser(prog="python -m client.node_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    chk = sub.add_parser("check", help="load this node's data as the ClientApp would, and check it against the run")
    chk.add_argument("--node-config", required=True, help="the SuperNode's --node-config string")
    chk.add_argument("--config", help="the run's config overrides (TOML), as given to `flwr run -c`")
    chk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    exp = sub.add_parser("export-digits", help="write digits as per-node image folders (demo data)")
    exp.add_argument("--out", required=True)
    exp.add_argument("--nodes", type=int, default=3)
    args = parser.parse_args(argv)

    if args.command == "export-digits":
        for folder in export_digits(Path(args.out), args.nodes):
            print(folder)
        return 0

    parse_config_args = internal("parse_config_args")

    try:
        try:
            node_config = parse_config_args([args.node_config])
        except Exception as exc:  # click's exception: values must be TOML (quote strings)
            raise NodeDataError(f"--node-config {args.node_config!r} is not key=value pairs with TOML values "
                                f"(quote strings: data-dir=\"/path\"): {exc}") from None
        cfg = load_config(args.config, args.set, None, None)
        policy = NodePolicy.from_node_config(node_config)
        policy.check_run(cfg)
        # as the ClientApp will: the node's own weights or its cache
        cfg = cfg.replace(weights=policy.backbone_weights(cfg.model.backbone, cfg.model.weights))
        loaded = node_data(cfg, node_config)
        # the backbone must be on this node (the server has none)
        check_weights(BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching))
    except (ConfigError, DataError, NodeRefusal) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    d = loaded.data
    k = d.num_classes // cfg.data.num_tasks
    per_task = [int(np.sum(d.train.labels // k == t)) for t in range(cfg.data.num_tasks)]
    held = [int(np.sum(d.test.labels // k == t)) for t in range(cfg.data.num_tasks)]
    print(f"ok: {d.name}: {d.num_classes} classes, {len(d.train)} train / {len(d.test)} held-out images; "
          f"train per task {per_task}, held-out per task {held}; client-id {loaded.client_id}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
