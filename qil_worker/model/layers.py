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


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` divided by its root mean square over the last dimension, computed in float32 and
    returned in ``x``'s dtype — a new tensor; the caller applies the weight after the cast, as the
    reference does. ``F.rms_norm`` is one fused kernel on CUDA where the formula is five launches;
    on CPU it is the formula underneath (bit-identical, same speed within this machine's noise)."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * rms_normalize(x, self.eps)


class QKNorm(nn.Module):
    """Qwen3's RMSNorm of every query head and every key head (one weight each), in one pass
    over the query and key heads side by side, [T, Hq + Hkv, D]: half the operations of two
    norms, which matters where each is a kernel launch or a dispatch (CUDA eager steps, small
    CPU decode steps)."""

    def __init__(self, head_dim: int, num_q_heads: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.q_weight = nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(head_dim, dtype=dtype, device=device), requires_grad=False)
        self.num_q_heads = num_q_heads
        self.eps = eps

    def forward(self, qk: torch.Tensor) -> torch.Tensor:
        out = rms_normalize(qk, self.eps)
        out[:, : self.num_q_heads].mul_(self.q_weight)
        out[:, self.num_q_heads :].mul_(self.k_weight)
        return out


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
        # sin with its first half negated: rotating half of x then is a plain swap of halves
        sin = emb.sin()
        sin[:, : head_dim // 2].neg_()
        self.register_buffer("cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin_signed", sin.to(dtype=dtype, device=device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, D] for ``positions`` [T]: looked up once per step, used by
        every layer (``apply_rope``)."""
        return (
            self.cos.index_select(0, positions).unsqueeze(1),
            self.sin_signed.index_select(0, positions).unsqueeze(1),
        )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] (query and key heads alike) with tables from ``RotaryEmbedding.lookup``.

    The reference's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x2, x1)``:
    here ``(x2, x1) * (-sin1, sin2)``, the same products exactly, without the negation.
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1).mul_(sin_signed)
    return (x * cos).add_(swapped)


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
