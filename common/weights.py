"""Where backbone weights live and whether they are there: the cache, offline-pretrained
checkpoints, and the check a run makes before it starts (no model is built here)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from common.config import ConfigError, ExperimentConfig

ARCH_KEYS = ("backbone", "image-size", "patch-size", "embed-dim", "depth", "num-heads")


def cache_dir() -> Path:
    """``$PROMPTFCL_CACHE`` or ``$XDG_CACHE_HOME/promptfcl`` (default ~/.cache/promptfcl)."""
    root = os.environ.get("PROMPTFCL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "promptfcl")
    return Path(root)


def checkpoint_path(cfg: ExperimentConfig, source: str) -> Path:
    """Where the backbone pretrained on ``source`` with ``cfg``'s architecture lives."""
    full = cfg.to_dict()
    arch = json.dumps({k: full[k] for k in ARCH_KEYS}, sort_keys=True)
    digest = hashlib.sha1(arch.encode()).hexdigest()[:10]
    safe = source.replace("/", "_").replace(":", "_")
    return cache_dir() / "backbones" / f"{cfg.backbone}-{digest}-{safe}.pt"


def resolve_weights(cfg: ExperimentConfig) -> Path:
    """The checkpoint behind ``weights = "pretrained:<source>"`` (an error if not built yet)."""
    source = cfg.weights.split(":", 1)[1]
    path = checkpoint_path(cfg, source)
    if not path.is_file():
        raise ConfigError(
            f"no backbone pretrained on {source!r} for this architecture at {path}; build it with "
            f"`promptfcl pretrain --source {source}` (make run does this) or set weights=random"
        )
    return path


def checkpoint_meta(path: Path) -> dict:
    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True).get("meta", {}))
    except Exception:  # meta is informational only
        return {}


def check_weights(cfg: ExperimentConfig) -> None:
    """The backbone weights ``cfg`` names exist on this machine (ConfigError saying how to get them)."""
    if cfg.weights.startswith("pretrained:"):
        resolve_weights(cfg)
    elif cfg.weights not in ("timm", "random") and not Path(cfg.weights).expanduser().is_file():
        raise ConfigError(f"weights checkpoint {cfg.weights} does not exist")
