"""``y = x Wᵀ`` for one projection, optionally over weights packed once for oneDNN on CPU.

Every call of ``F.linear`` on CPU hands oneDNN a plain row-major weight, which it re-blocks on
the fly; a decode step reads each weight once, so that re-blocking is a second pass over all
of them. Packing the weights once after loading (``torch.ops.mkldnn._reorder_linear_weight``,
the same op torch's own CPU compiler uses for frozen weights) removes it. Measured on the
2-core bench machine, 28 layers' weights, 2 threads: bf16 decode-sized matmuls (1–16 rows)
1.3–1.9x faster, 64 rows 1.15–1.25x, 512 rows ~1.05x; float32 1.6–2.3x for 1–64 rows; the
bf16 results are bit-identical, float32 differ only in summation order.

A weight may be a view into a fused parameter (q/k/v rows of ``qkv``): packing copies it, and
the plain view is dropped so the parameter's memory can be released (``Qwen3.pack_weights``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can run packed oneDNN linears in ``dtype``."""
    if device.type != "cpu" or dtype not in _TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        if dtype == torch.bfloat16:
            return bool(ops._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(ops._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
    return True


class Linear:
    """One projection's weight [out, in] and how to apply it (plain or packed)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)

    def pack(self, keep_plain: bool = False) -> bool:
        """Pack the weight for oneDNN; False (and unchanged) when that fails its self-check.

        ``keep_plain``: keep the plain weight too (the tied LM head is also the embedding).
        """
        weight = self.weight
        if weight is None or self.packed is not None:
            return self.packed is not None
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "").float()
        except (RuntimeError, AttributeError):
            return False
        want = F.linear(probe, weight).float()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=_TOLERANCE[weight.dtype], atol=_TOLERANCE[weight.dtype]):
            return False
        self.packed = packed
        if not keep_plain:
            self.weight = None
        return True


def pack_and_release(linears: list[Linear], params: list[nn.Parameter]) -> bool:
    """Pack every linear; only when all succeed, release the parameters they were views of."""
    if not all(linear.pack(keep_plain=True) for linear in linears):
        for linear in linears:
            linear.packed = None
        return False
    for linear in linears:
        linear.weight = None
    for param in params:
        param.data = param.data.new_empty(0)
    return True
