"""``y = x W_eᵀ`` for groups of rows, each group through its own expert's weight.

The experts of one MoE projection are one stacked weight [E, out, in], filled straight from the
checkpoint's per-expert tensors (``weight_targets`` hands out ``weight[e]`` views). The rows
arrive sorted by expert (``moe.SparseMoeBlock``), described by ``ExpertGroups``:

- ``bounds`` (host): (expert, start, stop) for each expert that has rows. The CPU path loops
  over exactly those experts, one matmul each, so a decode step reads only the active experts'
  weights. After ``pack`` each expert's weight is packed for oneDNN, as dense ``Linear``s are:
  measured faster than the stacked slices at every step size on CPU (docs/performance.md).
- ``ends`` (device, int32): the cumulative row count per expert, for ``torch._grouped_mm``:
  one kernel for every expert with no host sync, so it can be captured in a CUDA graph. Used
  where ``bounds`` is None (``grouped``: CUDA; on CPU only to test that wiring).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker import cpu_memory
from qil_worker.model.linear import PACK_BATCH_HINT, PACK_TOLERANCE, deferring, packing_supported


class ExpertGroups(NamedTuple):
    """Where each expert's rows lie in a batch of rows sorted by expert."""

    ends: torch.Tensor  # [E] int32 on the device: rows of experts 0..e together
    bounds: list[tuple[int, int, int]] | None  # host (expert, start, stop) of experts with rows


@functools.cache
def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` computes a probe right on ``device`` in ``dtype`` (with an
    empty group, as most experts are at decode sizes)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 32, generator=generator).to(device, dtype)
    weight = torch.randn(3, 16, 32, generator=generator).to(device, dtype)
    ends = torch.tensor([2, 2, 5], dtype=torch.int32, device=device)
    try:
        got = torch._grouped_mm(x, weight.transpose(1, 2), offs=ends).float()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    want = torch.cat([x[:2].float() @ weight[0].float().t(), x[2:].float() @ weight[2].float().t()])
    return got.shape == want.shape and torch.allclose(got, want, rtol=2e-2, atol=2e-2)


class ExpertLinear(nn.Module):
    """One projection of every expert: a stacked weight [E, out, in], or once ``packed`` one
    oneDNN-packed weight per expert (``packed_experts``)."""

    packed = False

    def __init__(self, num_experts: int, out_features: int, in_features: int,
                 dtype: torch.dtype, device: torch.device, grouped: bool = False) -> None:
        """``grouped``: run ``torch._grouped_mm`` over the stacked weight (never packed then)."""
        super().__init__()
        self.num_experts, self.out_features, self.in_features = num_experts, out_features, in_features
        self.grouped = grouped
        self._device = torch.device(device)
        shape = (num_experts, out_features, in_features)
        # deferred (meta) while a pre-quantized checkpoint's model is built: see linear.deferred_weights
        if deferring():
            weight = torch.empty(shape, dtype=dtype, device="meta")
        else:
            weight = cpu_memory.empty(shape, dtype, device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.packed_experts: nn.ParameterList | None = None

    def materialize(self) -> None:
        """Give a deferred (meta) stacked weight its memory, uninitialised (``Linear.materialize``)."""
        if self.weight is not None and self.weight.is_meta:
            weight = cpu_memory.empty(tuple(self.weight.shape), self.weight.dtype, self._device)
            self.weight = nn.Parameter(weight, requires_grad=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.packed_experts[0].dtype if self.packed else self.weight.dtype

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """[N, in] rows sorted by expert → [N, out]."""
        if groups.bounds is None:
            return torch._grouped_mm(x, self.weight.transpose(1, 2), offs=groups.ends)
        parts = [self.expert(e, x[start:stop]) for e, start, stop in groups.bounds]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else x.new_empty((0, self.out_features))

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` through expert ``e``'s weight."""
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(rows, self.packed_experts[e], None, "none", [], "")
        return F.linear(rows, self.weight[e])

    @property
    def weight_format(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype} experts ({'oneDNN packed per expert' if self.packed else 'stacked'})"

    def weight_bytes(self) -> int:
        weights = self.packed_experts if self.packed else [self.weight]
        return sum(w.numel() * w.element_size() for w in weights)

    def pack(self) -> bool:
        """Pack every expert's weight for oneDNN (see ``linear.py``) and drop the stacked one;
        False (and unchanged) where packing is unsupported or fails its self-check."""
        if self.packed or self.grouped or not packing_supported(self.weight.device, self.weight.dtype):
            return False
        stacked = self.weight.data
        hint = PACK_BATCH_HINT.get(stacked.dtype, 1)
        try:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in stacked.unbind(0)]
        except (RuntimeError, AttributeError):
            return False
        probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0)).to(stacked.dtype)
        tolerance = PACK_TOLERANCE[stacked.dtype]
        for e in {0, self.num_experts - 1}:  # the layout is the same for all: check the ends
            got = torch.ops.mkldnn._linear_pointwise(probe, packed[e], None, "none", [], "").float()
            if not torch.allclose(got, F.linear(probe, stacked[e]).float(), rtol=tolerance, atol=tolerance):
                return False
        self.packed_experts = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in packed)
        del self.weight
        self.weight = None
        self.packed = True
        return True
