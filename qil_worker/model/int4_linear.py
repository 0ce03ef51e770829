"""``y = x Wᵀ`` over a weight stored as group-wise asymmetric 4-bit codes (weight-only).

Each output row is cut into groups of ``group_size`` consecutive input columns; group ``g`` of row
``n`` keeps a scale ``s`` and a minimum ``m`` with ``s = (max − min) / 15`` and codes
``q = round((w − m) / s)`` in [0, 15], so that ``w ≈ q·s + m``. Activations stay in the compute
dtype.

torch's int4 kernels take the same codes in their own convention ``w = (q − 8)·s + z``: the zero
they are handed is ``z = m + 8·s`` (``to_kernel_zeros``), with scales and zeros as one tensor
``[in / group_size, out, 2]`` (scale first). Kernels (``KERNELS``):

- ``int4pack``: CPU ``torch._weight_int4pack_mm_for_cpu`` over ``_convert_weight_to_int4pack_for_cpu``
  (``out % 16 == 0``); CUDA ``torch._weight_int4pack_mm`` over ``_convert_weight_to_int4pack``
  where the build has them (bf16 only). Either is used only after a probe at load has matched the
  dequantized weight on a small matrix (``int4pack_supported``): the CUDA path is not exercised by
  this project's tests, and a convention mismatch there falls back rather than computing garbage.
- ``dequantize``: the codes (two per byte) dequantized to the compute dtype on every call, then
  ``F.linear``: the reference semantics, and what runs where ``int4pack`` cannot.

``Int4Linear.from_linear`` quantizes a plain ``Linear``; ``Int4Linear.from_codes`` takes codes,
scales and minimums from elsewhere (an AWQ or GPTQ checkpoint).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

KERNELS = ("int4pack", "dequantize")
GROUP_SIZES = {"int4": 128, "int4-g32": 32}
_INNER_K_TILES = 2
# Rows quantized at a time: bounds the float32 temporaries (an LM head is 151,936 rows).
_QUANTIZE_ROWS = 8192


def quantize_groupwise(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] → (codes uint8 [out, in] in [0, 15], scales [out, in / G], mins
    [out, in / G]), scales and mins in ``scale_dtype``; codes are computed against the stored
    (rounded) scale and min. A constant group gets scale 0 and codes 0."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4: in_features {in_features} is not a multiple of the group size {group_size}")
    groups = in_features // group_size
    codes = torch.empty((out_features, in_features), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((out_features, groups), dtype=scale_dtype, device=weight.device)
    mins = torch.empty((out_features, groups), dtype=scale_dtype, device=weight.device)
    for start in range(0, out_features, _QUANTIZE_ROWS):
        rows = weight[start : start + _QUANTIZE_ROWS].float().view(-1, groups, group_size)
        low = rows.amin(dim=2).to(scale_dtype)
        scale = ((rows.amax(dim=2) - low.float()) / 15).to(scale_dtype)
        stored = scale.float()
        divisor = torch.where(stored > 0, stored, torch.ones_like(stored))
        q = torch.round((rows - low.float()[..., None]) / divisor[..., None]).clamp_(0, 15)
        codes[start : start + _QUANTIZE_ROWS] = q.view(-1, in_features).to(torch.uint8)
        scales[start : start + _QUANTIZE_ROWS] = scale
        mins[start : start + _QUANTIZE_ROWS] = low
    return codes, scales, mins


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q·s + m`` per group, in float32, returned in ``dtype`` (codes uint8 [out, in])."""
    out_features, in_features = codes.shape
    group_size = in_features // scales.shape[1]
    q = codes.float().view(out_features, -1, group_size)
    return (q * scales.float()[..., None] + mins.float()[..., None]).view(out_features, in_features).to(dtype)


def to_kernel_zeros(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """[out, G] scales and mins → torch's ``scales_and_zeros`` [G, out, 2] (zero = m + 8·s)."""
    zeros = mins.float() + 8 * scales.float()
    return torch.stack([scales.float().t(), zeros.t()], dim=-1).to(scales.dtype).contiguous()


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] in [0, 15] → [out, in / 2], the even column in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)


def _convert(codes: torch.Tensor) -> torch.Tensor:
    if codes.device.type == "cpu":
        return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), _INNER_K_TILES)
    # CUDA's converter takes two codes per byte, the even column in the high nibble
    return torch._convert_weight_to_int4pack(((codes[:, 0::2] << 4) | codes[:, 1::2]).contiguous(), _INNER_K_TILES)


def _int4pack_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros)
    return torch._weight_int4pack_mm(x, packed, group_size, scales_zeros)


@functools.cache
def _probe(device: str, dtype: torch.dtype, group_size: int) -> bool:
    """Whether the int4 kernel on ``device`` runs and matches the dequantized weight."""
    if device == "cuda" and dtype != torch.bfloat16:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(32, 2 * group_size, generator=gen)
        codes, scales, mins = quantize_groupwise(weight, group_size, dtype)
        x = torch.randn(3, 2 * group_size, generator=gen).to(dtype)
        codes, scales, mins, x = (t.to(device) for t in (codes, scales, mins, x))
        got = _int4pack_mm(x, _convert(codes), group_size, to_kernel_zeros(scales, mins)).float()
        want = x.float() @ dequantize(codes, scales, mins).t()
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    return bool(((got - want).abs().max() <= tolerance * want.abs().max().clamp(min=1)).item())


def int4pack_supported(out_features: int, in_features: int, group_size: int,
                       device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an int4 kernel can run this shape and dtype on ``device`` (and agrees with the
    dequantized weight: see the module docstring)."""
    if in_features % group_size or out_features % 16 or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return _probe(device.type, dtype, group_size)


def group_size_fits(in_features: int, group_size: int) -> bool:
    """Whether a projection with ``in_features`` inputs can be grouped by ``group_size``."""
    return in_features % group_size == 0


class Int4Linear(nn.Module):
    """One projection's weight as 4-bit codes with a scale and zero per ``group_size`` inputs."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, kernel: str | None = None,
                 label: str = "int4") -> None:
        """``codes`` uint8 [out, in] in [0, 15], ``scales`` and ``mins`` [out, in / G] in the
        compute dtype; ``kernel`` None: ``int4pack`` where supported, else ``dequantize``.
        ``label``: where the codes come from, as ``weight_format`` reports it ("awq int4")."""
        super().__init__()
        if codes.dtype != torch.uint8 or codes.dim() != 2 or scales.shape != mins.shape \
                or scales.shape[0] != codes.shape[0] or codes.shape[1] % scales.shape[1]:
            raise ValueError(f"Int4Linear needs uint8 codes [out, in] and scales and mins [out, in / G], got "
                             f"{codes.dtype} {tuple(codes.shape)}, {tuple(scales.shape)}, {tuple(mins.shape)}")
        self.out_features, self.in_features = codes.shape
        self.group_size = self.in_features // scales.shape[1]
        self._dtype = scales.dtype
        self.label = label
        if kernel is None:
            supported = int4pack_supported(self.out_features, self.in_features, self.group_size, codes.device, scales.dtype)
            kernel = "int4pack" if supported else "dequantize"
        if kernel not in KERNELS:
            raise ValueError(f"unknown int4 kernel {kernel!r}; expected one of {KERNELS}")
        self.kernel = kernel
        if kernel == "int4pack":
            self.register_buffer("weight", _convert(codes))
            self.register_buffer("scales_zeros", to_kernel_zeros(scales, mins))
        else:
            self.register_buffer("weight", pack_nibbles(codes))
            self.register_buffer("scales", scales.contiguous())
            self.register_buffer("mins", mins.contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Module, group_size: int, kernel: str | None = None) -> "Int4Linear":
        """Quantize a plain (not oneDNN-packed) ``Linear``'s weight; scales in its dtype."""
        if getattr(linear, "packed", False):
            raise ValueError("int4 quantization needs the plain weight: quantize before packing for oneDNN")
        weight = linear.weight.data
        return cls(*quantize_groupwise(weight, group_size, weight.dtype), kernel)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations and results)."""
        return self._dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.kernel == "int4pack":
            out = _int4pack_mm(rows.contiguous(), self.weight, self.group_size, self.scales_zeros)
        else:
            weight = (unpack_nibbles(self.weight).view(self.out_features, -1, self.group_size) * self.scales[..., None]
                      + self.mins[..., None]).view(self.out_features, self.in_features)
            out = F.linear(rows, weight)
        return out.view(*x.shape[:-1], self.out_features)

    # Called several times per layer per step: straight to ``forward``, as ``Linear`` does.
    __call__ = forward

    @property
    def weight_format(self) -> str:
        name = "_weight_int4pack_mm" if self.kernel == "int4pack" else "dequantized per call"
        return f"{self.label} asymmetric group {self.group_size} (weight-only, {name})"

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())
