"""GPTQ's 4-bit checkpoint format (AutoGPTQ / optimum, ``checkpoint_format: gptq``, without
act-order), one linear's packed tensors unpacked into ``Int4Linear``'s codes, scales and minimums.

Per linear ``<module>`` (K inputs, N outputs, G the group size): ``qweight`` [K/8, N] int32 packs
eight consecutive *inputs* per int32 (nibble ``i``, bits 4i..4i+3, holding input ``8j + i``);
``qzeros`` [K/G, N/8] int32 packs eight consecutive outputs the same way, each stored as the
zero minus one (the v1 checkpoint convention: the kernels add the one back to the masked
nibble, so a stored 15 means 16); ``scales`` [K/G, N] fp16; ``g_idx`` [K] int32, each input's
group, which without act-order (``desc_act: false``) must be ``k // G``. The weight is
``w[k, n] = (q[k, n] − z[g, n]) · s[g, n]``, ``g = k // G``: ``q·s + m`` with ``m = −z·s``.
"""

from __future__ import annotations

import torch

PACK = 8  # 4-bit values per int32
LABEL = "gptq int4"
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 packed eight 4-bit values per element along ``dim`` (0: rows, 1: columns), natural
    order → uint8 with that dimension eight times longer."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    rows, cols = packed.shape
    if dim == 0:
        nibbles = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 15  # [R, 8, C]
        return nibbles.reshape(rows * PACK, cols).to(torch.uint8)
    nibbles = (packed.to(torch.int32)[..., None] >> shifts) & 15  # [R, C, 8]
    return nibbles.reshape(rows, cols * PACK).to(torch.uint8)


def layout(out_features: int, in_features: int, group_size: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Per tensor suffix: its shape and kind ("int32" or "float") for a linear [N, K]."""
    n, k, g = out_features, in_features, group_size
    return {"qweight": ((k // PACK, n), "int32"), "qzeros": ((k // g, n // PACK), "int32"),
            "scales": ((k // g, n), "float"), "g_idx": ((k,), "int32")}


def unpackable(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why a linear [N, K] cannot be stored in this format (None: it can)."""
    if out_features % PACK or in_features % PACK or in_features % group_size:
        return f"needs outputs and inputs multiples of {PACK} and inputs a multiple of group_size {group_size}"
    return None


def unpack(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, group_size: int,
           dtype: torch.dtype, name: str = "linear") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One GPTQ linear → (codes uint8 [N, K], scales [N, K/G], mins [N, K/G] in ``dtype``) for
    ``Int4Linear``; a ``g_idx`` that is not ``k // G`` (act-order) is a ``ValueError`` naming it."""
    k = qweight.shape[0] * PACK
    if not torch.equal(g_idx.to(torch.int64).cpu(), torch.arange(k) // group_size):
        raise ValueError(f"{name}.g_idx: not k // group_size for every input (act-order, desc_act, is not supported)")
    codes = unpack_nibbles(qweight, 0).t().contiguous()
    zeros = unpack_nibbles(qzeros, 1).float() + 1  # the v1 convention: stored as zero − 1
    scale = scales.float()
    return codes, scale.t().to(dtype).contiguous(), (-zeros * scale).t().to(dtype).contiguous()


def unpack_tensors(tensors: dict[str, torch.Tensor], group_size: int, dtype: torch.dtype, name: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``unpack`` over one linear's tensors by suffix."""
    return unpack(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"], group_size, dtype, name)
