"""4-bit checkpoint tensors written from the formats' definitions (independently of qil's
unpacking code): AutoAWQ GEMM packing of a weight quantized group-wise with zero points, and
whole AWQ checkpoints of random Qwen3 models."""

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


AWQ_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_awq_checkpoint(
    path: Path, reference: Path | None = None, seed: int = 0, group_size: int = 128,
    modules_to_not_convert: list[str] | None = None, config_overrides: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """A random Qwen3 checkpoint in AutoAWQ's GEMM layout: every decoder linear (but those whose
    name ends with one of ``modules_to_not_convert``) as qweight/qzeros/scales (``awq_quantize``),
    everything else float16, and config.json's ``quantization_config`` (updated by
    ``config_overrides``). ``reference``: also write there the same model with float32 weights,
    each AWQ linear as its dequantization and no quantization_config — what transformers runs as
    the oracle."""
    from safetensors.torch import load_file, save_file

    from checkpoints import make_checkpoint

    make_checkpoint(path, seed=seed, **overrides)
    path = Path(path)
    skip = modules_to_not_convert or []
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in AWQ_LINEARS and not any(module.endswith(s) for s in skip):
            packed, dense[name] = awq_quantize(tensor, group_size)
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
    config["quantization_config"] = {
        "bits": 4, "group_size": group_size, "modules_to_not_convert": skip or None, "quant_method": "awq",
        "version": "gemm", "zero_point": True, **(config_overrides or {}),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path
