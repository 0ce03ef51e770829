"""Qwen3-MoE's sparse MLP block: a top-k router over E SiLU-gated experts, no shared expert.

Routing follows transformers' ``Qwen3MoeTopKRouter`` so the same experts are chosen: router
logits in the activations' dtype, softmax in float32, top-k of the probabilities, renormalised
over the k when ``norm_topk_prob``, then cast back to the activations' dtype.

Expert compute is one batched path for a whole step: the step's (token, expert) pairs are
sorted by expert once, each expert's rows go through its weights as one matmul over their
contiguous slice (``expert_linear.ExpertLinear``: a loop over the experts with rows on CPU,
``torch._grouped_mm`` with device-side group ends on CUDA), and the weighted results are
scattered back to their (token, slot) place once and summed over the k slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker.config import Qwen3Config
from qil_worker.model.expert_linear import ExpertGroups, ExpertLinear, grouped_mm_supported
from qil_worker.model.int8_experts import Int8ExpertLinear
from qil_worker.model.linear import Linear, pack_all
from qil_worker.model.routed_experts import MAX_TOKENS, RoutedExperts
from qil_worker.parallel.shards import Shard


class Router(Linear):
    """The router ``mlp.gate`` [E, hidden]: a projection that routing reads. Its own type so
    that ``--quantize int8`` leaves it alone: it is tiny, and its rounding would change which
    experts run."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, normalize: bool,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_experts, hidden, dtype, device)
        self.top_k, self.normalize = top_k, normalize

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] → (weights [T, k] in ``x``'s dtype, expert ids [T, k] int64)."""
        logits = self(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids


class SparseMoeBlock(nn.Module):
    """``sum_k w_k * expert_k(x)`` over each token's top-k experts.

    Under tensor parallelism every rank routes alike (the router is whole on each) and holds
    its share of every expert's width, so its output is a partial sum the layer all-reduces."""

    def __init__(self, config: Qwen3Config, dtype: torch.dtype, device: torch.device, grouped: bool = False,
                 world_size: int = 1) -> None:
        """``grouped``: the device path (``torch._grouped_mm``, no host sync) where it runs
        right; the default of CUDA models (``Qwen3``'s fused wiring), else the per-expert loop.
        ``world_size``: tensor-parallel ranks sharing each expert's ``moe_intermediate_size``."""
        super().__init__()
        c = config
        self.top_k, self.intermediate = c.num_experts_per_tok, c.moe_intermediate_size // world_size
        grouped = grouped and grouped_mm_supported(device, dtype)
        self.gate = Router(c.num_experts, c.hidden_size, c.num_experts_per_tok, c.norm_topk_prob, dtype, device)
        self.gate_up = ExpertLinear(c.num_experts, 2 * self.intermediate, c.hidden_size, dtype, device, grouped)
        self.down = ExpertLinear(c.num_experts, c.hidden_size, self.intermediate, dtype, device, grouped)
        self.register_buffer("expert_ids", torch.arange(c.num_experts, device=device), persistent=False)
        # int8 experts' few-token steps as one compiled call (``use_routed``), else None
        self.routed: RoutedExperts | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        weights, ids = self.gate.route(x)
        if self.routed is not None and 0 < tokens <= MAX_TOKENS:
            return self.routed(x, ids, weights, self.gate_up.weight, self.gate_up.scales,
                               self.down.weight, self.down.scales)
        # every (token, slot) pair, sorted by expert; stable: tokens ascending within an expert
        sorted_ids, order = ids.view(-1).sort(stable=True)
        rows = x.index_select(0, order.div(self.top_k, rounding_mode="floor"))
        groups = self.groups(sorted_ids)
        gate, up = self.gate_up(rows, groups).split(self.intermediate, dim=-1)
        out = self.down(F.silu(gate).mul_(up), groups)
        # back to (token, slot) order with one scatter, then the weighted sum over the k slots
        out = torch.empty_like(out).index_copy_(0, order, out).view(tokens, self.top_k, -1)
        return out.mul_(weights.unsqueeze(-1)).sum(dim=1)

    def groups(self, sorted_ids: torch.Tensor) -> ExpertGroups:
        """Each expert's slice of the sorted rows: device-side ends, and host bounds unless
        both projections run grouped (reading them is the one host sync of the CPU path)."""
        ends = torch.searchsorted(sorted_ids, self.expert_ids, right=True)
        if self.capturable:
            return ExpertGroups(ends.to(torch.int32), None)
        if ends.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "this MoE block runs its experts in a host loop (no grouped kernel for its dtype or "
                "quantization here), which cannot be captured in a CUDA graph: run without cuda_graphs"
            )
        bounds, start = [], 0
        for e, stop in enumerate(ends.tolist()):
            if stop > start:
                bounds.append((e, start, stop))
                start = stop
        return ExpertGroups(ends, bounds)

    @property
    def int8_experts(self) -> bool:
        """Whether both projections' experts are int8 codes (``--quantize int8``)."""
        return isinstance(self.gate_up, Int8ExpertLinear) and isinstance(self.down, Int8ExpertLinear)

    def use_routed(self, routed: RoutedExperts | None) -> None:
        """Run steps of up to ``routed_experts.MAX_TOKENS`` tokens through ``routed`` (the
        compiled ``routed_int8_experts``; int8 experts only); None: the loop for every step."""
        if routed is not None and not self.int8_experts:
            raise ValueError("the compiled routed experts read int8 codes: quantize the experts to int8 first")
        self.routed = routed

    @property
    def capturable(self) -> bool:
        """Whether a forward needs nothing from the host (both projections grouped), so that it
        can be captured in a CUDA graph."""
        return self.gate_up.grouped and self.down.grouped

    def projections(self) -> list[nn.Module]:
        return [self.gate, self.gate_up, self.down]

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name → the view of the stacked weight it is loaded into: each
        expert's gate and up projections are the two halves of its rows of ``gate_up``."""
        i = self.intermediate
        gate_up, down = self.gate_up.weight.data, self.down.weight.data
        targets = {prefix + "gate.weight": self.gate.weight.data}
        for e in range(gate_up.shape[0]):
            expert = f"{prefix}experts.{e}."
            targets[expert + "gate_proj.weight"] = gate_up[e, :i]
            targets[expert + "up_proj.weight"] = gate_up[e, i:]
            targets[expert + "down_proj.weight"] = down[e]
        return targets

    def weight_shards(self, prefix: str, rank: int, world_size: int) -> dict[str, Shard]:
        """This rank's slices of every expert's projections (the router is whole on each)."""
        i = self.intermediate
        rows = Shard(0, rank * i, (rank + 1) * i, i * world_size)
        shards = {}
        for e in range(self.gate_up.num_experts):
            expert = f"{prefix}experts.{e}."
            shards[expert + "gate_proj.weight"] = shards[expert + "up_proj.weight"] = rows
            shards[expert + "down_proj.weight"] = rows._replace(dim=1)
        return shards

    def pack_weights(self) -> bool:
        """Pack the router and each expert for oneDNN (see ``expert_linear.py``; a grouped
        block keeps its experts stacked). Each stacked projection runs packed or not on its own."""
        router = pack_all([self.gate])
        experts = [self.gate_up.pack(), self.down.pack()]
        return router and all(experts)
