"""Host values → device tensors without a synchronising copy.

``torch.tensor(values, device="cuda")`` copies synchronously; building on the host and moving
with ``non_blocking=True`` stages the bytes and returns at once, so preparing a step's small
index and parameter tensors never waits for the GPU. On the CPU both are the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
