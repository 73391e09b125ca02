"""What a process needs to train or evaluate: data, model, device and the query cache.

Built once per process and configuration, then reused: Ray simulation actors keep
it across rounds, so the backbone and the queries are made once, not per message.

The query cache: q(x) (final CLS of the frozen backbone without prompts) depends
only on the backbone and the image, so it is computed once per stored sample and
reused across epochs, rounds and tasks. Augmented training batches (``augment``) are
new images: the training loop computes their q(x) itself and never asks the cache.

In deployment every message starts a fresh ClientApp process, so the query cache is
also kept on disk (``query-cache-disk``): one file per (backbone, data, split) under
``<cache dir>/queries``, merged under a file lock, written atomically. A fresh process
then reads its queries instead of running the backbone over its data again.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..config.experiment import ConfigError, ExperimentConfig, keys_of
from ..data.cache import load_dataset_cached
from ..data.partitions import Partition
from ..data.sources import ArraySplit, Dataset
from ..data.tasks import TaskLayout
from ..files import write_atomic
from ..node import startup
from .prompted import CodaPrompt, ModelSpec, PromptedViT, TrainableModule, build_model, resolve_device
from .weights import BackboneSpec, cache_dir, disk_backbone_id

log = logging.getLogger("promptfcl")

class QueryCache:
    """Lazily filled table of q(x) for one split, one backbone, holding only the rows asked for.

    A client asks for its own share, so the table grows with the share, never with the
    dataset: row ``slot[i]`` of ``rows`` is sample ``i``'s query (``slot`` is one int32 per
    sample).

    Parameters
    ----------
    split : ArraySplit
        The images the table is indexed by.
    dim : int
        Query dimension (the backbone's embedding width).
    path : Path, optional
        On-disk copy (``.npz``): read at construction, updated whenever new queries
        are computed. None keeps the cache in memory only.
    evaluation : bool
        The images are evaluation inputs (``eval-crop`` applies).
    """

    def __init__(self, split: ArraySplit, dim: int, path: Path | None = None, evaluation: bool = False) -> None:
        self.split, self.evaluation, self.dim = split, evaluation, dim
        self.slot = np.full(len(split), -1, dtype=np.int32)
        self.rows = torch.zeros(0, dim)
        self.size = 0  # rows in use
        self.computed = 0  # how many queries this cache has had to compute
        self.path = path
        self.loaded = 0  # how many queries were read from disk
        if path is not None:
            self.loaded = self._merge_from_disk()

    @property
    def filled(self) -> np.ndarray:
        return self.slot >= 0

    def get(self, model: PromptedViT, index: np.ndarray, device: torch.device, batch: int = 256) -> torch.Tensor:
        index = np.asarray(index, dtype=np.int64)
        missing = np.unique(index[self.slot[index] < 0])
        for start in range(0, len(missing), batch):
            chunk = missing[start : start + batch]
            x = model.preprocess(torch.from_numpy(self.split.images[chunk]).to(device), evaluation=self.evaluation)
            self._add(chunk, model.query(x).float().cpu())
            self.computed += len(chunk)
        if len(missing) and self.path is not None:
            self._save()
        return self.rows[torch.from_numpy(self.slot[index].astype(np.int64))]

    def _add(self, index: np.ndarray, queries: torch.Tensor) -> None:
        if self.size + len(index) > len(self.rows):  # grow by doubling: amortised O(1) per row
            grown = torch.zeros(max(2 * len(self.rows), self.size + len(index), 64), self.dim)
            grown[: self.size] = self.rows[: self.size]
            self.rows = grown
        self.rows[self.size : self.size + len(index)] = queries
        self.slot[index] = np.arange(self.size, self.size + len(index), dtype=np.int32)
        self.size += len(index)

    # ------------------------------------------------------------------ disk copy
    def _merge_from_disk(self) -> int:
        """Copy entries on disk but not here; return how many. Bad files are ignored."""
        if self.path is None or not self.path.is_file():
            return 0
        try:
            with np.load(self.path) as doc:
                index, rows = doc["index"].astype(np.int64), doc["rows"]
        except (OSError, ValueError, KeyError, EOFError) as exc:
            log.warning("query cache %s unreadable (%s); recomputing", self.path, exc)
            return 0
        in_range = not len(index) or 0 <= index.min() <= index.max() < len(self.split)
        if rows.shape != (len(index), self.dim) or not in_range:
            log.warning("query cache %s holds rows %s for indices up to %s; expected width %d over %d samples, "
                        "ignoring it", self.path, rows.shape, index.max() if len(index) else None, self.dim,
                        len(self.split))
            return 0
        new = self.slot[index] < 0
        self._add(index[new], torch.from_numpy(rows[new]).float())
        return int(new.sum())

    def _save(self) -> None:
        """Merge with what other processes wrote, then replace the file atomically."""
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                self._merge_from_disk()
                index = np.flatnonzero(self.slot >= 0)
                rows = self.rows[torch.from_numpy(self.slot[index].astype(np.int64))].numpy()
                write_atomic(self.path, lambda fh: np.savez(fh, index=index, rows=rows))
        except OSError as exc:  # a read-only or full cache dir must not stop training
            log.warning("cannot write query cache %s (%s); keeping it in memory", self.path, exc)
            self.path = None


@dataclass
class Runtime:
    """What a process trains and evaluates with; none of the run's configuration but what it
    decided here (the learner and strategy get their sections from the configuration itself)."""

    data: Dataset
    model: PromptedViT
    device: torch.device
    weights_source: str
    # how the clients share this process's data (a node with data of its own: all of it its own)
    partition: Partition
    layout: TaskLayout  # the run's tasks, classes, prompt pool and head over this runtime's data
    backbone: BackboneSpec  # the backbone the model was built with (names its disk caches)
    mixed_precision: bool  # forward passes under bfloat16 autocast (config ``precision``; decided once)
    query_cache_on: bool  # config ``query-cache``: stored images' q(x) computed once
    # the run's settings apart from where the data is (whether this model serves another run: _same_model)
    model_settings: str
    caches: dict[str, QueryCache] = field(default_factory=dict)
    disk_dir: Path | None = None  # where query caches persist (None: memory only)
    precision: str = "fp32"  # the frozen backbone's (a node's own choice: common/model/low_precision.py)

    def autocast(self) -> contextlib.AbstractContextManager:
        """bfloat16 autocast on this device when ``mixed_precision``, else nothing."""
        if not self.mixed_precision:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def query_cache(self, split: str) -> QueryCache:
        if split not in self.caches:
            path = None
            if self.disk_dir is not None:
                inputs = self.model.inputs.identity(evaluation=split == "test")
                # a lower-precision backbone's queries differ: a file of their own
                backbone = disk_backbone_id(self.backbone)
                backbone += "" if self.precision == "fp32" else f"-{self.precision}"
                path = self.disk_dir / f"{backbone}-{self.data.fingerprint}-{inputs}-{split}.npz"
            with startup.phase("query_cache"):  # reads the node's disk cache, if there is one
                self.caches[split] = QueryCache(getattr(self.data, split), self.model.embed_dim, path,
                                                evaluation=split == "test")
        return self.caches[split]

    def queries(self, split: str, index: np.ndarray) -> torch.Tensor | None:
        """Cached queries for ``index`` (None when the cache is switched off, or the model's trainable
        module reads no query: adapters change every feature, q(x) is none of theirs)."""
        if not self.query_cache_on or not self.model.prompt.uses_query:
            return None
        with self.autocast():  # the cache stores float32 whatever the forward's precision
            return self.query_cache(split).get(self.model, index, self.device).to(self.device)


def query_disk_dir(query_cache: bool, disk: str, population: str) -> Path | None:
    """``<cache dir>/queries`` when the disk query cache is on (``query-cache``, ``query-cache-disk``
    on, or auto on deployed nodes: ``population``), else None."""
    if not query_cache:
        return None
    on = disk == "on" or (disk == "auto" and population == "nodes")
    if not on:
        return None

    return cache_dir() / "queries"


def configure_threads(threads: int) -> None:
    """Use ``threads`` (the config's) if set; otherwise respect OMP_NUM_THREADS (Ray sets it per actor)."""
    n = threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _build_model(spec: ModelSpec, prompt_class: type[TrainableModule], device_name: str, threads: int,
                 precision: str = "fp32") -> tuple[PromptedViT, torch.device, str]:
    """The runtime's model (``spec``) on its device (``device_name``, ``threads``): the model, the
    device and where the backbone's weights came from."""
    configure_threads(threads)
    device = resolve_device(device_name)
    if precision != "fp32" and device.type != "cpu":
        raise ConfigError(f"backbone-precision = {precision} is a CPU node's option; this node trains on {device}")
    model, source = build_model(spec, prompt_class, precision)
    model.to(device)
    log.info("model: %s on %s", source, device)
    return model, device, source


@functools.lru_cache(maxsize=2)
def _runtime(fingerprint: str, prompt_class: type[TrainableModule], precision: str = "fp32") -> Runtime:
    cfg = ExperimentConfig.from_dict(json.loads(fingerprint))
    configure_threads(cfg.placement.threads)
    with startup.phase("data"):
        data = load_dataset_cached(cfg)
    return _assemble(cfg, data, _build_model(model_spec(cfg, data.num_classes), prompt_class, cfg.placement.device,
                                             cfg.placement.threads, precision), None, precision)


def _assemble(cfg: ExperimentConfig, data: Dataset, built: tuple[PromptedViT, torch.device, str],
              partition: Partition | None, precision: str) -> Runtime:
    """The runtime of ``cfg`` over ``data`` with the model ``built`` (model, device, weights' source)
    and ``partition`` (None: the run's)."""
    model, device, source = built
    disk_dir = query_disk_dir(cfg.caching.query_cache, cfg.caching.query_cache_disk, cfg.federation.population)
    return Runtime(data, model, device, source, partition or partition_of(cfg),
                   layout_of(cfg, data.num_classes), backbone_of(cfg), uses_bf16(cfg.run.precision, device),
                   cfg.caching.query_cache, _model_settings(cfg.to_dict()), disk_dir=disk_dir, precision=precision)


def partition_of(cfg: ExperimentConfig) -> Partition:
    """How run ``cfg`` shares the run's dataset among its clients."""
    return Partition.of(cfg.run, cfg.data, cfg.federation)


def layout_of(cfg: ExperimentConfig, num_classes: int) -> TaskLayout:
    """The tasks, classes, prompt pool and head of run ``cfg`` over ``num_classes`` classes."""
    return TaskLayout.of(cfg.run, cfg.data, cfg.federation, cfg.model, num_classes)


def backbone_of(cfg: ExperimentConfig) -> BackboneSpec:
    """The backbone run ``cfg`` names."""
    return BackboneSpec.of(cfg.run, cfg.data, cfg.federation, cfg.model, cfg.caching)


def model_spec(cfg: ExperimentConfig, num_classes: int) -> ModelSpec:
    """The model of run ``cfg`` over a dataset of ``num_classes`` classes."""
    return ModelSpec.of(backbone_of(cfg), layout_of(cfg, num_classes), cfg.run, cfg.model, cfg.evaluation,
                        cfg.method)


def uses_bf16(setting: str, device: torch.device) -> bool:
    """Whether forward passes run under bfloat16 autocast: config ``precision`` (``setting``) on ``device``."""
    if setting == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return setting == "bf16"


# Runtimes over data a caller loaded itself (a node's own data), keyed by config, data and precision.
_with_data: dict[tuple[str, type[TrainableModule], str, str, Partition | None], Runtime] = {}


def get_runtime(cfg: ExperimentConfig, prompt_class: type[TrainableModule] = CodaPrompt,
                data: Dataset | None = None, precision: str = "fp32", partition: Partition | None = None) -> Runtime:
    """The process-wide runtime for this configuration (the backbone is built once).

    Parameters
    ----------
    cfg : ExperimentConfig
        The run's configuration.
    prompt_class : type of CodaPrompt or LowRankAdapters
        The method's prompt module.
    data : Dataset, optional
        Data loaded by the caller (a deployed node's own data); by default the
        run's dataset is loaded from ``cfg``.
    precision : str
        The frozen backbone's precision, the node's choice (``fp32``, ``bf16``, ``int8``).
    partition : Partition, optional
        How ``data`` is shared among the clients (a node's own data: ``Partition.own``); by
        default the run's partition.
    """
    if data is None:
        return _runtime(cfg.fingerprint(), cast(Hashable, prompt_class), precision)  # a class hashes by identity
    key = (cfg.fingerprint(), prompt_class, data.fingerprint, precision, partition)
    if key not in _with_data:
        previous = next(iter(_with_data.values()), None)
        _with_data.clear()  # one node dataset per process
        if previous is not None and previous.precision == precision and \
                _same_model(previous, cfg.to_dict(), data, prompt_class):
            # another node's data in this process (simulated nodes share Ray actors): keep the model
            built = (previous.model, previous.device, previous.weights_source)
        else:
            built = _build_model(model_spec(cfg, data.num_classes), prompt_class, cfg.placement.device,
                                 cfg.placement.threads,
                                 precision)
        _with_data[key] = _assemble(cfg, data, built, partition, precision)
    return _with_data[key]


# Keys that say where a node's data is, not what the model is.
_DATA_LOCATION_KEYS = frozenset(keys_of("data-location"))


def _model_settings(settings: dict[str, Any]) -> str:
    """Run ``settings`` (``to_dict``) apart from where the data is, as one comparable string."""
    return json.dumps({k: v for k, v in settings.items() if k not in _DATA_LOCATION_KEYS}, sort_keys=True)


def _same_model(rt: Runtime, settings: dict[str, Any], data: Dataset, prompt_class: type[TrainableModule]) -> bool:
    """Whether ``rt``'s model serves run ``settings`` (``to_dict``) on ``data``: the same prompt
    module, classes and settings apart from where the data is."""
    return (type(rt.model.prompt) is prompt_class and rt.data.num_classes == data.num_classes
            and rt.model_settings == _model_settings(settings))
