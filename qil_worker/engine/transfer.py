"""Host values → device tensors without a synchronising copy.

``torch.tensor(values, device="cuda")`` copies synchronously; building on the host and moving
with ``non_blocking=True`` stages the bytes and returns at once, so preparing a step's small
index and parameter tensors never waits for the GPU. On the CPU both are the same.

With a ``dtype`` the host tensor is made through a typed ``array`` and ``torch.frombuffer``:
``torch.tensor`` inspects every element of a list (tens of microseconds for a few hundred
floats or bools, milliseconds for a few thousand ints), ``array`` converts them in C.
"""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence

import torch

# array typecodes whose items have exactly the tensor dtype's width and meaning
_ARRAY_CODES = {torch.long: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d", torch.bool: "B"}


def to_device(values: Sequence, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    return host_tensor(values, dtype).to(device, non_blocking=True)


def host_tensor(values: Iterable, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A 1-D CPU tensor of ``values`` (numbers; ints for integer dtypes), as ``torch.tensor``
    makes it; ``dtype`` None infers it as ``torch.tensor`` does. An ``array`` of the dtype's
    typecode is not copied: the tensor shares its memory."""
    code = _ARRAY_CODES.get(dtype)
    if code is None:
        return torch.tensor(values if isinstance(values, Sequence) else list(values), dtype=dtype)
    buffer = values if isinstance(values, array.array) and values.typecode == code else array.array(code, values)
    if not buffer:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype)
