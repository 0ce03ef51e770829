"""The small pieces of a Qwen3 layer: RMSNorm, rotary embedding, SiLU-gated MLP.

Each follows the reference's order of operations and precision (norms in float32, RoPE tables
in float32 cast to the activation dtype) so float32 outputs match it to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker.model.linear import Linear, pack_all
from qil_worker.parallel.shards import Shard


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` divided by its root mean square over the last dimension, computed in float32 and
    returned in ``x``'s dtype — a new tensor; the caller applies the weight after the cast, as the
    reference does. ``F.rms_norm`` is one fused kernel on CUDA where the formula is five launches;
    on CPU it is the same formula underneath (bit-identical, no slower), so one call serves both."""
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
    """``down(silu(gate(x)) * up(x))``; gate and up are one projection (one matmul) when
    ``fused`` (CUDA), else two."""

    def __init__(
        self, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device, fused: bool = True
    ) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.fused = fused
        if fused:
            self.gate_up_proj = Linear(2 * intermediate, hidden, dtype, device)
        else:
            self.gate_proj = Linear(intermediate, hidden, dtype, device)
            self.up_proj = Linear(intermediate, hidden, dtype, device)
        self.down_proj = Linear(hidden, intermediate, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))

    def projections(self) -> list[Linear]:
        return [self.gate_up_proj] if self.fused else [self.gate_proj, self.up_proj]

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name → the (view of the) weight it is loaded into."""
        if self.fused:
            gate_up = self.gate_up_proj.weight.data
            gate, up = gate_up[: self.intermediate], gate_up[self.intermediate :]
        else:
            gate, up = self.gate_proj.weight.data, self.up_proj.weight.data
        return {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up,
                prefix + "down_proj.weight": self.down_proj.weight.data}

    def weight_shards(self, prefix: str, rank: int, world_size: int) -> dict[str, Shard]:
        """This rank's slices of the checkpoint's projections when ``intermediate`` is its share
        of ``world_size`` (gate and up column-parallel, down row-parallel)."""
        i = self.intermediate
        rows = Shard(0, rank * i, (rank + 1) * i, i * world_size)
        return {prefix + "gate_proj.weight": rows, prefix + "up_proj.weight": rows,
                prefix + "down_proj.weight": rows._replace(dim=1)}

    def pack_weights(self) -> bool:
        """Pack the projections for oneDNN (see ``linear.py``), all or none."""
        return pack_all([*self.projections(), self.down_proj])
