"""AutoAWQ's 4-bit GEMM checkpoint format: its ``quantization_config`` checked strictly, and one
linear's packed tensors unpacked into ``Int4Linear``'s codes, scales and minimums.

Per linear ``<module>``: ``qweight`` [K, N/8] int32, ``qzeros`` [K/G, N/8] int32, ``scales``
[K/G, N] fp16 (K inputs, N outputs, G the group size). Each int32 holds eight 4-bit values of
consecutive outputs ``8j .. 8j+7``, nibble ``i`` (bits 4i..4i+3) holding output ``8j +
AWQ_ORDER[i]``. The weight is ``w[k, n] = (q[k, n] − z[k // G, n]) · s[k // G, n]``, i.e.
``q·s + m`` with ``m = −z·s``: the form ``int4_linear`` keeps.

``int4_checkpoint.py`` maps a checkpoint's linears onto qil's projections and calls ``unpack``.
"""

from __future__ import annotations

from typing import Any

import torch

from qil_worker.config import awq_quantization

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# natural output r of a block of eight sits in nibble AWQ_REVERSE_ORDER[r]
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(r) for r in range(8))
PACK = 8  # 4-bit values per int32


def check_config(raw: dict[str, Any]) -> int:
    """A ``quantization_config`` with ``quant_method: awq`` → its group size; anything but
    4-bit GEMM with zero points is a ``ConfigError`` naming the key (``config.awq_quantization``)."""
    return awq_quantization(raw).group_size


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] in AWQ's interleaved nibble order → uint8 [R, C] in natural order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.to(torch.int32)[..., None] >> shifts) & 15  # [R, C/8, 8] by nibble
    order = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)
    return nibbles[..., order].reshape(packed.shape[0], -1).to(torch.uint8)


def unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
           dtype: torch.dtype, name: str = "linear") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One AWQ linear → (codes uint8 [N, K], scales [N, K/G], mins [N, K/G] in ``dtype``) for
    ``Int4Linear``; a layout that does not fit is a ``ValueError`` naming ``name``'s tensor."""
    k, n8 = qweight.shape
    n = 8 * n8
    want = {"qweight": ((k, n8), torch.int32), "qzeros": ((k // group_size, n8), torch.int32),
            "scales": ((k // group_size, n), None)}
    if k % group_size:
        raise ValueError(f"{name}.qweight: {k} inputs are not a multiple of group_size {group_size}")
    for key, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
        shape, tensor_dtype = want[key]
        if tuple(tensor.shape) != shape or (tensor_dtype is not None and tensor.dtype != tensor_dtype):
            raise ValueError(f"{name}.{key}: expected shape {list(shape)}"
                             f"{'' if tensor_dtype is None else ' int32'}, got {list(tensor.shape)} {tensor.dtype}")
    codes = unpack_columns(qweight).t().contiguous()
    zeros = unpack_columns(qzeros).float()
    scale = scales.float()
    return codes, scale.t().to(dtype).contiguous(), (-zeros * scale).t().to(dtype).contiguous()


# --- the format as ``int4_checkpoint.py`` reads it ----------------------------------------------

LABEL = "awq int4"
SUFFIXES = ("qweight", "qzeros", "scales")


def layout(out_features: int, in_features: int, group_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Per tensor suffix: its shape and kind ("int32" or "float") for a linear [N, K]."""
    n, k, g = out_features, in_features, group_size
    return {"qweight": ((k, n // PACK), "int32"), "qzeros": ((k // g, n // PACK), "int32"), "scales": ((k // g, n), "float")}


def unpackable(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why a linear [N, K] cannot be stored in this format (None: it can)."""
    if out_features % PACK or in_features % group_size:
        return f"needs outputs a multiple of {PACK} and inputs a multiple of group_size {group_size}"
    return None


def unpack_tensors(tensors: dict[str, torch.Tensor], group_size: int, dtype: torch.dtype, name: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``unpack`` over one linear's tensors by suffix."""
    return unpack(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size, dtype, name)
