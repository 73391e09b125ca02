"""Frozen ViT backbone, CODA-P decomposed prompts, and the prompted classifier.

Reads top to bottom: ``CodaPrompt`` -> ``PromptedViT`` over the frozen backbone of
``common/model/backbone.py`` (``build_backbone``).
Only the prompt module and the linear head are trainable; the backbone is frozen
and never leaves the machine it runs on.

Prompt insertion (the papers' common notation):
* prefix-tuning: a prompt of length L is split into L/2 key and L/2 value tokens
  prepended to K and V of a block's attention (sequence length unchanged);
* prompt-tuning: L tokens are inserted after the CLS token at the block input and
  removed again at its output (the "append then truncate" of VPT-deep / FPPL code).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import sections as sections
from ..config.experiment import ConfigError
from ..data.tasks import TaskLayout
from .backbone import Backbone, backbone_cache_path, build_backbone  # noqa: F401  (re-exported)
from .low_precision import lower_precision
from .preprocess import InputPipeline
from .trainable import BlockForward, ModuleShape, TrainableModule
from .vit import Attention as OurAttention
from .vit import Block as OurBlock
from .vit import block_forward
from .weights import BackboneSpec

log = logging.getLogger("promptfcl")


def gram_schmidt_rows(new: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Rows of ``new`` made orthonormal to each other and to the rows of ``previous``.

    Flattened per row. When rows outnumber dimensions, the excess rows cannot be
    orthogonal; they are kept as random unit vectors (as CODA-P's code also degrades).
    """
    dim = new[0].numel()
    basis = [r / r.norm() for r in previous.reshape(previous.shape[0], -1)] if previous.numel() else []
    basis = basis[-dim:] if len(basis) >= dim else basis
    out = []
    for row in new.reshape(new.shape[0], -1):
        v = row.clone()
        if len(basis) < dim:
            for b in basis:
                v = v - (v @ b) * b
        v = v / v.norm().clamp_min(1e-12)
        out.append(v)
        if len(basis) < dim:
            basis.append(v)
    return torch.stack(out).reshape_as(new)


class CodaPrompt(nn.Module):
    """CODA-P decomposed prompts for a list of blocks.

    Per prompted block: components P (M, L, D), keys K (M, D), attention vectors
    A (M, D). With query q, component m weighs ``alpha_m = cos(q * A_m, K_m)``
    and the block's prompt is ``sum_m alpha_m P_m``. The pool is split evenly over
    tasks; while on task t, slices before t are used but detached, slices after t unused.

    Parameters
    ----------
    embed_dim : int
        Token width D of the backbone.
    layers : list[int]
        Indices of the prompted blocks.
    pool_size : int
        Components M per block (a multiple of ``num_tasks``).
    length : int
        Prompt length L.
    num_tasks : int
        Number of task slices.
    """

    #: parameter kinds per prompted block: components P, keys K, attention vectors A.
    #: Variants without attention vectors (HePCo, HGP) set ``kinds = "pk"``.
    kinds = "pka"
    #: with prompt-tuning and ``prompt-tokens = "auto"``: what the method does with a block's
    #: prompt tokens after the block, "truncate" or "accumulate" (see ``PromptedViT.features``)
    prompt_tokens = "truncate"
    #: the module family (the other: common/model/adapters.py's low-rank adapters)
    family = "prompts"
    #: whether the forward reads q(x), the unprompted backbone's feature (the runtime caches it)
    uses_query = True

    def __init__(self, embed_dim: int, layers: list[int], pool_size: int, length: int, num_tasks: int) -> None:
        super().__init__()
        self.embed_dim, self.layers, self.pool_size = embed_dim, list(layers), pool_size
        self.length, self.num_tasks = length, num_tasks
        self.per_task = pool_size // num_tasks
        self.task = 0
        for layer in self.layers:
            self.register_parameter(f"p{layer}", nn.Parameter(torch.empty(pool_size, length, embed_dim)))
            self.register_parameter(f"k{layer}", nn.Parameter(torch.empty(pool_size, embed_dim)))
            if "a" in self.kinds:
                self.register_parameter(f"a{layer}", nn.Parameter(torch.empty(pool_size, embed_dim)))
            for kind in self.kinds:
                nn.init.uniform_(getattr(self, f"{kind}{layer}"))

    @classmethod
    def of(cls, shape: ModuleShape) -> Self:
        """The pool of ``shape`` (common/model/trainable.py's protocol; every subclass takes these
        constructor arguments)."""
        return cls(shape.embed_dim, list(shape.layers), shape.pool_size, shape.length, shape.num_tasks)

    @property
    def tokens_per_block(self) -> int:
        """Prompt-tuning inserts L tokens in each prompted block."""
        return self.length

    def configure(self, options: Mapping[str, Any]) -> None:
        """Read the method options that shape the forward pass from the run's namespaced options
        (``options``: ``<method>.<option>`` keys, ``ExperimentConfig.method``) (hook; called by
        ``build_model``, so clients, evaluators and the server build the same module). Default:
        nothing to read."""

    def check_backbone(self, backbone: Any) -> None:
        """Any backbone ``check_blocks`` accepts: a prompt reads no projection's shape."""

    def in_block(self, layer: int, block: nn.Module, query: torch.Tensor) -> tuple[BlockForward, torch.Tensor]:
        """The block's own forward, and this block's prompt (B, L, D) for query ``query``."""
        return partial(block_forward, block), self(query, layer)

    def slice_of(self, task: int) -> slice:
        return slice(task * self.per_task, (task + 1) * self.per_task)

    def init_task_slice(self, task: int, generator: torch.Generator, orthogonal: bool = True) -> None:
        """(Re)initialise the components of ``task``: orthogonal to all earlier slices."""
        s = self.slice_of(task)
        with torch.no_grad():
            for layer in self.layers:
                for kind in self.kinds:
                    param = getattr(self, f"{kind}{layer}")
                    fresh = torch.randn(param[s].shape, generator=generator)
                    if orthogonal:
                        fresh = gram_schmidt_rows(fresh, param[: s.start])
                    else:
                        fresh = fresh * (1.0 / math.sqrt(fresh[0].numel()))
                    param[s] = fresh

    def set_task(self, task: int) -> None:
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"task {task} out of range [0, {self.num_tasks})")
        self.task = task

    def _active(self, kind: str, layer: int, train: bool) -> torch.Tensor:
        """Components of slices 0..task; earlier slices detached while training."""
        param = getattr(self, f"{kind}{layer}")
        s = self.slice_of(self.task)
        if train:
            return torch.cat([param[: s.start].detach(), param[s]], dim=0)
        return param[: s.stop]

    def weights(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """alpha (B, M_active): cosine of the attended query with each key."""
        train = self.training
        keys, attn = self._active("k", layer, train), self._active("a", layer, train)
        attended = query[:, None, :] * attn[None]  # (B, M, D)
        return torch.einsum("bmd,md->bm", F.normalize(attended, dim=-1), F.normalize(keys, dim=-1))

    def forward(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """Prompt (B, L, D) for ``layer``."""
        alpha = self.weights(query, layer)
        comps = self._active("p", layer, self.training)
        return torch.einsum("bm,mld->bld", alpha, comps)

    def orthogonality_penalty(self) -> torch.Tensor:
        """CODA-P's ||K K^T - I||^2 style regulariser (off by default; kept for the code's option)."""
        total = torch.zeros(())
        for layer in self.layers:
            for kind in self.kinds:
                m = self._active(kind, layer, True).reshape(-1, self.embed_dim * (self.length if kind == "p" else 1))
                gram = m @ m.T
                total = total + ((gram - torch.eye(len(m))) ** 2).mean()
        return total


# ---------------------------------------------------------------------------- prompted ViT
def check_blocks(backbone: Backbone, layers: list[int]) -> None:
    """Refuse a backbone whose prompted blocks the prefix / prompt path would not reproduce.

    ``common.vit.block_forward`` is timm's ``vision_transformer.Block`` and ``Attention``
    forward (pre-norm, layer scale, drop path; q/k norm, scale norm, gated output); blocks of
    common/model/vit.py's ViT or of timm's are accepted, any other class (or a subclass, which may
    change the forward) is refused rather than silently run without what it adds.
    """
    for i in layers:
        block = backbone.blocks[i]
        attn = getattr(block, "attn", None)
        if type(block) is OurBlock and type(attn) is OurAttention:
            continue  # checked first: a backbone read from the disk cache never imports timm
        # timm only for a timm-built backbone (a cached one never imports it)
        from timm.models.vision_transformer import Attention, Block

        if type(block) is not Block or type(attn) is not Attention:
            raise ConfigError(
                f"block {i} of this backbone is {type(block).__module__}.{type(block).__name__} with attention "
                f"{type(attn).__name__}; prompts are inserted only into timm's vision_transformer "
                "Block / Attention (or common/model/vit.py's), whose forward the prompted path reproduces")


class PromptedViT(nn.Module):
    """Frozen ViT + the method's trainable module (CODA-P prompts, or low-rank adapters:
    common/model/adapters.py) + one linear head (over all classes, or a block per task).

    ``forward(images, query)`` returns logits over all classes; masking to the
    current task (training) or to the seen classes (evaluation) is the caller's,
    via :func:`masked_logits`.
    """

    def __init__(self, backbone: Backbone, prompt: TrainableModule, num_classes: int, mode: str = "prefix",
                 input_norm: str = "backbone", interpolation: str = "bilinear", eval_crop: float = 1.0,
                 tokens: str = "truncate") -> None:
        super().__init__()
        self.backbone, self.prompt, self.mode = backbone, prompt, mode
        if tokens not in ("truncate", "accumulate"):
            raise ValueError(f"prompt tokens {tokens!r}")
        self.tokens = tokens
        # a node's memory plan (common/node/memory_plan.py): recompute the blocks prompts back-propagate
        # through instead of keeping their activations, and run no-grad passes in chunks of at most
        # ``max_batch`` images (0: whole batches); neither changes what is computed
        self.checkpointed: frozenset[int] = frozenset()  # indices of the blocks recomputed in the backward pass
        self.max_batch = 0
        self.embed_dim = int(backbone.embed_dim)
        depth = len(backbone.blocks)
        bad = [layer for layer in prompt.layers if layer >= depth]
        if bad:
            raise ConfigError(f"prompt-layers {bad} do not exist in a backbone of depth {depth}")
        check_blocks(backbone, prompt.layers)
        prompt.check_backbone(backbone)
        if mode == "prefix" and self.embed_dim % backbone.blocks[0].attn.num_heads:
            raise ConfigError("embed dim not divisible by heads")
        self.head = nn.Linear(self.embed_dim, num_classes)
        cfg = getattr(backbone, "pretrained_cfg", {}) or {}
        self.inputs = InputPipeline(
            int(backbone.patch_embed.img_size[0]), int(backbone.patch_embed.proj.in_channels),
            tuple(cfg.get("mean", (0.5, 0.5, 0.5))), tuple(cfg.get("std", (0.5, 0.5, 0.5))),
            input_norm, interpolation, eval_crop)

    # -- parameters that travel ------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The parameters clients train and exchange: prompt components, keys, attention, head."""
        return {f"prompt.{k}": v for k, v in self.prompt.state_dict().items()} | {
            f"head.{k}": v for k, v in self.head.state_dict().items()
        }

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.trainable_state())
        if set(state) != expected:
            raise ValueError(f"trainable state keys differ: missing {expected - set(state)}, "
                             f"extra {set(state) - expected}")
        self.prompt.load_state_dict({k[7:]: v for k, v in state.items() if k.startswith("prompt.")})
        self.head.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("head.")})

    def train(self, mode: bool = True) -> PromptedViT:
        super().train(mode)
        self.backbone.eval()  # frozen: dropout/droppath stay off
        return self

    # -- forward ------------------------------------------------------------------
    def preprocess(self, images: torch.Tensor, crops: torch.Tensor | None = None,
                   evaluation: bool = False) -> torch.Tensor:
        """uint8 (B, C, H, W) -> inputs at the backbone's size, channels and normalisation
        (``crops``: training views; ``evaluation``: evaluation's central crop; see ``InputPipeline``)."""
        return self.inputs(images, crops, evaluation)

    @torch.no_grad()
    def query(self, x: torch.Tensor) -> torch.Tensor:
        """q(x): final-layer CLS feature of the frozen backbone without prompts; (B, 0) for a module
        that reads none (adapters), so no frozen pass is spent on it."""
        if not self.prompt.uses_query:
            return x.new_zeros(len(x), 0)
        b = self.backbone
        return self._chunked(lambda xs: b.forward_head(b.forward_features(xs[0]), pre_logits=True), x)

    def _chunked(self, fn: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
                 *inputs: torch.Tensor) -> torch.Tensor:
        """``fn(inputs)``, in chunks of ``max_batch`` rows when no gradient is recorded (each image is
        computed alone, so only the activations' peak changes)."""
        rows = len(inputs[0])
        if not self.max_batch or rows <= self.max_batch or torch.is_grad_enabled():
            return fn(inputs)
        return torch.cat([fn(tuple(t[s : s + self.max_batch] for t in inputs))
                          for s in range(0, rows, self.max_batch)])

    def features(self, x: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """Prompted pre-logit feature (B, D).

        Prefix-tuning prepends a block's prompt to its keys and values. Prompt-tuning inserts
        the prompt's L tokens after CLS; with ``tokens = "truncate"`` they are removed after the
        block (FPPL's code), with ``"accumulate"`` they stay in the sequence through every later
        block, each prompted block adding its own (Powder's code, whose ViT prepends them and
        reads CLS behind them: the same attention), and are removed only before the final norm,
        so the head reads CLS (or the patch mean) as without prompts.

        A block in ``checkpointed`` that gradients pass through keeps only its input for the
        backward pass and runs again there (``torch.utils.checkpoint``, non-reentrant): the same
        gradients, one block's activations at a time instead of every block's.
        """
        return self._chunked(lambda xs: self._features(xs[0], xs[1]), x, query)

    def _features(self, x: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        b = self.backbone
        tokens = b.norm_pre(b.patch_drop(b._pos_embed(b.patch_embed(x))))
        prompted = set(self.prompt.layers)
        carried = 0  # accumulated prompt tokens, right after CLS
        run = self._run_block
        for i, block in enumerate(b.blocks):
            if i not in prompted:
                tokens = run(i, block, tokens)
                continue
            forward, prompt = self.prompt.in_block(i, block, query)
            if prompt is None:  # a module inside the block's projections (adapters): no tokens added
                tokens = run(i, forward, tokens)
            elif self.mode == "prefix":
                tokens = run(i, forward, tokens, prompt)
            else:
                n = prompt.shape[1]
                extended = torch.cat([tokens[:, :1], prompt, tokens[:, 1:]], dim=1)
                out = run(i, forward, extended)
                if self.tokens == "accumulate":
                    tokens, carried = out, carried + n
                else:
                    tokens = torch.cat([out[:, :1], out[:, 1 + n :]], dim=1)
        if carried:
            tokens = torch.cat([tokens[:, :1], tokens[:, 1 + carried :]], dim=1)
        return b.forward_head(b.norm(tokens), pre_logits=True)

    def _run_block(self, index: int, block: Callable[..., torch.Tensor], tokens: torch.Tensor,
                   *prefix: torch.Tensor) -> torch.Tensor:
        """``block(tokens, *prefix)``, checkpointed where the plan says so and a gradient passes through it."""
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (tokens, *prefix))
        if not (index in self.checkpointed and grad):
            return block(tokens, *prefix)
        return checkpoint(block, tokens, *prefix, use_reentrant=False)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Scores over all classes of pre-logit ``features``: the head's (a module may score otherwise:
        its ``logits(head, features)``, PILoRA's distances to prototypes held in the head's rows)."""
        scorer = getattr(self.prompt, "logits", None)
        return self.head(features) if scorer is None else scorer(self.head, features)

    def forward(self, x: torch.Tensor, query: torch.Tensor | None = None) -> torch.Tensor:
        if query is None:
            query = self.query(x)
        return self.logits(self.features(x, query))


def masked_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits with every class outside ``allowed`` (bool mask over classes) set to -inf."""
    return logits.masked_fill(~allowed.to(logits.device)[None, :], float("-inf"))


@dataclass(frozen=True)
class ModelSpec:
    """What building the prompted model reads of a run: its backbone, prompt, head and inputs.

    Parameters
    ----------
    backbone : BackboneSpec
        The frozen backbone.
    seed : int
        Seeds the prompt's and the head's initialisation.
    layers, pool_size, prompt_length, num_tasks
        The prompt (CodaPrompt's constructor arguments).
    head_size : int
        Outputs of the head (``TaskLayout.head_size``).
    prompt_mode, input_norm, resize_interpolation, eval_crop, prompt_tokens
        The forward pass (``prompt_tokens``: "auto" leaves it to the prompt module).
    method : mapping
        The run's namespaced method options (``<method>.<option>``), read by the prompt's ``configure``.
    """

    backbone: BackboneSpec
    seed: int
    layers: tuple[int, ...]
    pool_size: int
    prompt_length: int
    num_tasks: int
    head_size: int
    prompt_mode: str
    input_norm: str
    resize_interpolation: str
    eval_crop: float
    prompt_tokens: str
    method: Mapping[str, Any]

    @classmethod
    def of(cls, backbone: BackboneSpec, layout: TaskLayout, run: sections.RunSection, model: sections.ModelSection,
           evaluation: sections.EvaluationSection, method: Mapping[str, Any]) -> ModelSpec:
        """The model of a run of these sections: ``backbone``, a head for ``layout``, ``method``: the
        run's namespaced method options."""
        m = model
        return cls(backbone, run.seed, tuple(m.layers), m.pool_size, m.prompt_length, layout.num_tasks,
                   layout.head_size, m.prompt_mode, m.input_norm, m.resize_interpolation, evaluation.eval_crop,
                   m.prompt_tokens, method)


def build_model(
    spec: ModelSpec, prompt_class: type[TrainableModule] | None = None, precision: str = "fp32",
) -> tuple[PromptedViT, str]:
    """Backbone + prompt (CODA-P unless a method gives its own) + head (``head_size`` outputs:
    one per class, or a block per task); seeded init. ``precision``: the frozen backbone's, a
    node's own choice (common/model/low_precision.py)."""

    backbone, source = build_backbone(spec.backbone)
    if precision != "fp32":
        cached = backbone_cache_path(spec.backbone)
        lower_precision(backbone, precision, str(cached) if cached is not None else None)
        source += f" (frozen linear layers in {precision}, this node's choice)"
    state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    prompt = (prompt_class or CodaPrompt).of(
        ModuleShape(int(backbone.embed_dim), tuple(spec.layers), spec.num_tasks, spec.pool_size, spec.prompt_length))
    prompt.configure(spec.method)
    tokens = prompt.prompt_tokens if spec.prompt_tokens == "auto" else spec.prompt_tokens
    model = PromptedViT(backbone, prompt, spec.head_size, spec.prompt_mode,
                        spec.input_norm, spec.resize_interpolation, spec.eval_crop, tokens)
    torch.random.set_rng_state(state)
    return model, source


def initial_trainable_state(spec: ModelSpec,
                            prompt_class: type[TrainableModule] | None = None) -> dict[str, torch.Tensor]:
    """The initial prompt and head parameters, built without data or backbone weights.

    Their initialisation is seeded and independent of the backbone's weights, so a randomly
    initialised backbone of the same architecture gives exactly the parameters every node
    builds; a server that holds no weights (deployment) starts from these.
    """
    model, _ = build_model(replace(spec, backbone=replace(spec.backbone, weights="random")), prompt_class)
    return model.trainable_state()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ConfigError("device=mps but MPS is not available")
    return torch.device(name)
