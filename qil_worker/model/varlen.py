"""CUDA fast path: torch's own paged variable-length flash attention (no gather, no padding).

``torch.nn.attention.varlen.varlen_attn`` reads K/V straight from the page pool through a block
table. Only some torch builds have it with ``block_table``, and the flash kernel constrains page
sizes and dtypes, so ``probe_varlen`` runs it once on tiny inputs and the engine falls back to
gather + SDPA when it fails.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class VarlenMetadata:
    cu_seq_q: torch.Tensor  # [N+1] int32, query offsets of each request in the flat tokens
    cu_seq_k: torch.Tensor  # [N+1] int32, cumulative key counts
    seq_used_k: torch.Tensor  # [N] int32, keys of each request (its context length)
    block_table: torch.Tensor  # [N, max_pages] int32
    max_q: int
    max_k: int


def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if "block_table" in params and "seqused_k" in params else None


def varlen_paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMetadata, page_size: int
) -> torch.Tensor:
    """``q`` [T, Hq, D]; caches [slots, Hkv, D] → [T, Hq*D]."""
    fn = _varlen_fn()
    slots, heads, dim = k_cache.shape
    pages = slots // page_size
    out = fn(
        q,
        k_cache.view(pages, page_size, heads, dim),
        v_cache.view(pages, page_size, heads, dim),
        meta.cu_seq_q,
        meta.cu_seq_k,
        meta.max_q,
        meta.max_k,
        window_size=(-1, 0),  # causal, aligned to the end of each request's keys
        enable_gqa=True,
        seqused_k=meta.seq_used_k,
        block_table=meta.block_table,
    )
    return out.reshape(q.shape[0], -1)


def probe_varlen(device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int) -> str | None:
    """None if the varlen path works here, else why not (for the startup log)."""
    if device.type != "cuda":
        return "not a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention needs float16/bfloat16, not {dtype}"
    if _varlen_fn() is None:
        return f"torch {torch.__version__} has no varlen_attn with a block table"
    try:
        q = torch.randn(3, heads, dim, device=device, dtype=dtype)
        cache = torch.randn(2 * page_size, kv_heads, dim, device=device, dtype=dtype)
        i32 = dict(device=device, dtype=torch.int32)
        meta = VarlenMetadata(
            cu_seq_q=torch.tensor([0, 1, 3], **i32),
            cu_seq_k=torch.tensor([0, 5, 7], **i32),
            seq_used_k=torch.tensor([5, 2], **i32),
            block_table=torch.tensor([[0], [1]], **i32),
            max_q=2,
            max_k=5,
        )
        varlen_paged_attention(q, cache, cache, meta, page_size)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the portable path
        return f"varlen_attn failed on this build/page size: {type(exc).__name__}: {exc}"
    return None
