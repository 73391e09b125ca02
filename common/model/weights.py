"""Where backbone weights live and whether they are there: the cache, offline-pretrained
checkpoints, and the check a run makes before it starts (no model is built here)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..config import sections as sections
from ..config.experiment import ConfigError, keys_of

ARCH_KEYS = keys_of("architecture")
# Keys that decide the backbone's output; a change in any of them invalidates queries.
BACKBONE_KEYS = keys_of("backbone")


def cache_dir() -> Path:
    """``$PROMPTFCL_CACHE`` or ``$XDG_CACHE_HOME/promptfcl`` (default ~/.cache/promptfcl)."""
    root = os.environ.get("PROMPTFCL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "promptfcl")
    return Path(root)


@dataclass(frozen=True)
class BackboneSpec:
    """The frozen backbone a run names: what building it, its weights and its caches read of a run.

    Parameters
    ----------
    backbone : str
        The timm model name.
    weights : str
        ``timm``, ``random``, ``pretrained:<source>`` or a checkpoint path.
    image_size, patch_size, embed_dim, depth, num_heads : int
        The architecture (0: the model's own size; ``image_size`` always set).
    seed : int
        Seeds random weights.
    dataset : str
        The run's evaluation dataset (a pretrained checkpoint's description says whether its
        source overlaps it).
    cache_disk : bool
        Keep the built backbone in the node's cache dir (``backbone-cache-disk``: on, or auto
        with ``population = nodes``).
    """

    backbone: str
    weights: str
    image_size: int
    patch_size: int
    embed_dim: int
    depth: int
    num_heads: int
    seed: int
    dataset: str
    cache_disk: bool

    @classmethod
    def of(cls, run: sections.RunSection, data: sections.DataSection, federation: sections.FederationSection,
           model: sections.ModelSection, caching: sections.CachingSection) -> BackboneSpec:
        """The backbone a run of these sections names."""
        disk, m = caching.backbone_cache_disk, model
        on = disk == "on" or (disk == "auto" and federation.population == "nodes")
        return cls(m.backbone, m.weights, m.image_size, m.patch_size, m.embed_dim, m.depth, m.num_heads, run.seed,
                   data.dataset, on)

    def keys(self) -> dict[str, object]:
        """This spec's values by run-config key (kebab-case), for the identities keyed by them."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    def architecture(self) -> dict[str, object]:
        """The architecture keys (``keys_of("architecture")``) and their values."""
        full = self.keys()
        return {k: full[k] for k in ARCH_KEYS}


def checkpoint_path(spec: BackboneSpec, source: str) -> Path:
    """Where the backbone pretrained on ``source`` with ``spec``'s architecture lives."""
    arch = json.dumps(spec.architecture(), sort_keys=True)
    digest = hashlib.sha1(arch.encode()).hexdigest()[:10]
    safe = source.replace("/", "_").replace(":", "_")
    return cache_dir() / "backbones" / f"{spec.backbone}-{digest}-{safe}.pt"


def resolve_weights(spec: BackboneSpec) -> Path:
    """The checkpoint behind ``weights = "pretrained:<source>"`` (an error if not built yet)."""
    source = spec.weights.split(":", 1)[1]
    path = checkpoint_path(spec, source)
    if not path.is_file():
        raise ConfigError(
            f"no backbone pretrained on {source!r} for this architecture at {path}; build it with "
            f"`promptfcl pretrain --source {source}` (make run does this) or set weights=random"
        )
    return path


def checkpoint_meta(path: Path) -> dict:
    import torch  # heavy: the spec, the paths and the footprint check (common/node/footprint.py) need none of it

    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True).get("meta", {}))
    except Exception:  # meta is informational only
        return {}


def check_weights(spec: BackboneSpec) -> None:
    """The backbone weights ``spec`` names exist on this machine (ConfigError saying how to get them)."""
    if spec.weights.startswith("pretrained:"):
        resolve_weights(spec)
    elif spec.weights not in ("timm", "random") and not Path(spec.weights).expanduser().is_file():
        raise ConfigError(f"weights checkpoint {spec.weights} does not exist")


def backbone_identity(spec: BackboneSpec) -> str:
    """Plain text of what decides the backbone's function on this node: the backbone keys, the
    seed (random weights only), the weights file's size and time (a rebuilt checkpoint,
    ``promptfcl pretrain --force``, never reuses queries or a built backbone of the old one) and
    timm's and torch's versions (``disk_backbone_id`` is its digest; a built-backbone cache file
    stores it to rule out a hash collision)."""
    full = spec.keys()
    seed = f"seed={spec.seed}" if spec.weights == "random" else ""
    return json.dumps({"keys": {k: full[k] for k in BACKBONE_KEYS}, "seed": seed,
                       "weights-file": _weights_stamp(spec), "libraries": _library_versions()}, sort_keys=True)


def disk_backbone_id(spec: BackboneSpec) -> str:
    """Short digest of :func:`backbone_identity`: names a node's disk caches of this backbone."""
    return hashlib.sha1(backbone_identity(spec).encode()).hexdigest()[:16]


@functools.cache
def _library_versions() -> str:
    """timm's and torch's versions, read from their metadata (importing timm is what the cache
    avoids): model definitions and seeded random initialisation may change with either."""

    versions = []
    for name in ("timm", "torch"):
        try:
            versions.append(f"{name}={version(name)}")
        except PackageNotFoundError:
            versions.append(f"{name}=none")
    return ",".join(versions)


def _weights_stamp(spec: BackboneSpec) -> str:
    """"size-mtime" of the weights file ``spec`` names, "missing" without one, "" for timm/random."""
    if spec.weights in ("timm", "random"):
        return ""
    try:
        if spec.weights.startswith("pretrained:"):
            path = checkpoint_path(spec, spec.weights.split(":", 1)[1])
        else:
            path = Path(spec.weights).expanduser()
        st = path.stat()
        return f"{st.st_size}-{st.st_mtime_ns}"
    except OSError:
        return "missing"
