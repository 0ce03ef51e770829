"""Stacked expert weights as per-output-channel int8 (weight-only), as ``int8_linear.py`` does
for one projection: codes [E, out, in] and scales [E, out], one scale per row of each expert.

Each expert runs through an ``Int8Linear`` over views of its slice of the codes and scales, so
the kernels (``_weight_int8pack_mm`` or dequantized per call, chosen per step size at load by
``choose_kernels``) and their alignment rules are the dense projections' own. Only the CPU loop
over active experts is implemented (``ExpertGroups.bounds``); there is no grouped int8 kernel.
"""

from __future__ import annotations

import torch
from torch import nn

from qil_worker.model.expert_linear import ExpertGroups, ExpertLinear
from qil_worker.model.int8_linear import Int8Linear, describe_kernels, quantize_per_channel


class Int8ExpertLinear(nn.Module):
    """One projection of every expert as int8 codes [E, out, in] and scales [E, out]."""

    packed = False
    grouped = False  # host bounds only (see module docstring)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, kernels: str | tuple[str, ...] = "dequantize") -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 3 or scales.shape != codes.shape[:2]:
            raise ValueError(f"Int8ExpertLinear needs int8 codes [E, out, in] and scales [E, out], got "
                             f"{codes.dtype} {tuple(codes.shape)} and {tuple(scales.shape)}")
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)
        self.num_experts, self.out_features, self.in_features = codes.shape
        # views, not submodules: the stacked buffers above are what the module holds
        self.experts = [Int8Linear(codes[e], scales[e], kernels) for e in range(self.num_experts)]

    @classmethod
    def from_experts(cls, experts: ExpertLinear) -> "Int8ExpertLinear":
        """Quantize a stacked (not packed) ``ExpertLinear``: every row of every expert its own
        scale, in the weight's dtype."""
        if experts.packed:
            raise ValueError("int8 quantization needs the stacked weight: quantize before packing for oneDNN")
        weight = experts.weight.data
        e, out, inp = weight.shape
        codes, scales = quantize_per_channel(weight.view(e * out, inp), weight.dtype)
        return cls(codes.view(e, out, inp), scales.view(e, out))

    @property
    def kernels(self) -> tuple[str, ...]:
        return self.experts[0].kernels

    def probe(self) -> Int8Linear:
        """One expert's projection: the shape ``choose_kernels`` times for all of them."""
        return self.experts[0]

    def use_kernels(self, kernels: str | tuple[str, ...]) -> None:
        for expert in self.experts:
            expert.use_kernels(kernels)

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """[N, in] rows sorted by expert → [N, out] (``groups.bounds`` required)."""
        if groups.bounds is None:
            raise RuntimeError("int8 experts run only the per-expert loop (no grouped int8 kernel)")
        parts = [self.experts[e](x[start:stop]) for e, start, stop in groups.bounds]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else x.new_empty((0, self.out_features))

    @property
    def weight_format(self) -> str:
        return f"int8 per-channel experts (weight-only, {describe_kernels(self.kernels)})"

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scales.numel() * self.scales.element_size()
