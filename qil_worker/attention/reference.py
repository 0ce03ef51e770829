"""Plain-torch stand-ins for torch's varlen flash kernels (CUDA only), so that the varlen
backends' wiring — offsets, packed key slots, block tables, decode-graph buckets and scratch
rows — runs and is checked on any device: same contract, one request at a time through SDPA.
Slow; for tests and for checking a kernel against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qil_worker.attention.names import PACKED
from qil_worker.attention.segments import VarlenSegments
from qil_worker.attention.varlen import VarlenPacked, VarlenPaged


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor | None,
    max_q: int,
    max_k: int,
    *,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """What ``varlen_attn`` computes: per request, its queries over its keys — packed
    (``key`` [K, Hkv, D] at ``cu_seq_k``) or paged (``key`` [pages, page, Hkv, D] through
    ``block_table``, ``seqused_k`` keys each) — causal aligned to the end of the keys when
    ``window_size == (-1, 0)``, GQA. Asserts that ``max_q`` / ``max_k`` bound every request."""
    assert window_size in ((-1, 0), (-1, -1)) and enable_gqa
    if block_table is not None:
        pages, page, heads, dim = key.shape
        flat_k, flat_v = key.reshape(-1, heads, dim), value.reshape(-1, heads, dim)
        lengths = seqused_k.tolist()
        slots = [
            (block_table[r].long()[:, None] * page + torch.arange(page, device=key.device)).reshape(-1)[:n]
            for r, n in enumerate(lengths)
        ]
        key, value = flat_k[torch.cat(slots)], flat_v[torch.cat(slots)]
        cu_k = [0]
        for n in lengths:
            cu_k.append(cu_k[-1] + n)
    else:
        cu_k = cu_seq_k.tolist()
    cu_q = cu_seq_q.tolist()
    assert key.shape[0] >= cu_k[-1] and query.shape[0] == cu_q[-1]
    groups = query.shape[1] // key.shape[1]
    out = []
    for r in range(len(cu_q) - 1):
        n_q, n_k = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        assert n_q <= max_q and n_k <= max_k, "the kernel's maxima must bound every request"
        queries = query[cu_q[r] : cu_q[r + 1]].transpose(0, 1)
        keys = key[cu_k[r] : cu_k[r + 1]].repeat_interleave(groups, 1).transpose(0, 1)
        values = value[cu_k[r] : cu_k[r + 1]].repeat_interleave(groups, 1).transpose(0, 1)
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
        if window_size != (-1, 0):
            mask = torch.ones_like(mask)
        out.append(
            F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask.to(query.device)).transpose(0, 1)
        )
    return torch.cat(out)


def reference_segment_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    starts: torch.Tensor,
    max_q: int,
    max_k: int,
    seqused_k: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``segments.torch_segment_attn`` computes: sequence ``s``'s queries over the
    ``seqused_k[s]`` keys from slot ``starts[s]`` of ``key`` [slots, Hkv, D] (no mask, GQA) →
    (out [Q, Hq, D], log-sum-exp [Q, Hq] float32)."""
    cu_q, first, used = cu_seq_q.tolist(), starts.tolist(), seqused_k.tolist()
    groups = query.shape[1] // key.shape[1]
    scale = query.shape[-1] ** -0.5
    outs, lses = [], []
    for s, (start, n) in enumerate(zip(first, used)):
        assert cu_q[s + 1] - cu_q[s] <= max_q and 1 <= n <= max_k, "the kernel's maxima must bound every sequence"
        q = query[cu_q[s] : cu_q[s + 1]].float().transpose(0, 1)  # [Hq, q, D]
        k = key[start : start + n].float().repeat_interleave(groups, 1).transpose(0, 1)
        v = value[start : start + n].float().repeat_interleave(groups, 1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale  # [Hq, q, n]
        lses.append(scores.logsumexp(-1).transpose(0, 1))  # [q, Hq]
        outs.append((scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype))
    return torch.cat(outs), torch.cat(lses)


def reference_segments_backend() -> VarlenSegments:
    """The ``varlen-pages`` backend computed by the reference kernels (its prefill steps by
    ``reference_varlen_attn``, packed)."""
    return VarlenSegments(kernel=reference_segment_attn, packed=VarlenPacked(kernel=reference_varlen_attn))


def reference_backend(mode: str) -> VarlenPaged:
    """The ``PAGED`` or ``PACKED`` varlen backend computed by ``reference_varlen_attn``."""
    return (VarlenPacked if mode == PACKED else VarlenPaged)(kernel=reference_varlen_attn)
