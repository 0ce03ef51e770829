"""4-bit checkpoint tensors written from the formats' definitions (independently of qil's
unpacking code): AutoAWQ GEMM and GPTQ (v1, no act-order) packing of a weight quantized
group-wise with zero points, and whole checkpoints of random Qwen3 models in either format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
    return _as_int32(out)


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


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] values in [0, 15] → int32 [R/8, C], row 8j + i in nibble i (GPTQ's qweight)."""
    rows, cols = values.shape
    out = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for j in range(rows // 8):
        for i in range(8):
            out[j] |= values[8 * j + i].to(torch.int64) << (4 * i)
    return _as_int32(out)


def pack_columns(values: torch.Tensor) -> torch.Tensor:
    """int [R, C] values in [0, 15] → int32 [R, C/8], column 8j + i in nibble i (GPTQ's qzeros)."""
    return pack_rows(values.t().contiguous()).t().contiguous()


def _as_int32(packed: torch.Tensor) -> torch.Tensor:
    """int64 values of 32 bits → int32 with the same bits."""
    return (packed - (packed >= 2**31) * 2**32).to(torch.int32)


def gptq_quantize(weight: torch.Tensor, group: int, sym: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A [N, K] weight → (GPTQ v1 tensors qweight/qzeros/scales/g_idx, its dequantized weight
    [N, K] float32), as AutoGPTQ quantizes without act-order: ``sym`` scale 2·max|w| / 15 and
    zero 8, else (max − min) / 15 and zero round(−min / s). qzeros stores zero − 1 in four bits,
    and the kernels add the one back to the nibble, so a zero of 0 reads as 16: the
    dequantization here is what they compute."""
    n, k = weight.shape
    w = weight.float().t().reshape(k // group, group, n)
    if sym:
        scales = (2 * w.abs().amax(1) / 15).clamp(min=1e-5).half()
        zeros = torch.full_like(scales, 8, dtype=torch.float32)
    else:
        low, high = w.amin(1), w.amax(1)
        scales = ((high - low).clamp(min=1e-5) / 15).half()
        zeros = torch.round(-low / scales.float()).clamp(0, 15)
    s = scales.float()
    q = torch.round(w / s[:, None] + zeros[:, None]).clamp(0, 15)
    stored = (zeros.long() - 1) & 15
    read = stored.float() + 1
    dequantized = ((q - read[:, None]) * s[:, None]).reshape(k, n).t().contiguous()
    tensors = {"qweight": pack_rows(q.reshape(k, n).long()), "qzeros": pack_columns(stored), "scales": scales,
               "g_idx": (torch.arange(k) // group).to(torch.int32)}
    return tensors, dequantized


INT4_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_awq_checkpoint(
    path: Path, reference: Path | None = None, seed: int = 0, group_size: int = 128,
    modules_to_not_convert: list[str] | None = None, config_overrides: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """A random Qwen3 checkpoint in AutoAWQ's GEMM layout (``awq_quantize``): see
    ``make_int4_checkpoint``."""
    config = {"bits": 4, "group_size": group_size, "modules_to_not_convert": modules_to_not_convert or None,
              "quant_method": "awq", "version": "gemm", "zero_point": True, **(config_overrides or {})}
    return make_int4_checkpoint(path, reference, lambda w: awq_quantize(w, group_size), config,
                                modules_to_not_convert, seed, **overrides)


def make_gptq_checkpoint(
    path: Path, reference: Path | None = None, seed: int = 0, group_size: int = 128, sym: bool = True,
    modules_to_not_convert: list[str] | None = None, config_overrides: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """A random Qwen3 checkpoint in GPTQ's v1 layout without act-order (``gptq_quantize``), its
    quantization_config as AutoGPTQ writes it: see ``make_int4_checkpoint``."""
    config = {"bits": 4, "group_size": group_size, "damp_percent": 0.01, "desc_act": False, "static_groups": False,
              "sym": sym, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": None,
              "quant_method": "gptq", "checkpoint_format": "gptq",
              **({"modules_to_not_convert": modules_to_not_convert} if modules_to_not_convert else {}),
              **(config_overrides or {})}
    return make_int4_checkpoint(path, reference, lambda w: gptq_quantize(w, group_size, sym), config,
                                modules_to_not_convert, seed, **overrides)


def make_int4_checkpoint(
    path: Path, reference: Path | None, quantize: Any, quantization_config: dict[str, Any],
    modules_to_not_convert: list[str] | None = None, seed: int = 0, moe: bool = False, **overrides: Any,
) -> Path:
    """A random Qwen3 (``moe``: Qwen3-MoE, ``make_moe_checkpoint``) checkpoint with every decoder linear (but those whose name ends with one of
    ``modules_to_not_convert``; experts too, not the routers) replaced by ``quantize(weight)``'s
    tensors, everything else
    float16, and config.json's ``quantization_config``. ``reference``: also write there the same
    model with float32 weights, each quantized linear as its dequantization and no
    quantization_config — what transformers runs as the oracle."""
    from safetensors.torch import load_file, save_file

    from checkpoints import make_checkpoint, make_moe_checkpoint

    (make_moe_checkpoint if moe else make_checkpoint)(path, seed=seed, **overrides)
    path = Path(path)
    skip = modules_to_not_convert or []
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in INT4_LINEARS and not any(module.endswith(s) for s in skip):
            packed, dense[name] = quantize(tensor)
            tensors.update({f"{module}.{key}": value for key, value in packed.items()})
        else:
            tensors[name] = tensor.half()
            dense[name] = tensor.half().float()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if reference is not None:
        Path(reference).mkdir(parents=True, exist_ok=True)
        save_file(dense, Path(reference) / "model.safetensors", metadata={"format": "pt"})
        (Path(reference) / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))
    config["dtype"] = "float16"
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
