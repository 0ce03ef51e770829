"""``y = x Wᵀ`` for one projection, over a plain weight or one packed once for oneDNN on CPU.

Every call of ``F.linear`` on CPU hands oneDNN a plain row-major weight, which it re-blocks on
the fly; a decode step reads each weight once, so that re-blocking is a second pass over all of
them. Packing the weights once after loading (``torch.ops.mkldnn._reorder_linear_weight``, the
same op torch's own CPU compiler uses for frozen weights) removes it: decode-sized matmuls run
markedly faster, bf16 results are bit-identical and float32 ones differ only in summation order
(see docs/cpu.md).

A ``Linear`` holds exactly one weight, registered as its ``weight`` parameter: packing
(``pack_all``, one explicit step after loading: ``Qwen3.pack_weights``) replaces the plain
parameter with the packed one, so what ``state_dict()`` shows is what runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker import cpu_memory

# how close a packed projection must come to the plain one in its self-check, per dtype
PACK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# The batch size oneDNN is told to expect when it picks a packed layout (default 1). The layout it
# picks for 1 is a poor one for float32: slower than the others at every row count, one row too.
PACK_BATCH_HINT = {torch.float32: 8}


# Set while ``deferred_weights`` is active: Linears made then hold a meta weight until ``materialize``.
_deferred = False


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Linears (and ``ExpertLinear`` stacks) constructed inside get a weight on the meta device
    (its shape, no memory) until ``materialize``: for a checkpoint whose projections load as
    int4 (AWQ, GPTQ: ``int4_checkpoint.py``), so that the dense weights it never uses are not
    allocated on the way (on a GPU they would be)."""
    global _deferred
    previous, _deferred = _deferred, True
    try:
        yield
    finally:
        _deferred = previous


def deferring() -> bool:
    """Whether weights made now are deferred (``deferred_weights``): ``ExpertLinear`` asks too."""
    return _deferred


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can run packed oneDNN linears in ``dtype``."""
    if device.type != "cpu" or dtype not in PACK_TOLERANCE or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        if dtype == torch.bfloat16:
            return bool(ops._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(ops._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False
    return True


class Linear(nn.Module):
    """One projection's weight [out, in] (plain, or packed for oneDNN once ``packed``)."""

    def __init__(
        self, out_features: int, in_features: int, dtype: torch.dtype, device: torch.device,
        weight: nn.Parameter | None = None,
    ) -> None:
        """``weight``: an existing parameter to use (a tied LM head is the embedding table)."""
        super().__init__()
        self._device = torch.device(device)
        if weight is None:
            shape = (out_features, in_features)
            if _deferred:
                data = torch.empty(shape, dtype=dtype, device="meta")
            else:
                data = cpu_memory.empty(shape, dtype, device)
            weight = nn.Parameter(data, requires_grad=False)
        self.weight = weight
        self.packed = False

    def materialize(self) -> None:
        """Give a deferred (meta) weight its memory on the device it was made for, uninitialised."""
        if self.weight.is_meta:
            weight = cpu_memory.empty(tuple(self.weight.shape), self.weight.dtype, self._device)
            self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)

    # Called several times per layer per step: straight to ``forward``, without nn.Module's hook
    # dispatch (no hooks are used on projections).
    __call__ = forward

    @property
    def weight_format(self) -> str:
        """The weight's dtype, and "(oneDNN packed)" once packed."""
        dtype = str(self.weight.dtype).removeprefix("torch.")
        return f"{dtype} (oneDNN packed)" if self.packed else dtype

    def weight_bytes(self) -> int:
        """Bytes of the weight this projection runs on (a tied, unpacked head's is the embedding)."""
        return self.weight.numel() * self.weight.element_size()

    def packed_weight(self) -> torch.Tensor | None:
        """The weight packed for oneDNN, or None when that fails its self-check (or is packed)."""
        if self.packed:
            return None
        weight = self.weight.data
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.contiguous(), PACK_BATCH_HINT.get(weight.dtype, 1)
            )
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "").float()
        except (RuntimeError, AttributeError):
            return None
        want = F.linear(probe, weight).float()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=PACK_TOLERANCE[weight.dtype], atol=PACK_TOLERANCE[weight.dtype]):
            return None
        return packed

    def use_packed(self, packed: torch.Tensor) -> None:
        """Run on ``packed`` (from ``packed_weight``) from now on; the plain weight is dropped
        (a tied LM head's plain weight stays the embedding's)."""
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = True

    def pack(self) -> bool:
        """Pack this projection alone; False (and unchanged) when packing fails its self-check."""
        return pack_all([self])


def pack_all(linears: list[Linear]) -> bool:
    """Pack every linear, or none of them: False (all left plain) when any fails."""
    packed = [linear.packed_weight() for linear in linears]
    if any(p is None for p in packed):
        return False
    for linear, weight in zip(linears, packed):
        linear.use_packed(weight)
    return True
