"""Device and dtype names as users type them → torch objects, with clear errors."""

from __future__ import annotations

import torch

from qil_worker.errors import ConfigError

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None`` means CPU: a GPU is used only when asked for, and only one that exists (else the
    first tensor placed there fails deep inside torch)."""
    try:
        resolved = torch.device(device if device is not None else "cpu")
    except RuntimeError as exc:
        raise ConfigError(f"device: {exc}") from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device: {device!r} asked for, but this torch build or machine has no CUDA device")
        if resolved.index is not None and resolved.index >= count:
            raise ConfigError(f"device: {device!r} asked for, but there are only {count} CUDA device(s)")
    return resolved


def resolve_dtype(
    dtype: torch.dtype | str | None, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """``None``: bfloat16 on CUDA, float32 elsewhere; ``"auto"``: the checkpoint's dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype: {dtype} is not supported (float32, bfloat16, float16)")
        return dtype
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "auto":
        return _DTYPES.get(str(checkpoint_dtype), torch.float32)
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(
            f"dtype: {dtype!r} is not supported; use float32, bfloat16, float16 or auto"
        ) from None
