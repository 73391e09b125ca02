"""The frozen ViT backbone: built once (timm, or this project's ViT from a checkpoint), frozen,
and cached on disk per machine (``backbone-cache-disk``); common/model/prompted.py prompts it. A process
maps the cache file into memory rather than reading it: its weights are the page cache's,
shared read-only by every process of the node."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config.experiment import ConfigError
from ..files import write_atomic
from ..node import startup
from .vit import architecture, from_state, from_timm
from .weights import BackboneSpec, backbone_identity, cache_dir, checkpoint_meta, disk_backbone_id, resolve_weights

log = logging.getLogger("promptfcl")

#: layout version of a built-backbone cache file (``backbone-cache-disk``)
BUILT_FORMAT = 1

_refusals_logged: set[str] = set()  # backbones whose from_timm refusal this process has logged



#: a frozen ViT, timm's or common/model/vit.py's: the code reads it by its attributes (``blocks``,
#: ``patch_embed``, ``embed_dim``...), which torch types as ``Tensor | Module``, hence ``Any``
Backbone = Any


def build_backbone(spec: BackboneSpec) -> tuple[Backbone, str]:
    """The frozen backbone ``spec`` names, with a sentence saying which weights it has.

    With ``backbone-cache-disk`` on, a node keeps the built backbone in its cache dir
    (:func:`backbone_cache_path`) and a fresh process reads it into common/model/vit.py's ViT
    without importing timm. Otherwise, on a miss, and for a ViT outside that module's
    scope, timm builds it (a miss then writes the cache file).
    """
    path = backbone_cache_path(spec)
    if path is not None and path.exists():
        cached = _read_built(path, spec)
        if cached is not None:
            return cached
    model, source = _build_with_timm(spec)
    if path is None:
        return model, source
    with startup.phase("model_build"):
        ours, reason = from_timm(model)
    if ours is None:  # correct but slower: every process builds it with timm
        if spec.backbone not in _refusals_logged:
            _refusals_logged.add(spec.backbone)
            log.warning("backbone %s is not cached on disk: %s; every process builds it with timm",
                        spec.backbone, reason)
        return model, source
    _write_built(path, spec, ours, source)
    return ours, source


def backbone_cache_path(spec: BackboneSpec) -> Path | None:
    """``<cache dir>/backbones/built-<disk backbone id>.pt`` when ``backbone-cache-disk`` is on, else None."""
    return cache_dir() / "backbones" / f"built-{disk_backbone_id(spec)}.pt" if spec.cache_disk else None


def _read_built(path: Path, spec: BackboneSpec) -> tuple[Backbone, str] | None:
    """The backbone in a built-backbone cache file, or None (with a warning) if it is unusable."""
    try:
        with startup.phase("weights"):
            # memory-mapped, private: the frozen weights are the file's pages, read on demand and
            # shared with every process of this node that maps the cache (never written: no copy)
            doc = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if not isinstance(doc, dict) or doc.get("format") != BUILT_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"format {found!r}, expected {BUILT_FORMAT}")
        if doc.get("identity") != backbone_identity(spec):  # a digest collision, or a file put there by hand
            raise ValueError("it was built for another backbone configuration")
        arch = doc["arch"]
        _check_arch(arch, {"img_size": [spec.image_size] * 2, "patch_size": [spec.patch_size] * 2,
                           "embed_dim": spec.embed_dim, "depth": spec.depth, "num_heads": spec.num_heads})
        with startup.phase("model_build"):
            model = from_state(arch, doc["state"])
        return model, str(doc["source"])
    except Exception as exc:  # torch.load fails in many types on a damaged file; timm is the fallback
        log.warning("built backbone cache %s is unusable (%s: %s); building with timm and rewriting it",
                    path, type(exc).__name__, exc)
        return None


def _check_arch(arch: dict, wanted: dict[str, Any]) -> None:
    """Raise ValueError unless ``arch`` has the sizes the configuration sets (``wanted``)."""
    if not isinstance(arch, dict):
        raise ValueError(f"arch is a {type(arch).__name__}, not a dict")
    for key, value in wanted.items():
        if value not in (0, [0, 0]) and arch.get(key) != value:  # 0: the model's own size
            raise ValueError(f"arch {key} = {arch.get(key)!r}, the configuration says {value!r}")


def _write_built(path: Path, spec: BackboneSpec, model: nn.Module, source: str) -> None:
    doc = {"format": BUILT_FORMAT, "identity": backbone_identity(spec), "arch": architecture(model),
           "state": model.state_dict(), "source": source}
    try:
        write_atomic(path, lambda fh: torch.save(doc, fh))
    except Exception as exc:  # a read-only or full cache dir (torch's writer raises RuntimeError) must not stop the run
        log.warning("cannot write built backbone cache %s (%s)", path, exc)


def _build_with_timm(spec: BackboneSpec) -> tuple[Backbone, str]:
    """Create a frozen timm ViT by name; return it with a sentence saying which weights it has."""
    with startup.phase("model_build"):
        import timm  # a large part of a fresh process's start: imported only to build a model

    overrides: dict[str, Any] = {"num_classes": 0, "img_size": spec.image_size}
    for key in ("patch_size", "embed_dim", "depth", "num_heads"):
        value = getattr(spec, key)
        if value:
            overrides[key] = value
    pretrained = spec.weights == "timm"
    try:
        with startup.phase("model_build"):
            model = timm.create_model(spec.backbone, pretrained=pretrained, **overrides)
    except RuntimeError as exc:
        if "Unknown model" in str(exc):
            raise ConfigError(f"unknown timm model {spec.backbone!r}") from exc
        raise
    except Exception as exc:  # hub errors come in many types
        if pretrained:
            raise ConfigError(
                f"cannot fetch pretrained weights for {spec.backbone!r} from the hub "
                f"({type(exc).__name__}: {exc}); set weights=<checkpoint path> or weights=random"
            ) from exc
        raise
    if not hasattr(model, "blocks") or not hasattr(model, "patch_embed"):
        raise ConfigError(f"{spec.backbone!r} is not a ViT (no blocks/patch_embed)")

    if spec.weights == "timm":
        source = f"pretrained timm weights for {spec.backbone}"
    elif spec.weights == "random":
        source = (f"RANDOMLY INITIALISED {spec.backbone} (seed {spec.seed}) - "
                  "a stand-in backbone, not a pretrained one")
        _seeded_reinit(model, spec.seed)
    else:
        if spec.weights.startswith("pretrained:"):
            path = resolve_weights(spec)
            meta = checkpoint_meta(path)
            overlap = "OVERLAPS" if meta.get("source") == spec.dataset else "does not overlap"
            source = (f"{spec.backbone} pretrained offline on {meta.get('source', '?')} "
                      f"({meta.get('source_test_accuracy', float('nan')):.1f}% on its test set; "
                      f"{overlap} the evaluation dataset {spec.dataset}) from {path}")
        else:
            path = Path(spec.weights).expanduser()
            source = f"{spec.backbone} weights from checkpoint {path}"
        with startup.phase("weights"):
            _load_checkpoint(model, path, spec.backbone)
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    return model, source


def _load_checkpoint(model: nn.Module, path: Path, name: str) -> None:
    if not path.is_file():
        raise ConfigError(f"weights checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"cannot read weights checkpoint {path}: {exc}") from exc
    state = state.get("model", state) if isinstance(state, dict) else state
    state = {k: v for k, v in state.items() if not k.startswith("head.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint {path} does not match {name} with the configured sizes: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def _seeded_reinit(model: nn.Module, seed: int) -> None:
    """Re-initialise deterministically so every process builds the same random backbone."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset) and m is not model:
            reset()
    for name in ("cls_token", "pos_embed", "reg_token"):
        t = getattr(model, name, None)
        if isinstance(t, torch.Tensor):
            nn.init.trunc_normal_(t, std=0.02)
    torch.random.set_rng_state(gen_state)


# ---------------------------------------------------------------------------- prompts
