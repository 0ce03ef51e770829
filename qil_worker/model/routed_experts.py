"""A few-token step's routed int8 experts as one compiled call (CPU, inductor's C++ backend).

At decode sizes the per-expert loop (``int8_experts``) makes two kernel calls for every active
expert, each reading one small weight cold from memory and paying its own thread start-up:
at 8 tokens, ~50 experts a layer. Here every (token, expert) pair's gate/up dot products,
SiLU·mul, down projection and the weighted sum over the k slots are one graph whose loops read
the chosen experts' int8 codes through the routing ids (what llama.cpp's ``mul_mat_id`` does):
no host sync, no copy of the weights, one parallel region per projection. The work grows with
the pairs (an expert's codes are read once per pair, not once per expert), so the loop, whose
matmuls reuse an expert's codes across its rows, stays faster above ``MAX_TOKENS``.

Only int8 experts: bf16 and float32 experts are packed for oneDNN, an opaque layout a compiled
loop cannot read, and a plain copy beside it would double the experts' memory. CUDA keeps
``torch._grouped_mm`` (inductor would emit Triton there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_TOKENS = 16  # faster than the loop up to here on the 30B-A3B shape; more keep the loop (docs/performance.md)

RoutedExperts = Callable[..., torch.Tensor]
PROBE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def routed_int8_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down: torch.Tensor,
    down_scales: torch.Tensor,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` → [T, hidden] in ``x``'s dtype.

    x [T, hidden]; ids, weights [T, k]; gate_up [E, 2I, hidden] and down [E, hidden, I] int8
    codes with per-row scales [E, 2I] / [E, hidden]. Rounded to ``x``'s dtype where the loop's
    kernels round (each projection's output, the SiLU·mul, each weighted expert output), so
    both paths compute the same thing; float32 accumulation inside each dot product."""
    tokens, k = ids.shape
    pairs = ids.reshape(-1)
    rows = x.unsqueeze(1).expand(tokens, k, x.shape[1]).reshape(tokens * k, -1).float()
    gate_up_out = (rows[:, None, :] * gate_up[pairs].float()).sum(-1) * gate_up_scales[pairs].float()
    gate, up = gate_up_out.to(x.dtype).chunk(2, dim=-1)
    act = (F.silu(gate) * up).float()
    down_out = (act[:, None, :] * down[pairs].float()).sum(-1) * down_scales[pairs].float()
    return (down_out.to(x.dtype).view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


def compiled_int8_experts(hidden: int, intermediate: int, num_experts: int, top_k: int,
                          dtype: torch.dtype) -> RoutedExperts | None:
    """``routed_int8_experts`` compiled by inductor and warmed at 1 and 2 tokens (1 is its own
    graph; 2 makes the token count dynamic, so 2..``MAX_TOKENS`` share one graph), for experts
    of this shape → the compiled function, or None (logged once) where compiling fails, e.g.
    no C++ compiler: the caller keeps the loop. Call after ``torch.set_num_threads``: the
    generated code's thread count is fixed when it is compiled."""
    compiled = torch.compile(routed_int8_experts, dynamic=None, fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randint(-127, 128, (num_experts, 2 * intermediate, hidden), dtype=torch.int8, generator=generator)
    down = torch.randint(-127, 128, (num_experts, hidden, intermediate), dtype=torch.int8, generator=generator)
    gate_up_scales = torch.full((num_experts, 2 * intermediate), 1e-3, dtype=dtype)
    down_scales = torch.full((num_experts, hidden), 1e-3, dtype=dtype)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for tokens in (1, 2):
                x = torch.randn(tokens, hidden, generator=generator).to(dtype)
                ids = torch.arange(tokens * top_k).remainder(num_experts).view(tokens, top_k)
                weights = torch.full((tokens, top_k), 1 / top_k, dtype=dtype)
                args = (x, ids, weights, gate_up, gate_up_scales, down, down_scales)
                got, want = compiled(*args).float(), routed_int8_experts(*args).float()
                # the two round at the same points but may sum in another order: a few units
                # of the dtype's last place, relative to the output's scale
                error = (got - want).abs().max().item() / want.abs().max().item()
                if not error <= PROBE_TOLERANCE[dtype]:
                    raise RuntimeError(f"compiled output differs from eager by {error:.3g} of its scale")
    except Exception as exc:  # no compiler, or an inductor failure: the loop still works
        log.warning("routed int8 experts not compiled (%s: %s); few-token steps keep the per-expert loop",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    log.info("routed int8 experts compiled for steps of up to %d tokens in %.1f s", MAX_TOKENS,
             time.perf_counter() - start)
    return compiled
