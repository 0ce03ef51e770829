"""The small pieces of a Qwen3 layer: RMSNorm, rotary embedding, SiLU-gated MLP.

Each follows the reference's order of operations and precision (norms in float32, RoPE tables
in float32 cast to the activation dtype) so float32 outputs match it to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker import cpu_memory
from qil_worker.model.linear import Linear, pack_and_release


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE with a precomputed cos/sin table indexed by absolute position.

    The table covers the model's max positions, so a step looks positions up with one gather
    instead of recomputing frequencies.
    """

    def __init__(
        self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype=dtype, device=device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for ``positions`` [T]: looked up once per step, used by every layer."""
        return (
            self.cos.index_select(0, positions).unsqueeze(1),
            self.sin.index_select(0, positions).unsqueeze(1),
        )


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] with tables from ``RotaryEmbedding.lookup``."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; gate and up are one weight, used as one matmul when
    ``fused`` (CUDA) or as two contiguous row slices."""

    def __init__(
        self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device, fused: bool = True
    ) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.fused = fused
        self.gate_up = nn.Parameter(cpu_memory.empty((2 * intermediate, hidden), dtype, device), requires_grad=False)
        self.down = nn.Parameter(cpu_memory.empty((hidden, intermediate), dtype, device), requires_grad=False)
        gate_up = self.gate_up.data
        self.gate_up_proj = [Linear(gate_up)] if fused else [Linear(gate_up[:intermediate]), Linear(gate_up[intermediate:])]
        self.down_proj = Linear(self.down.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj[0](x).split(self.intermediate, dim=-1)
        else:
            gate, up = (proj(x) for proj in self.gate_up_proj)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))

    def pack_weights(self) -> bool:
        """Pack the projections for oneDNN (see ``linear.py``) and release the plain parameters."""
        return pack_and_release([*self.gate_up_proj, self.down_proj], [self.gate_up, self.down])
