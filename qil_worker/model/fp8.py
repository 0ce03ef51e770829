"""Official FP8 checkpoints (transformers' fine-grained FP8 layout): which tensors are FP8, the
layout checks, and the block dequantization.

A quantized linear ``<module>.weight`` [out, in] is stored as ``float8_e4m3fn`` (safetensors
``F8_E4M3``) beside ``<module>.weight_scale_inv``, one float per 128x128 block: a grid of
ceil(out/128) x ceil(in/128), the last row and column of blocks ragged where a dimension is not a
multiple of 128. ``W[block] = fp8[block] * weight_scale_inv[block]`` (a multiply, despite the
name). Only the decoder's linear layers are quantized; the embedding, the norms and the LM head
stay in a float dtype, and so do the modules ``modules_to_not_convert`` names.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import NamedTuple

import torch

from qil_worker.config import Fp8Quantization, Quantization
from qil_worker.parallel.shards import Shard

FP8 = torch.float8_e4m3fn
FP8_STORED = "F8_E4M3"
SCALE_SUFFIX = ".weight_scale_inv"
SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
QUANTIZED_LINEAR = re.compile(
    r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight"
)
# A Qwen3-MoE expert's projection: always dequantized at load (no FP8 expert kernel).
EXPERT_LINEAR = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
# Rows dequantized at once: bounds the float32 temporaries to a few tens of MB per step.
_CHUNK_ELEMENTS = 1 << 22


class TensorHeader(NamedTuple):
    """What a shard's header says about one tensor."""

    path: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' spelling: F32, BF16, F8_E4M3, ...


def scale_name(weight_name: str) -> str:
    """``…q_proj.weight`` → ``…q_proj.weight_scale_inv``."""
    return weight_name.removesuffix(".weight") + SCALE_SUFFIX


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The block grid of a [out, in] weight: ceil(out/block) x ceil(in/block)."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def skips_module(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``modules_to_not_convert`` keeps ``module`` unquantized, matched as transformers'
    ``should_convert_module`` does: a prefix up to a module boundary, a regex with that
    boundary, or a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in patterns)


def quantized_weights(
    targets: dict[str, torch.Tensor], quantization: Quantization | None, shards: dict[str, Shard] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Checkpoint weight name → its shape in the checkpoint, for every weight stored in FP8
    with a scale grid; ``shards``: the targets that hold a slice (tensor parallelism)."""
    if not isinstance(quantization, Fp8Quantization):
        return {}
    shards = shards or {}
    return {
        name: shards[name].full_shape(tuple(target.shape)) if name in shards else tuple(target.shape)
        for name, target in targets.items()
        if QUANTIZED_LINEAR.fullmatch(name)
        and not skips_module(name.removesuffix(".weight"), quantization.modules_to_not_convert)
    }


def check_layout(
    quantized: dict[str, tuple[int, ...]],
    found: dict[str, TensorHeader],
    block: tuple[int, int],
) -> list[str]:
    """Every FP8 layout problem, each naming its tensor: a quantized weight not stored as
    F8_E4M3, a missing, mis-shaped or non-float scale, a scale or an FP8 tensor where none
    belongs. Missing and mis-shaped weights are the generic check's (``loader.check_weights``)."""
    problems: list[str] = []
    for name, shape in quantized.items():
        header = found.get(name)
        if header is not None and header.dtype != FP8_STORED:
            problems.append(
                f"not FP8: {name} is stored as {header.dtype}; quantization_config makes it a "
                f"float8_e4m3fn ({FP8_STORED}) weight with a weight_scale_inv"
            )
        scale = scale_name(name)
        grid = scale_grid(shape, block)
        if scale not in found:
            problems.append(
                f"missing: {scale} (expected shape {grid}: one scale per {block[0]}x{block[1]} "
                f"block of {name} {shape})"
            )
        elif found[scale].shape != grid:
            problems.append(
                f"mis-shaped: {scale} expected {grid} (the {block[0]}x{block[1]} block grid of "
                f"{name} {shape}), got {found[scale].shape}"
            )
        elif found[scale].dtype not in SCALE_DTYPES:
            problems.append(
                f"bad dtype: {scale} is {found[scale].dtype}; expected one of {sorted(SCALE_DTYPES)}"
            )
    for name, header in sorted(found.items()):
        if name.endswith(SCALE_SUFFIX):
            weight = name.removesuffix(SCALE_SUFFIX) + ".weight"
            if weight not in quantized:
                problems.append(f"unexpected scale: {name} ({_why_unquantized(weight, quantized)})")
        elif header.dtype == FP8_STORED and name not in quantized:
            problems.append(
                f"unexpected FP8: {name} is stored as {FP8_STORED} "
                f"({_why_unquantized(name, quantized)})"
            )
    return problems


def _why_unquantized(weight: str, quantized: dict[str, tuple[int, ...]]) -> str:
    if not quantized:
        return "config.json has no FP8 quantization_config"
    if QUANTIZED_LINEAR.fullmatch(weight):
        return f"{weight.removesuffix('.weight')} is listed in modules_to_not_convert"
    return f"{weight} is not one of the decoder's linear weights, which alone are FP8"


def read_scales(
    found: dict[str, TensorHeader], quantized: dict[str, tuple[int, ...]], stored: dict[str, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Every quantized weight's scale grid as float32, read before the weights: it is tiny, and a
    sharded checkpoint may keep a weight and its scale in different files. ``stored``: a name's
    own in the file, where it differs (``loader.with_model_prefix``)."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name in quantized:
        by_file.setdefault(found[scale_name(name)].path, []).append(scale_name(name))
    scales: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                scales[name] = f.get_tensor((stored or {}).get(name, name)).to(torch.float32)
    return scales


@functools.cache
def _fp8_values(device: torch.device) -> torch.Tensor:
    """The float32 value of each of the 256 float8_e4m3fn bit patterns: looking values up is
    several times faster on a CPU than torch's element-wise conversion, with the same results."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).to(device, torch.float32)


def scale_shard(shard: Shard, block: tuple[int, int]) -> Shard:
    """The rows or columns of a weight's scale grid that a slice ``shard`` of the weight needs:
    whole blocks (``parallel.shards.check_tp_size`` refuses slices with an edge inside one)."""
    size = block[shard.dim]
    if shard.start % size or (shard.stop % size and shard.stop != shard.full):
        raise ValueError(f"slice [{shard.start}, {shard.stop}) of dim {shard.dim} is not whole {size}-blocks")
    return Shard(shard.dim, shard.start // size, -(-shard.stop // size), -(-shard.full // size))


def dequantize_into(
    out: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """``out[...] = weight * scale_inv`` block by block (float32 product, then ``out``'s dtype:
    transformers' ``Fp8Dequantize`` rounding), a few block rows at a time so the float32
    temporaries stay small whatever the weight's size. ``out`` may be a view (a part of a fused
    projection)."""
    rows, cols = weight.shape
    if scale_inv.shape != scale_grid((rows, cols), block):
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not match weight {(rows, cols)}")
    values = _fp8_values(out.device)
    codes = weight.to(out.device).view(torch.uint8)
    scale_inv = scale_inv.to(out.device, torch.float32)
    full, ragged = divmod(cols, block[1])
    step = max(1, _CHUNK_ELEMENTS // max(cols * block[0], 1)) * block[0]
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        chunk = values.index_select(0, codes[start:stop].reshape(-1).int()).view(stop - start, cols)
        scales = scale_inv[start // block[0] : -(-stop // block[0])]
        scales = scales.repeat_interleave(block[0], dim=0)[: stop - start]  # [rows, column blocks]
        # scales broadcast over each block's columns, never expanded to the weight's size
        chunk[:, : full * block[1]].view(stop - start, full, block[1]).mul_(scales[:, :full, None])
        if ragged:
            chunk[:, full * block[1] :].mul_(scales[:, full:])
        out[start:stop].copy_(chunk)
    return out


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """A new ``dtype`` tensor of the dequantized weight (see ``dequantize_into``)."""
    return dequantize_into(torch.empty(weight.shape, dtype=dtype, device=weight.device), weight, scale_inv, block)
