"""What a run costs in memory, estimated from its configuration before anything is built.

A run config sets the backbone's image size, patch size, width and depth, the batch size, and
the prompt pool (or adapters), head and method whose copies a node and the server hold; a node
(client/node_policy.py), the ServerApp (server/run.py), ``promptfcl simulate`` and
``deploy/submit-run.sh`` (both through the run check, strategies/platform/run_checks.py) check
the same estimate before building anything, so a run that would ask for hundreds of gigabytes is
refused with a sentence naming the figure and the limit instead of an allocation. Ceilings:

* **tokens** per image, ``(image-size / patch-size)^2``: activations and the position
  embedding grow with it (and attention, without a fused kernel, with its square);
* **estimated memory**, in GB, against ``max-memory-gb`` (a node's node config, the server's
  ``PROMPTFCL_MAX_MEMORY_GB``) and, for what lives in the host's memory, this machine's memory.

This module holds the backbone's part, which needs no method: its float32 parameters,
``12 D^2`` per block plus the patch and position embeddings, and the activations one training
step keeps for the backward pass, about ``20 D`` floats per token per block (LayerNorms, qkv,
attention output, the 4D-wide MLP and the residuals) for ``batch x (tokens + 1 +
prompt-length)`` tokens. An upper estimate (bfloat16 autocast halves the activations), meant to
tell a paper-scale run (ViT-B/16, 224 px, batch 128, prompts of 20: about 21 GB) from a mistake
or an attack (1024 px, patch 1, batch 2048: a million tokens per image, some 66,000 GB at the
default width), not to plan a GPU's memory. The rest of a run's memory (the trainable state
with its gradients and optimiser moments, the messages' copies, the statistics a method
uploads and what the server keeps per round) is counted where the methods are known,
strategies/platform/run_memory.py, into one :class:`MemoryEstimate` per side.

A size the run leaves at 0 ("the model's own") is read from the timm name
(``vit_base_patch16_224``: patch 16, width 768, depth 12); a name that does not say it is
refused, since nothing could be estimated before building.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..config.experiment import ConfigError
from ..model.weights import BackboneSpec

#: default ceilings: a node's unless its node config says otherwise, the server's unless its
#: environment does (:func:`server_ceilings`). 4096 tokens: a 1024 px image in 16 px patches.
DEFAULT_MAX_TOKENS = 4096
DEFAULT_MAX_MEMORY_GB = 64
#: the server's ceilings from its own environment (the operator's, never the run's)
MAX_TOKENS_ENV = "PROMPTFCL_MAX_TOKENS"
MAX_MEMORY_ENV = "PROMPTFCL_MAX_MEMORY_GB"

#: timm's ViT sizes by name: (width, depth)
SIZES: dict[str, tuple[int, int]] = {
    "tiny": (192, 12), "small": (384, 12), "medium": (512, 12), "base": (768, 12), "large": (1024, 24),
    "huge": (1280, 32), "giant": (1408, 40), "gigantic": (1664, 48),
}
#: floats a training step keeps per token and block (see the module docstring)
FLOATS_PER_TOKEN_AND_BLOCK = 20
BYTES_PER_FLOAT = 4


@dataclass(frozen=True)
class Footprint:
    """The sizes a run's backbone is built with, resolved, and what they cost."""

    tokens: int  # patches per image
    width: int
    depth: int
    patch: int
    batch: int
    prompt_length: int

    @property
    def parameters(self) -> int:
        """The backbone's parameters: its blocks, patch embedding and position embedding."""
        return self.depth * 12 * self.width**2 + 3 * self.patch**2 * self.width + (self.tokens + 1) * self.width

    @property
    def activations(self) -> int:
        """Floats one training step keeps for the backward pass."""
        sequence = self.tokens + 1 + self.prompt_length
        return self.batch * sequence * self.depth * FLOATS_PER_TOKEN_AND_BLOCK * self.width

    @property
    def memory_gb(self) -> float:
        return BYTES_PER_FLOAT * (self.parameters + self.activations) / 1e9


@dataclass(frozen=True)
class MemoryEstimate:
    """What one side of a run (a node's message process, the ServerApp) needs, part by part.

    ``parts``: (what, bytes) in the order they are described; ``accelerated``: the names of the
    parts that live on the accelerator where the side trains on one (the backbone, its
    activations, the trainable state and its optimiser), so only the others must fit the host's
    memory there.
    """

    parts: tuple[tuple[str, float], ...]
    accelerated: frozenset[str] = frozenset()

    @property
    def total_gb(self) -> float:
        return sum(b for _, b in self.parts) / 1e9

    def host_gb(self, on_accelerator: bool) -> float:
        """GB in the host's memory: everything, or on an accelerator what does not live there."""
        return sum(b for name, b in self.parts if not (on_accelerator and name in self.accelerated)) / 1e9

    def part_gb(self, name: str) -> float:
        return sum(b for what, b in self.parts if what == name) / 1e9

    def describe(self, largest: int = 4) -> str:
        """The largest parts, "trainable state x4 (...) 19.3 GB, ...", for a refusal's sentence."""
        ranked = sorted(self.parts, key=lambda p: -p[1])[:largest]
        return ", ".join(f"{name} {_gb(b)}" for name, b in ranked if b > 0)


def _gb(value: float) -> str:
    return f"{value / 1e9:.3g} GB" if value >= 1e8 else f"{value / 1e6:.3g} MB"


def memory_problem(estimate: MemoryEstimate, max_memory_gb: float, whose: str, setting: str,
                   on_accelerator: bool, machine_gb: float | None = None) -> str | None:
    """Why ``estimate`` does not fit (None: it does): above ``whose`` ``max-memory-gb`` (``setting``
    says where it is set), or its host part above this machine's memory (``machine_gb``: None reads
    it, 0 skips it: an operator who set ``max-memory-gb`` knows the machine better, its swap, its GPU)."""
    total = estimate.total_gb
    if total > max_memory_gb:
        return (f"the run needs an estimated {total:.3g} GB, above {whose} max-memory-gb = {max_memory_gb:g} "
                f"({estimate.describe()}; {setting})")
    machine = machine_memory_gb() if machine_gb is None else machine_gb
    host = estimate.host_gb(on_accelerator)
    if machine > 0 and host > machine:
        return (f"the run needs an estimated {host:.3g} GB of host memory, above this machine's memory, "
                f"{machine:.3g} GB ({estimate.describe()})")
    return None


def machine_memory_gb() -> float:
    """This machine's memory in GB (its control group's limit where lower; 0 where unknown)."""
    found: list[float] = []
    try:
        with open("/proc/meminfo") as fh:
            found += [float(line.split()[1]) * 1024 / 1e9 for line in fh if line.startswith("MemTotal:")]
    except OSError:
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            raw = fh.read().strip()
        if raw.isdigit():
            found.append(int(raw) / 1e9)
    except OSError:
        pass
    return min(found) if found else 0.0


def footprint(spec: BackboneSpec, batch_size: int, prompt_length: int) -> Footprint:
    """The backbone ``spec``'s sizes, a 0 ("the model's own") read from the timm name, trained at
    ``batch_size`` with prompts of ``prompt_length`` tokens.

    Raises
    ------
    ConfigError
        A size is 0 and the backbone's name does not say it.
    """
    name = spec.backbone.split(".", 1)[0]  # the pretrained tag does not change the architecture
    patch = spec.patch_size or _from_name(re.search(r"patch(\d+)", name), "patch-size", spec.backbone)
    named = next((SIZES[part] for part in name.split("_") if part in SIZES), None)
    width = spec.embed_dim or _from_name(named and named[0], "embed-dim", spec.backbone)
    depth = spec.depth or _from_name(named and named[1], "depth", spec.backbone)
    tokens = (spec.image_size // patch) ** 2  # timm refuses a size its patches do not divide
    return Footprint(tokens, width, depth, patch, batch_size, prompt_length)


def _from_name(found: object, key: str, backbone: str) -> int:
    if isinstance(found, re.Match):
        return int(found.group(1))
    if isinstance(found, int) and found > 0:
        return found
    raise ConfigError(f"{key} = 0 (the model's own) but the backbone name {backbone!r} does not say it: set {key} "
                      "so the run's memory can be estimated before anything is built")


def footprint_problem(size: Footprint, image_size: int, max_tokens: int, max_memory_gb: float,
                      whose: str) -> str | None:
    """Why a run of ``size`` (``image_size``: the run's image-size) exceeds the ceilings (``whose``:
    "this node's limit", ...), or None when it fits."""
    if size.tokens > max_tokens:
        return (f"image-size {image_size} / patch-size {size.patch} gives {size.tokens} tokens per image, "
                f"above {whose} max-tokens = {max_tokens}")
    if size.memory_gb > max_memory_gb:
        return (f"the backbone (width {size.width}, depth {size.depth}, {size.tokens} tokens) at batch-size "
                f"{size.batch} needs an estimated {size.memory_gb:.3g} GB, above {whose} "
                f"max-memory-gb = {max_memory_gb:g}")
    return None


def server_ceilings(environ: Mapping[str, str] | None = None) -> tuple[int, float]:
    """(max tokens, max memory GB) of the server side: the defaults, or the operator's environment.

    Raises
    ------
    ConfigError
        A ceiling in the environment is not a positive number.
    """
    environ = os.environ if environ is None else environ
    out: list[float] = []
    for name, default in ((MAX_TOKENS_ENV, DEFAULT_MAX_TOKENS), (MAX_MEMORY_ENV, DEFAULT_MAX_MEMORY_GB)):
        raw = environ.get(name, "")
        try:
            value = float(raw) if raw else float(default)
        except ValueError:
            value = 0.0
        if not value > 0:
            raise ConfigError(f"{name} must be a positive number, got {raw!r}")
        out.append(value)
    return int(out[0]), out[1]


def check_server_footprint(spec: BackboneSpec, batch_size: int, prompt_length: int, image_size: int) -> None:
    """Refuse, before the server builds anything, a run beyond the server's ceilings (the run's
    backbone ``spec``, batch size, prompt length and image size).

    Raises
    ------
    ConfigError
        The run's tokens or estimated memory exceed :func:`server_ceilings`.
    """
    max_tokens, max_memory_gb = server_ceilings()
    size = footprint(spec, batch_size, prompt_length)
    problem = footprint_problem(size, image_size, max_tokens, max_memory_gb, "the server's limit")
    if problem is not None:
        raise ConfigError(f"{problem} ({MAX_TOKENS_ENV} / {MAX_MEMORY_ENV} in the server's environment raise it)")


__all__ = ["DEFAULT_MAX_MEMORY_GB", "DEFAULT_MAX_TOKENS", "Footprint", "MemoryEstimate", "check_server_footprint",
           "footprint", "footprint_problem", "machine_memory_gb", "memory_problem", "server_ceilings"]
