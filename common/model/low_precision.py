"""Lower-precision frozen backbones, a node's own choice (node-config ``backbone-precision``).

Never the default: a node that chooses one trains with a backbone that computes differently
from its peers' (docs/edge.md has the measured accuracy change). Prompts, head and optimiser
stay float32 whatever the choice.

* ``bf16``: the backbone's linear weights kept in bfloat16 (half the memory), computed in
  float32 (:class:`Bf16Linear`): the run's own arithmetic on rounded weights, at float32 speed.
  (bfloat16 autocast, the run's ``precision = "bf16"``, is another matter: it computes in
  bfloat16, which a CPU without bfloat16 instructions runs many times slower.)
* ``int8``: dynamic quantisation of the frozen linear layers (per-channel int8 weights,
  activations quantised per call; PyTorch's fbgemm / qnnpack kernels, CPU only). PyTorch's
  quantised linear has no backward; :class:`Int8Linear` adds one (the input's gradient through
  the dequantised weight), since prompts back-propagate through frozen blocks.

The float32 weights being replaced come from the node's memory-mapped backbone cache
(common/model/backbone.py); their pages are handed back to the kernel layer by layer
(:func:`release_pages`), so converting does not hold a float32 copy and the new one at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import warnings
from typing import Any

import torch
from torch import nn

from ..node.memory_plan import file_mappings

PRECISIONS = ("fp32", "bf16", "int8")


class _Int8Linear(torch.autograd.Function):
    """y = x W^T + b with an int8 W (dynamic quantisation); dy/dx through W dequantised."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.packed = packed
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.quantized.linear_dynamic(flat.float(), packed, True)  # reduce_range: fbgemm's default
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        weight, _ = torch.ops.quantized.linear_unpack(ctx.packed)  # one layer's weight, for this product only
        return grad @ weight.dequantize().to(grad.dtype), None


class _Bf16Linear(torch.autograd.Function):
    """y = x W^T + b with W stored in bfloat16 and computed in float32; dy/dx through the same W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.weight = weight  # the bfloat16 tensor: the float copy below lives for this product only
        return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        return grad @ ctx.weight.to(grad.dtype), None, None


class Bf16Linear(nn.Module):
    """A frozen ``nn.Linear`` whose weights are kept in bfloat16 (half the memory) and computed in
    float32: exact float32 arithmetic on rounded weights, at float32 speed on any CPU (bfloat16
    matrix products run 4-40x slower than float32 on a CPU without AVX512-BF16 or AMX, measured here).

    Parameters
    ----------
    linear : nn.Linear
        The float layer; its weights are rounded, not kept.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Bf16Linear.apply(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """A frozen ``nn.Linear`` with per-channel int8 weights (symmetric), differentiable in its input.

    Parameters
    ----------
    linear : nn.Linear
        The float layer; its weights are quantised, not kept.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        zero = torch.zeros(len(scale), dtype=torch.long)
        with warnings.catch_warnings():  # deprecated in favour of torchao, which this project does not install
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.packed = torch.ops.quantized.linear_prepack(qweight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Int8Linear.apply(x, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def lower_precision(backbone: nn.Module, precision: str, mapped_file: str | None = None) -> nn.Module:
    """``backbone`` with its frozen linear layers in ``precision`` (in place; ``fp32``: unchanged).

    ``mapped_file``: the backbone cache file the float32 weights are memory-mapped from (their
    pages are released as each layer is converted); None where they are not mapped.

    Raises
    ------
    ValueError
        An unknown precision, or int8 without a quantised CPU engine.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"backbone-precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return backbone
    if precision == "int8" and not torch.backends.quantized.supported_engines:
        raise ValueError("backbone-precision = int8 needs a quantised CPU engine (fbgemm or qnnpack)")
    for parent in list(backbone.modules()):
        for name, child in list(parent.named_children()):
            # the float tensors themselves (``to`` swaps a parameter's data, not the parameter)
            old = [t.detach() for t in (getattr(child, "weight", None), getattr(child, "bias", None))
                   if isinstance(t, torch.Tensor)]
            if precision == "int8" and type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
                release_pages(mapped_file, *old)
            elif precision == "bf16" and type(child) is nn.Linear:
                setattr(parent, name, Bf16Linear(child))
                release_pages(mapped_file, *old)
    return backbone


# ---------------------------------------------------------------------------- memory-mapped pages
_MADV_DONTNEED = 4


def release_pages(mapped_file: str | None, *tensors: torch.Tensor | None) -> None:
    """Hand back to the kernel the pages of ``tensors`` that lie in a private mapping of ``mapped_file``.

    Only pages inside a mapping of that file (the node's backbone cache, mapped private and never
    written: frozen weights) are dropped: the process's page table forgets them and a later read faults them in
    from the file again, so nothing changes but this process's resident memory. Anonymous memory
    is never touched (dropping it would zero it). Linux only; elsewhere nothing happens.
    """
    if mapped_file is None or not sys.platform.startswith("linux"):
        return
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors
             if t is not None and t.device.type == "cpu" and t.numel()]
    if not spans:
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    for low, high in file_mappings(mapped_file):
        for start, end in spans:
            a, b = max(start, low), min(end, high)
            a = (a + page - 1) // page * page  # whole pages inside the tensor only
            b = b // page * page
            if b > a:
                libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)


__all__ = ["Bf16Linear", "Int8Linear", "PRECISIONS", "lower_precision", "release_pages"]
