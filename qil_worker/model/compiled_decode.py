"""A lone decode row's whole forward as one graph compiled by inductor's C++ backend (CPU).

An eager decode step of one row is mostly a chain of small operations between the projections
(norms, q/k norm, rope, the KV write, residual adds, SiLU·mul), each paying dispatch and caches
made cold by the weights streamed before it. Compiled as one graph, those are fused into a few
C++ loops; the projections stay oneDNN's packed matmuls, which inductor takes as frozen
constants and fuses the SiLU and the residual adds into; the call costs one graph entry a step.

The graph covers one shape: one token of a request whose keys lie back to back in the pool
(``CpuAttention.key_run``: what the page pool gives a request growing alone), attended where
they lie by SDPA. The keys' start and count, and the pool's size, are symbolic, so two graphs
(keys from the pool's first slot, or after it: inductor's reinplacing tells the two apart)
serve every step and every engine of the model. Everything else (batches, prefill, keys
spread over the pool) stays eager. The model's own modules are traced, so the graph computes
what the eager forward computes; bf16 differs by rounding where the fused operations keep
float32 between steps that eager rounds (``PROBE_TOLERANCE``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor import config as inductor_config

from qil_worker.attention.backend import StepAttention
from qil_worker.model.moe import SparseMoeBlock

log = logging.getLogger(__name__)

# (input ids [1], positions [1], flat K [N, Hkv, D], flat V, write slot [1], key start, key count)
# → logits [1, vocab]; the flat K/V are ``KVCache.k`` / ``v`` viewed [layers * slots, Hkv, D]
DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]

# largest |compiled − eager| of the load probe's logits, relative to their scale: a few units of
# the dtype's last place, where fused operations round once instead of twice
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class FlatKV:
    """The KV tensors as the compiled graph addresses them: every layer's slots in one flat
    dimension, written with one ``index_put_`` (a write into a layer's view would make inductor
    copy the whole cache)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, slots_per_layer: int) -> None:
        self.k, self.v, self.slots_per_layer = k, v, slots_per_layer

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        flat = slots + layer * self.slots_per_layer
        self.k.index_put_((flat,), k)
        self.v.index_put_((flat,), v)


class InPlaceDecode(StepAttention):
    """One decode row whose ``length`` keys (this step's included) start at slot ``start`` of
    every layer: attended where they lie, GQA folded into the query length."""

    def __init__(self, slot_mapping: torch.Tensor, start: int, length: int) -> None:
        self.slot_mapping, self.start, self.length = slot_mapping, start, length

    def attend(self, q: torch.Tensor, kv: FlatKV, layer: int) -> torch.Tensor:  # type: ignore[override]
        first = layer * kv.slots_per_layer + self.start
        keys = kv.k[first : first + self.length].unsqueeze(0).transpose(1, 2)  # [1, Hkv, L, D]
        values = kv.v[first : first + self.length].unsqueeze(0).transpose(1, 2)
        kv_heads, dim = keys.shape[1], keys.shape[3]
        out = F.scaled_dot_product_attention(q.reshape(1, kv_heads, -1, dim), keys, values)
        return out.reshape(1, -1)


class _DecodeForward(nn.Module):
    """The model's forward for one in-place decode row: what is compiled."""

    def __init__(self, model: nn.Module) -> None:
        """``model``: a ``Qwen3`` (not imported here: it imports this module)."""
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                slot: torch.Tensor, start: int, length: int) -> torch.Tensor:
        kv = FlatKV(k, v, k.shape[0] // self.model.config.num_hidden_layers)
        attention = InPlaceDecode(slot, start, length)
        x = F.embedding(input_ids, self.model.embed)
        rope = self.model.rope.lookup(positions)
        for layer in self.model.layers:
            x = layer(x, rope, attention, kv)
        return self.model.head(self.model.norm(x))


def frozen_weights() -> contextlib.AbstractContextManager:
    """What every call of the compiled step runs under: no autograd, and inductor's freezing
    (the weights become constants, so it lowers the packed oneDNN matmuls and fuses into them),
    which is read when a call compiles: a recompile must see it too, not only the first call."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(inductor_config.patch(freezing=True))
    return stack


def supports_compiled_decode(model: nn.Module) -> str | None:
    """Why ``model`` (a ``Qwen3``) cannot decode through the compiled graph (None: it can)."""
    if model.device.type != "cpu":
        return "not on the CPU (inductor would emit Triton on CUDA)"
    if model.parallel.sharded:
        return "tensor-parallel ranks make collective calls"
    if any(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers):
        return "a MoE block routes its experts on the host"
    return None


def compile_decode_step(model: nn.Module) -> DecodeStep | None:
    """``model``'s in-place decode forward compiled (weights frozen as constants, dynamic key
    start, count and pool size), checked against the eager forward on a scratch cache → the
    compiled function, or None (logged once) where it cannot be compiled, e.g. no C++ compiler.
    Call after ``torch.set_num_threads``: the generated code's thread count is fixed then."""
    why_not = supports_compiled_decode(model)
    if why_not is not None:
        log.info("decode step not compiled: %s", why_not)
        return None
    forward = _DecodeForward(model).eval()
    compiled = torch.compile(forward, dynamic=True, fullgraph=True)
    heads, layers = model.heads, model.config.num_hidden_layers
    per_layer = 64
    generator = torch.Generator().manual_seed(0)
    scratch = torch.randn(layers * per_layer, heads.kv_heads, heads.head_dim, generator=generator).to(model.dtype)
    start_time = time.perf_counter()
    try:
        for start, length in ((0, 3), (16, 9)):  # (two shapes: the second would recompile a specialised graph)
            k, v = scratch.clone(), scratch.clone()
            for t in (k, v):  # the pool's size is symbolic, the heads are not
                torch._dynamo.mark_static(t, 1)
                torch._dynamo.mark_static(t, 2)
            k_eager, v_eager = k.clone(), v.clone()
            args = (torch.tensor([7]), torch.tensor([length - 1]))
            slot = torch.tensor([start + length - 1])
            with frozen_weights():
                got = compiled(*args, k, v, slot, start, length).float()
            with torch.inference_mode():
                want = forward(*args, k_eager, v_eager, slot, start, length).float()
            error = (got - want).abs().max().item() / want.abs().max().item()
            if not error <= PROBE_TOLERANCE.get(model.dtype, 1e-4):
                raise RuntimeError(f"compiled logits differ from eager by {error:.3g} of their scale")
            written = {layer * per_layer + start + length - 1 for layer in range(layers)}
            changed = set((k != k_eager).flatten(1).any(1).nonzero().flatten().tolist())
            if not changed <= written:
                raise RuntimeError("the compiled step wrote keys outside the row's slots")
    except Exception as exc:  # no compiler, or an inductor failure: the eager step still works
        log.warning("decode step not compiled (%s: %s); every step runs eagerly", type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        return None
    log.info("decode step compiled in %.1f s (one in-place decode row a step)", time.perf_counter() - start_time)
    return compiled
