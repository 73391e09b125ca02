"""What a process needs to train or evaluate: data, model, device and the query cache.

Built once per process and configuration, then reused: Ray simulation actors keep
it across rounds, so the backbone and the queries are made once, not per message.

The query cache: q(x) (final CLS of the frozen backbone without prompts) depends
only on the backbone and the image, so with no random augmentation it is computed
once per sample and reused across epochs, rounds and tasks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from common.config import ExperimentConfig
from common.data import ArraySplit, Dataset, load_dataset_cached
from common.model import CodaPrompt, PromptedViT, build_model, resolve_device

log = logging.getLogger("promptfcl")

# Keys that decide the backbone's output; a change in any of them invalidates queries.
BACKBONE_KEYS = ("backbone", "weights", "image-size", "patch-size", "embed-dim", "depth", "num-heads")


class QueryCache:
    """Lazily filled (N, D) table of q(x) for one split, one backbone."""

    def __init__(self, split: ArraySplit, dim: int) -> None:
        self.split = split
        self.table = torch.zeros(len(split), dim)
        self.filled = torch.zeros(len(split), dtype=torch.bool)
        self.computed = 0  # how many queries this cache has had to compute

    def get(self, model: PromptedViT, index: np.ndarray, device: torch.device, batch: int = 256) -> torch.Tensor:
        idx = torch.as_tensor(index, dtype=torch.long)
        missing = idx[~self.filled[idx]].unique()
        for start in range(0, len(missing), batch):
            chunk = missing[start : start + batch]
            x = model.preprocess(torch.from_numpy(self.split.images[chunk.numpy()]).to(device))
            self.table[chunk] = model.query(x).float().cpu()
            self.filled[chunk] = True
            self.computed += len(chunk)
        return self.table[idx]


@dataclass
class Runtime:
    cfg: ExperimentConfig
    data: Dataset
    model: PromptedViT
    device: torch.device
    weights_source: str
    caches: dict[str, QueryCache] = field(default_factory=dict)

    def query_cache(self, split: str) -> QueryCache:
        if split not in self.caches:
            self.caches[split] = QueryCache(getattr(self.data, split), self.model.embed_dim)
        return self.caches[split]

    def queries(self, split: str, index: np.ndarray) -> torch.Tensor | None:
        """Cached queries for ``index`` (None when the cache is switched off)."""
        if not self.cfg.query_cache:
            return None
        return self.query_cache(split).get(self.model, index, self.device).to(self.device)


def _subset_fingerprint(cfg: ExperimentConfig, keys: tuple[str, ...]) -> str:
    full = cfg.to_dict()
    return json.dumps({k: full[k] for k in keys}, sort_keys=True)


def backbone_id(cfg: ExperimentConfig) -> str:
    """Identifies the backbone's function (seed matters only for random weights)."""
    extra = f"seed={cfg.seed}" if cfg.weights == "random" else ""
    return hashlib.sha1((_subset_fingerprint(cfg, BACKBONE_KEYS) + extra).encode()).hexdigest()[:16]


def configure_threads(cfg: ExperimentConfig) -> None:
    """Use cfg.threads if set; otherwise respect OMP_NUM_THREADS (Ray sets it per actor)."""
    n = cfg.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


@functools.lru_cache(maxsize=2)
def _runtime(fingerprint: str, prompt_class: type[CodaPrompt]) -> Runtime:
    cfg = ExperimentConfig.from_dict(json.loads(fingerprint))
    configure_threads(cfg)
    data = load_dataset_cached(cfg)
    device = resolve_device(cfg.device)
    model, source = build_model(cfg, data.num_classes, prompt_class)
    model.to(device)
    log.info("model: %s on %s", source, device)
    return Runtime(cfg, data, model, device, source)


def get_runtime(cfg: ExperimentConfig, prompt_class: type[CodaPrompt] = CodaPrompt) -> Runtime:
    """The process-wide runtime for this configuration (the backbone is built once)."""
    return _runtime(cfg.fingerprint(), prompt_class)
