"""Where backbone weights live and whether they are there: the cache, offline-pretrained
checkpoints, and the check a run makes before it starts (no model is built here)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from .config import ConfigError, ExperimentConfig, keys_of

ARCH_KEYS = keys_of("architecture")
# Keys that decide the backbone's output; a change in any of them invalidates queries.
BACKBONE_KEYS = keys_of("backbone")


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


def backbone_identity(cfg: ExperimentConfig) -> str:
    """Plain text of what decides the backbone's function on this node: the backbone keys, the
    seed (random weights only), the weights file's size and time (a rebuilt checkpoint,
    ``promptfcl pretrain --force``, never reuses queries or a built backbone of the old one) and
    timm's and torch's versions (``disk_backbone_id`` is its digest; a built-backbone cache file
    stores it to rule out a hash collision)."""
    full = cfg.to_dict()
    seed = f"seed={cfg.seed}" if cfg.weights == "random" else ""
    return json.dumps({"keys": {k: full[k] for k in BACKBONE_KEYS}, "seed": seed,
                       "weights-file": _weights_stamp(cfg), "libraries": _library_versions()}, sort_keys=True)


def disk_backbone_id(cfg: ExperimentConfig) -> str:
    """Short digest of :func:`backbone_identity`: names a node's disk caches of this backbone."""
    return hashlib.sha1(backbone_identity(cfg).encode()).hexdigest()[:16]


@functools.cache
def _library_versions() -> str:
    """timm's and torch's versions, read from their metadata (importing timm is what the cache
    avoids): model definitions and seeded random initialisation may change with either."""
    from importlib.metadata import PackageNotFoundError, version

    versions = []
    for name in ("timm", "torch"):
        try:
            versions.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            versions.append(f"{name}=none")
    return ",".join(versions)


def _weights_stamp(cfg: ExperimentConfig) -> str:
    """"size-mtime" of the weights file ``cfg`` names, "missing" without one, "" for timm/random."""
    if cfg.weights in ("timm", "random"):
        return ""
    try:
        if cfg.weights.startswith("pretrained:"):
            path = checkpoint_path(cfg, cfg.weights.split(":", 1)[1])
        else:
            path = Path(cfg.weights).expanduser()
        st = path.stat()
        return f"{st.st_size}-{st.st_mtime_ns}"
    except OSError:
        return "missing"
