"""``y = x Wᵀ`` over an FP8 checkpoint's own weights: block-scaled FP8 matmuls on CUDA.

On a GPU whose torch can run DeepSeek-style block-scaled FP8 matmuls (cuBLAS on Hopper, CUDA
12.9+), an ``Fp8Linear`` keeps the checkpoint's float8_e4m3fn weight and its 128x128 block
scales, and quantizes its input per token in groups of 128 columns at every call, as
transformers' fine-grained FP8 kernels do (scale = group amax / 448). Weights then take one byte
each instead of two, and the matmul runs on the FP8 tensor cores.

Which torch entry point runs it is chosen at load by a self-check: each candidate
(``torch.nn.functional.scaled_mm`` with explicit recipes, then the older ``torch._scaled_mm``,
which infers them from the scales' shapes) computes a probe for every projection shape and is
compared with the same FP8 operands multiplied in float32 (``emulated_scaled_mm``). A projection no candidate gets right is dequantized into a plain
``Linear`` instead (``fp8.py``), as everywhere off CUDA.

cuBLAS wants the scales in particular layouts (its "1D and 128x128 2D block scaling"): the
activations' [M, K/128] outer-dim-major (stride 1 along M); the weight's as [L4, N/128] with
stride 1 along K, L4 the K-block count rounded up to 4 (zero padding); and M a multiple of 4,
so inputs are padded by up to 3 rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker.model import fp8
from qil_worker.model.linear import Linear

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
GROUP = 128
# A group of zeros gets this amax instead of 0, so its scale is tiny but not a division by zero.
_MIN_AMAX = 1e-12

# (activations fp8 [M, K], weight fp8 [K, N] column-major, activation scales, weight scales,
#  output dtype) → [M, N]; scales in the cuBLAS layouts of the module docstring.
ScaledMM = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] → (float8_e4m3fn [M, K], float32 scales [M, ceil(K/128)]) with
    ``x ≈ q * scale`` per token and group of 128 columns (the last group ragged where K is not a
    multiple of 128); scale = group amax / 448, so each group's largest value maps to ±448."""
    rows, cols = x.shape
    groups = -(-cols // GROUP)
    padded = F.pad(x, (0, groups * GROUP - cols)) if cols % GROUP else x
    tiles = padded.view(rows, groups, GROUP).to(torch.float32)
    scales = tiles.abs().amax(dim=-1).clamp_(min=_MIN_AMAX).div_(FP8_MAX)
    quantized = tiles.div(scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(rows, groups * GROUP)
    if cols % GROUP:
        quantized = quantized[:, :cols].contiguous()
    return quantized, scales


def activation_scales_layout(scales: torch.Tensor) -> torch.Tensor:
    """[M, G] scales outer-dim-major (stride 1 along M), as cuBLAS reads 1x128 block scales."""
    return scales.t().contiguous().t()


def weight_scales_layout(scale_inv: torch.Tensor) -> torch.Tensor:
    """A checkpoint's [ceil(N/128), L] grid → [L4, ceil(N/128)] with stride 1 along K, L padded
    with zeros to L4 (a multiple of 4), as cuBLAS reads 128x128 block scales."""
    pad = -scale_inv.shape[1] % 4
    return F.pad(scale_inv.to(torch.float32), (0, pad)).t()


def emulated_scaled_mm(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The block-scaled matmul in float32 from the same operands and layouts as the kernels:
    the self-check's reference (and a kernel for CPU tests of ``Fp8Linear``)."""
    cols = a.shape[1]
    groups = -(-cols // GROUP)
    a_scales = scale_a.to(torch.float32).repeat_interleave(GROUP, dim=1)[:, :cols]
    weight_scales = scale_b.t()[:, :groups]  # undo the padding and the transpose: [N/128, L]
    weight = fp8.dequantize(b.t(), weight_scales, torch.float32)
    return (a.to(torch.float32) * a_scales).matmul(weight.t()).to(out_dtype)


def _functional_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    return F.scaled_mm(
        a, b, scale_a=scale_a, scale_recipe_a=F.ScalingType.BlockWise1x128,
        scale_b=scale_b, scale_recipe_b=F.ScalingType.BlockWise128x128, output_dtype=out_dtype,
    )


def _legacy_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)


def cuda_kernels(device: torch.device) -> list[tuple[str, ScaledMM]]:
    """The torch entry points that may run block-scaled FP8 on ``device`` (Hopper or later);
    none elsewhere. Which of them is right is the self-check's to say."""
    if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        return []
    if torch.cuda.get_device_capability(device) < (9, 0):
        return []
    kernels: list[tuple[str, ScaledMM]] = []
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        kernels.append(("torch.nn.functional.scaled_mm", _functional_scaled_mm))
    if hasattr(torch, "_scaled_mm"):
        kernels.append(("torch._scaled_mm", _legacy_scaled_mm))
    return kernels


def _tolerance(dtype: torch.dtype) -> float:
    """Relative to the output's largest magnitude: the output dtype's rounding plus float32
    summation order. A wrong scale layout misses by whole multiples of the scales."""
    return 1e-3 if dtype == torch.float32 else 2e-2


def probe_weight(
    out_features: int, in_features: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random FP8 weight of this shape whose block scales differ by powers of two up to 2^9:
    real checkpoints' scales are too alike for a misread scale layout to show."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.rand(out_features, in_features, generator=generator) * 2 - 1).mul_(FP8_MAX).to(FP8)
    grid = fp8.scale_grid((out_features, in_features), (GROUP, GROUP))
    scale_inv = torch.exp2(torch.randint(-12, -3, grid, generator=generator).float())
    return weight.to(device), scale_inv.to(device)


def self_check(
    kernel: ScaledMM, out_features: int, in_features: int, device: torch.device, out_dtype: torch.dtype
) -> bool:
    """Whether ``kernel`` computes block-scaled matmuls of this shape right: a probe weight
    (``probe_weight``) times inputs of 5 and 64 rows (one padded to a multiple of 4), against the
    same FP8 operands multiplied in float32."""
    weight, scale_inv = probe_weight(out_features, in_features, device)
    scale_b = weight_scales_layout(scale_inv)
    generator = torch.Generator().manual_seed(1)
    for rows in (5, 64):
        probe = torch.randn(rows, in_features, generator=generator).to(device, out_dtype)
        q, scales = quantize_activations(_pad_rows(probe))
        try:
            got = kernel(q, weight.t(), activation_scales_layout(scales), scale_b, out_dtype)
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as exc:
            log.info("FP8 kernel refused a %dx%d weight: %s", out_features, in_features, exc)
            return False
        want = emulated_scaled_mm(q, weight.t(), scales, scale_b, torch.float32)
        if got.shape != want.shape or got.dtype != out_dtype or not torch.isfinite(got).all():
            return False
        error = (got.float() - want).abs().max()
        if error > _tolerance(out_dtype) * want.abs().max():
            return False
    return True


def _pad_rows(x: torch.Tensor) -> torch.Tensor:
    pad = -x.shape[0] % 4
    return F.pad(x, (0, 0, 0, pad)) if pad else x


class Fp8Linear(nn.Module):
    """One projection over a float8_e4m3fn weight [out, in] with 128x128 block scales."""

    weight_format = "float8_e4m3fn block 128x128 (scaled_mm)"
    packed = False  # never packed for oneDNN (see ``packed_weight``)

    def __init__(
        self, weight: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype,
        kernel: ScaledMM, kernel_name: str = "",
    ) -> None:
        super().__init__()
        if weight.dtype != FP8 or scale_inv.shape != fp8.scale_grid(tuple(weight.shape), (GROUP, GROUP)):
            raise ValueError(f"not a 128x128 block-scaled FP8 weight: {weight.dtype} {tuple(weight.shape)}, "
                             f"scales {tuple(scale_inv.shape)}")
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        # stored once in the layout the kernels read (fp8.py's grid, padded and transposed)
        self.weight_scale = nn.Parameter(weight_scales_layout(scale_inv), requires_grad=False)
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        self.kernel = kernel
        self.kernel_name = kernel_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features)
        rows = flat.shape[0]
        q, scales = quantize_activations(_pad_rows(flat))
        y = self.kernel(q, self.weight.t(), activation_scales_layout(scales), self.weight_scale, self.out_dtype)
        return y[:rows].view(*lead, self.out_features)

    __call__ = forward  # as ``Linear``: no hooks on projections

    def weight_bytes(self) -> int:
        """Bytes held for the weight: the FP8 values and their scales."""
        return self.weight.nbytes + self.weight_scale.untyped_storage().nbytes()

    def dequantized(self) -> torch.Tensor:
        """The weight in the output dtype (for comparisons)."""
        scale_inv = self.weight_scale.t()[:, : -(-self.in_features // GROUP)]
        return fp8.dequantize(self.weight, scale_inv, self.out_dtype)

    def packed_weight(self) -> None:
        """``linear.pack_all`` asks every projection; FP8 weights are not packed for oneDNN."""
        return None


def use_fp8(
    model: nn.Module, kept: dict[str, tuple[torch.Tensor, torch.Tensor]],
    kernels: Sequence[tuple[str, ScaledMM]] | None = None,
) -> dict[str, Any]:
    """Swap an ``Fp8Linear`` in for every projection whose rows all come from ``kept`` FP8
    weights (``loader.load_weights(keep_fp8=...)``) and whose block-scaled matmul a kernel
    computes right; dequantize every other kept weight into its parameter view.

    A fused projection (q/k/v, gate/up) concatenates its parts along the output rows: their
    block grids line up only if every part but the last has a multiple of 128 rows; otherwise
    that projection is dequantized. → a summary for the startup log."""
    kernels = cuda_kernels(model.device) if kernels is None else list(kernels)
    targets = model.weight_targets()
    by_storage: dict[int, list[str]] = {}
    for name, view in targets.items():
        by_storage.setdefault(view.untyped_storage().data_ptr(), []).append(name)
    chosen: dict[tuple[int, int], tuple[str, ScaledMM] | None] = {}
    swapped = dequantized = 0
    kernel_names: set[str] = set()
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if not isinstance(child, Linear) or child is getattr(model, "head", None):
                continue
            names = sorted(
                by_storage.get(child.weight.untyped_storage().data_ptr(), []),
                key=lambda n: targets[n].storage_offset(),
            )
            parts = [n for n in names if n in kept]
            if not parts:
                continue
            kernel = None
            if len(parts) == len(names) and all(targets[n].shape[0] % GROUP == 0 for n in names[:-1]):
                weight = _concat_rows([kept[n][0] for n in names])
                scale_inv = torch.cat([kept[n][1] for n in names])
                shape = tuple(weight.shape)
                if shape not in chosen:
                    chosen[shape] = next(
                        ((label, k) for label, k in kernels if self_check(k, *shape, model.device, model.dtype)),
                        None,
                    )
                kernel = chosen[shape]
            if kernel is not None:
                setattr(parent, attr, Fp8Linear(weight, scale_inv, model.dtype, kernel[1], kernel[0]))
                kernel_names.add(kernel[0])
                swapped += 1
            else:
                for n in parts:
                    fp8.dequantize_into(targets[n], *kept[n])
                dequantized += 1
            for n in parts:
                del kept[n]
    for n in list(kept):  # not part of any projection: cannot happen with qil's layers
        fp8.dequantize_into(targets[n], *kept.pop(n))
    return {"fp8": swapped, "dequantized": dequantized, "kernels": sorted(kernel_names)}


def _concat_rows(weights: list[torch.Tensor]) -> torch.Tensor:
    """FP8 weights stacked along their rows (as bytes: not every torch build concatenates
    float8 tensors)."""
    if len(weights) == 1:
        return weights[0]
    return torch.cat([w.view(torch.uint8) for w in weights]).view(FP8)


def describe(model: nn.Module, summary: dict[str, Any] | None) -> str:
    """The startup log's line for an FP8 checkpoint: which path runs, and the weights' bytes."""
    dtype = str(model.dtype).removeprefix("torch.")
    if summary and summary["fp8"]:
        path = f"float8_e4m3fn block 128x128 via scaled_mm ({', '.join(summary['kernels'])})"
        if summary["dequantized"]:
            path += f" for {summary['fp8']} projections, {summary['dequantized']} dequantized to {dtype} at load"
    else:
        path = f"dequantized to {dtype} at load"
    return f"FP8 checkpoint: {path}; weights in memory {weight_bytes(model) / 2**20:.1f} MiB"


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter of ``model``, a storage shared by several counted once."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        try:
            storage = param.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # opaque (oneDNN) tensors
            key, size = id(param), param.numel() * param.element_size()
        if key not in seen:
            seen.add(key)
            total += size
    return total
