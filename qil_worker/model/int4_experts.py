"""Stacked expert weights as group-wise asymmetric 4-bit codes (weight-only), as
``int4_linear.py`` does for one projection.

Each expert is its own ``Int4Linear`` (packed for the int4 kernel at load), and a step runs only
the experts that rows were routed to, in the host loop over ``ExpertGroups.bounds``: a decode step
reads the active experts' weights and no others. There is no grouped int4 kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from qil_worker.model.expert_linear import ExpertGroups, ExpertLinear
from qil_worker.model.int4_linear import Int4Linear, quantize_groupwise


class Int4ExpertLinear(nn.Module):
    """One projection of every expert, each an ``Int4Linear`` [out, in]."""

    packed = False
    grouped = False  # host bounds only (see module docstring)

    def __init__(self, experts: list[Int4Linear]) -> None:
        super().__init__()
        if not experts or len({(e.out_features, e.in_features, e.group_size) for e in experts}) != 1:
            raise ValueError("Int4ExpertLinear needs one or more experts of one shape and group size")
        # a plain list, not submodules (each would count as a projection of its own in the
        # weight summary); their buffers are registered here so that the stack holds them
        self.experts = list(experts)
        for e, expert in enumerate(experts):
            for name, buffer in expert.named_buffers():
                self.register_buffer(f"expert{e}_{name}", buffer)
        self.num_experts = len(experts)
        self.out_features, self.in_features = experts[0].out_features, experts[0].in_features

    @classmethod
    def from_experts(cls, experts: ExpertLinear, group_size: int) -> "Int4ExpertLinear":
        """Quantize a stacked (not packed) ``ExpertLinear``, every expert's rows grouped by
        ``group_size`` inputs; scales in the weight's dtype."""
        if experts.packed:
            raise ValueError("int4 quantization needs the stacked weight: quantize before packing for oneDNN")
        weight = experts.weight.data
        return cls([Int4Linear(*quantize_groupwise(weight[e], group_size, weight.dtype)) for e in range(weight.shape[0])])

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """[N, in] rows sorted by expert → [N, out] (``groups.bounds`` required)."""
        if groups.bounds is None:
            raise RuntimeError("int4 experts run only the per-expert loop (no grouped int4 kernel)")
        parts = [self.experts[e](x[start:stop]) for e, start, stop in groups.bounds]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else x.new_empty((0, self.out_features))

    @property
    def weight_format(self) -> str:
        return self.experts[0].weight_format.replace("int4 ", "int4 experts ", 1)

    def weight_bytes(self) -> int:
        return sum(e.weight_bytes() for e in self.experts)
