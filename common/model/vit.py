"""A standard Vision Transformer that loads timm's weights without importing timm.

``import timm`` (which imports torchvision, whose ops import ``torch._dynamo``) and
``timm.create_model`` are a large part of a fresh ClientApp process's start. This module
mirrors timm 1.0's standard ``VisionTransformer`` (``timm/models/vision_transformer.py``,
``timm/layers/{patch_embed,attention,mlp}.py``) op for op, with exactly timm's parameter
names, so a timm state dict loads into it with ``strict=True`` and its outputs are
bit-identical. ``build_backbone`` keeps one converted backbone per node on disk and a fresh
process builds this class from it.

Scope: class token, learned position embedding that includes the class token, token
pooling, pre-norm blocks, GELU MLP, LayerNorm, qkv bias. No register tokens, layer scale,
q/k norm, fc-norm or dynamic image size: :func:`from_timm` refuses a timm model with any
of them, and the caller then keeps timm's own model.

Reads top to bottom: ``attention_forward`` (the one attention implementation, with
optional prefix keys/values for prompts) -> ``PatchEmbed`` -> ``Attention`` -> ``Mlp`` ->
``Block`` -> ``VisionTransformer`` -> ``from_timm`` / ``from_state``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- forwards
# The forward functions and timm's readers take ``Any``: they read timm's modules or ours by their
# attributes, which torch types as ``Tensor | Module``

#: a low-rank adapter's hook into a block: ``adapt(name, x, y)`` is projection ``name``'s output ``y``
#: ("qkv", "proj", "fc1" or "fc2", computed from its input ``x``) with the adapter's delta added
#: (common/model/adapters.py); a projection it does not adapt comes back as it is. ``y`` is the projection's
#: fresh output, which the hook may update in place
Adapt = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_forward(attn: Any, x: torch.Tensor, prefix: torch.Tensor | None = None,
                      adapt: Adapt | None = None) -> torch.Tensor:
    """timm's ``Attention.forward`` (fused path), with optional prefix keys/values.

    Runs on this module's :class:`Attention` and on timm's ``vision_transformer``
    Attention alike (same attribute names), so prompted blocks of either backbone go
    through this one function.

    Parameters
    ----------
    attn : nn.Module
        An attention module with ``qkv``, ``num_heads``, ``head_dim``, ``q_norm``,
        ``k_norm``, ``attn_drop``, ``norm``, ``proj``, ``proj_drop`` (and timm's optional ``gate``).
    x : torch.Tensor
        Tokens (B, N, D).
    prefix : torch.Tensor, optional
        Prefix-tuning prompt (B, L, D): the first L/2 tokens are prepended to the keys,
        the last L/2 to the values (sequence length unchanged).
    adapt : Adapt, optional
        Low-rank adapters of the qkv and output projections (:data:`Adapt`).

    Returns
    -------
    torch.Tensor
        (B, N, D).
    """
    B, N, _ = x.shape
    gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
    qkv = attn.qkv(x) if adapt is None else adapt("qkv", x, attn.qkv(x))
    qkv = qkv.reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = attn.q_norm(q), attn.k_norm(k)
    if prefix is not None:
        half = prefix.shape[1] // 2
        heads, head_dim = int(attn.num_heads), int(attn.head_dim)
        pk = prefix[:, :half].reshape(B, half, heads, head_dim).transpose(1, 2)
        pv = prefix[:, half:].reshape(B, half, heads, head_dim).transpose(1, 2)
        k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=attn.attn_drop.p if attn.training else 0.0)
    out = out.transpose(1, 2).reshape(B, N, attn.num_heads * attn.head_dim)
    norm = getattr(attn, "norm", None)  # timm added the scale norm within 1.0.x
    out = norm(out) if norm is not None else out
    if gate is not None:
        out = out * gate
    return attn.proj_drop(attn.proj(out) if adapt is None else adapt("proj", out, attn.proj(out)))


def mlp_forward(mlp: Any, x: torch.Tensor, adapt: Adapt) -> torch.Tensor:
    """timm's ``Mlp.forward`` (fc1, act, drop, norm, fc2, drop) with adapted ``fc1`` and ``fc2``."""
    h = mlp.norm(mlp.drop1(mlp.act(adapt("fc1", x, mlp.fc1(x)))))
    return mlp.drop2(adapt("fc2", h, mlp.fc2(h)))


def block_forward(block: Any, x: torch.Tensor, prefix: torch.Tensor | None = None,
                  adapt: Adapt | None = None) -> torch.Tensor:
    """timm's pre-norm ``Block.forward``, its attention through :func:`attention_forward` (and its
    MLP through :func:`mlp_forward` when ``adapt`` is given)."""
    x = x + block.drop_path1(block.ls1(attention_forward(block.attn, block.norm1(x), prefix, adapt)))
    h = block.norm2(x)
    return x + block.drop_path2(block.ls2(block.mlp(h) if adapt is None else mlp_forward(block.mlp, h, adapt)))


# ---------------------------------------------------------------------------- modules
class PatchEmbed(nn.Module):
    """timm ``layers.PatchEmbed`` with ``flatten=True``, no norm, strict image size."""

    def __init__(self, img_size: tuple[int, int], patch_size: tuple[int, int], in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.img_size = (int(img_size[0]), int(img_size[1]))
        self.patch_size = (int(patch_size[0]), int(patch_size[1]))
        self.grid_size = (self.img_size[0] // self.patch_size[0], self.img_size[1] // self.patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.norm = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != self.img_size:
            raise ValueError(f"input size {tuple(x.shape[-2:])} does not match the model's {self.img_size}")
        return self.norm(self.proj(x).flatten(2).transpose(1, 2))  # NCHW -> NLC


class Attention(nn.Module):
    """timm ``layers.Attention`` with qkv bias, no q/k norm, no scale norm, no gate."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.attn_dim = num_heads * self.head_dim
        self.qkv = nn.Linear(dim, self.attn_dim * 3)
        self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.proj = nn.Linear(self.attn_dim, dim)
        self.proj_drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return attention_forward(self, x)


class Mlp(nn.Module):
    """timm ``layers.Mlp``: fc1 -> GELU -> fc2."""

    def __init__(self, dim: int, hidden: int, approximate: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate=approximate)
        self.drop1 = nn.Dropout(0.0)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.norm(self.drop1(self.act(self.fc1(x))))))


class Block(nn.Module):
    """timm ``vision_transformer.Block`` without layer scale or drop path."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, eps: float, approximate: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads)
        self.ls1, self.drop_path1 = nn.Identity(), nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, mlp_hidden, approximate)
        self.ls2, self.drop_path2 = nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block_forward(self, x)


class VisionTransformer(nn.Module):
    """timm's standard ``VisionTransformer`` with ``num_classes=0`` (the head is Identity).

    Parameters
    ----------
    img_size, patch_size : tuple of int
        (H, W) of the input and of a patch.
    in_chans, embed_dim, depth, num_heads, mlp_hidden : int
        Input channels, token width, blocks, heads, MLP hidden width.
    eps : float
        LayerNorm epsilon (timm's ViT: 1e-6).
    gelu : str
        ``approximate`` of the MLP's GELU ("none" or "tanh").
    mean, std : tuple of float
        Input normalisation, exposed as ``pretrained_cfg`` like timm's.
    """

    def __init__(self, img_size: tuple[int, int], patch_size: tuple[int, int], in_chans: int, embed_dim: int,
                 depth: int, num_heads: int, mlp_hidden: int, eps: float, gelu: str,
                 mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.embed_dim = self.num_features = embed_dim
        self.num_prefix_tokens = 1
        self.global_pool = "token"
        self.pretrained_cfg = {"mean": tuple(mean), "std": tuple(std)}
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(0.0)
        self.patch_drop, self.norm_pre = nn.Identity(), nn.Identity()
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads, mlp_hidden, eps, gelu) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim, eps=eps)
        self.fc_norm = nn.Identity()
        self.head_drop = nn.Dropout(0.0)
        self.head = nn.Identity()

    def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
        # timm's "concat then add": pos_embed has an entry for the class token
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.pos_drop(x + self.pos_embed)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_pre(self.patch_drop(self._pos_embed(self.patch_embed(x))))
        return self.norm(self.blocks(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.head_drop(self.fc_norm(x[:, 0]))  # token pooling: the class token
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


# ---------------------------------------------------------------------------- building
def from_state(arch: dict[str, Any], state: dict[str, torch.Tensor]) -> VisionTransformer:
    """Our ViT with ``arch``'s constructor arguments and ``state``'s tensors, frozen, in eval mode.

    Built on the meta device and the tensors assigned, so nothing is initialised only to be
    overwritten. Raises (TypeError, ValueError, RuntimeError) when arch or state do not fit.
    """
    with torch.device("meta"):
        model = VisionTransformer(**arch)
    model.load_state_dict(state, strict=True, assign=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def architecture(model: Any) -> dict[str, Any]:
    """Constructor arguments of :class:`VisionTransformer` read from a built timm ViT (plain types)."""
    block = model.blocks[0]
    cfg = getattr(model, "pretrained_cfg", None) or {}
    return {
        "img_size": [int(v) for v in model.patch_embed.img_size],
        "patch_size": [int(v) for v in model.patch_embed.patch_size],
        "in_chans": int(model.patch_embed.proj.in_channels),
        "embed_dim": int(model.embed_dim),
        "depth": len(model.blocks),
        "num_heads": int(block.attn.num_heads),
        "mlp_hidden": int(block.mlp.fc1.out_features),
        "eps": float(model.norm.eps),
        "gelu": str(getattr(block.mlp.act, "approximate", "none")),
        "mean": [float(v) for v in cfg.get("mean", (0.5, 0.5, 0.5))],
        "std": [float(v) for v in cfg.get("std", (0.5, 0.5, 0.5))],
    }


def from_timm(model: Any) -> tuple[VisionTransformer | None, str]:
    """Our ViT with a built timm ViT's architecture and weights, checked to compute the same.

    Parameters
    ----------
    model : nn.Module
        A timm ``VisionTransformer`` (with ``num_classes=0``).

    Returns
    -------
    (VisionTransformer or None, str)
        The converted model (frozen, eval) and "", or None and why it cannot be converted:
        a structure outside this module's scope, a state dict that does not load strictly, or
        a probe batch whose features are not bit-identical to timm's.
    """
    try:
        refusal = _unsupported(model)
        if refusal:
            return None, refusal
        arch = architecture(model)
        ours = from_state(arch, {k: v.detach().clone() for k, v in model.state_dict().items()})
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
        return None, f"it does not load into the standard ViT ({type(exc).__name__}: {exc})"
    probe = torch.randn(2, arch["in_chans"], *arch["img_size"], generator=torch.Generator().manual_seed(0))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            theirs = model.forward_head(model.forward_features(probe), pre_logits=True)
            mine = ours.forward_head(ours.forward_features(probe), pre_logits=True)
    finally:
        model.train(was_training)
    if theirs.shape != mine.shape or not torch.equal(theirs, mine):
        return None, "its features on a probe batch are not bit-identical to timm's"
    return ours, ""


def _unsupported(model: Any) -> str:
    """Why ``model`` is outside the standard ViT this module mirrors ("" when it is not)."""
    if type(model).__name__ != "VisionTransformer" or not hasattr(model, "blocks") or not len(model.blocks):
        return f"{type(model).__name__} is not timm's VisionTransformer"
    if getattr(model, "num_reg_tokens", 0) or getattr(model, "num_prefix_tokens", 1) != 1:
        return "it has register tokens"
    for attr, wanted in (("global_pool", "token"), ("has_class_token", True), ("no_embed_class", False),
                         ("dynamic_img_size", False), ("pool_include_prefix", False)):
        if getattr(model, attr, wanted) != wanted:
            return f"{attr} = {getattr(model, attr)!r} (only {wanted!r} is supported)"
    pe = model.patch_embed
    if not getattr(pe, "flatten", False) or getattr(pe, "dynamic_img_pad", False) or pe.img_size is None:
        return "its patch embedding is not the flattening, fixed-size one"
    if any(getattr(block.attn, "gate", None) is not None for block in model.blocks):
        return "its attention is gated"
    # Every submodule must be of the kind ours has at the same name (LayerScale or a q/k norm
    # where ours has Identity, fc_norm, attention pooling, other block or MLP types...).
    with torch.device("meta"):
        ours = VisionTransformer(**architecture(model))
    theirs = {name: type(m).__name__ for name, m in model.named_modules()}
    mine = {name: type(m).__name__ for name, m in ours.named_modules()}
    for name in [*theirs, *(n for n in mine if n not in theirs)]:  # in timm's order
        if theirs.get(name) != mine.get(name):
            return (f"module {name or '(root)'!r} is {theirs.get(name, 'absent')} in timm's model, "
                    f"{mine.get(name, 'absent')} in the standard ViT")
    return ""
