"""4-bit checkpoint tensors written from the formats' definitions (independently of qil's
unpacking code): AutoAWQ GEMM packing of a weight quantized group-wise with zero points."""

from __future__ import annotations

import torch

# AutoAWQ's pack order: nibble i of each int32 holds output 8j + ORDER[i]
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def pack_awq_columns(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] values in [0, 15] → int32 [R, C/8], as AutoAWQ's ``WQLinear_GEMM`` packs."""
    rows, cols = values.shape
    out = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j in range(cols // 8):
        for i in range(8):
            out[:, j] |= values[:, 8 * j + ORDER[i]].to(torch.int64) << (4 * i)
    return out.to(torch.int32) if out.max() < 2**31 else (out - (out >= 2**31) * 2**32).to(torch.int32)


def awq_quantize(weight: torch.Tensor, group: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A [N, K] weight → (AWQ tensors qweight/qzeros/scales, its dequantized weight [N, K]
    float32, ``(q − z)·s`` with the fp16 scale)."""
    n, k = weight.shape
    w = weight.float().t().reshape(k // group, group, n)  # [G, group, N]: groups along inputs
    low, high = w.amin(1), w.amax(1)
    scales = ((high - low).clamp(min=1e-5) / 15).half()
    s = scales.float()
    zeros = torch.round(-low / s).clamp(0, 15)
    q = torch.round(w / s[:, None] + zeros[:, None]).clamp(0, 15)
    dequantized = ((q - zeros[:, None]) * s[:, None]).reshape(k, n).t().contiguous()
    tensors = {"qweight": pack_awq_columns(q.reshape(k, n).long()), "qzeros": pack_awq_columns(zeros.long()),
               "scales": scales}
    return tensors, dequantized
