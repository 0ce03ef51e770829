"""CUDA fast paths: torch's own variable-length flash attention, one call per layer per step.

``torch.nn.attention.varlen.varlen_attn`` attends every request of a step at once, each with its
own query and key count, causally aligned to the end of its keys — no padding, no mask. Two ways
to hand it the keys:

- **paged** (``PAGED``): K/V read straight from the page pool through a block table; nothing is
  gathered. Only some torch builds take ``block_table`` (2.13 does, 2.11 does not).
- **packed** (``PACKED``): every request's keys gathered from the pool, request after request,
  into one [total keys, Hkv, D] tensor — what the padded SDPA path gathers, without padding each
  request to the longest (a decode batch whose contexts spread from 100 to 2,000 tokens gathers
  about half the bytes) and without a mask. Works wherever ``varlen_attn`` exists at all.

Which of them a build supports, with which page sizes and dtypes, is found by ``probe_varlen``:
it runs each on small inputs and compares the result with plain SDPA, so a kernel that runs but
aligns the causal mask differently is refused too. The engine falls back to gather + SDPA.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from qil_worker.attention_backends import ATTENTION_CHOICES, PACKED, PAGED, SDPA

if TYPE_CHECKING:
    from qil_worker.kv.cache import KVCache

__all__ = ["ATTENTION_CHOICES", "PACKED", "PAGED", "SDPA", "VarlenMetadata", "choose_attention", "probe_varlen",
           "varlen_attention"]


@dataclass
class VarlenMetadata:
    cu_seq_q: torch.Tensor  # [N+1] int32, query offsets of each request in the flat tokens
    cu_seq_k: torch.Tensor  # [N+1] int32, cumulative key counts
    seq_used_k: torch.Tensor  # [N] int32, keys of each request (its context length)
    block_table: torch.Tensor | None  # [N, max_pages] int32 (paged); None when packed
    max_q: int
    max_k: int  # at least the longest request's keys (an upper bound is fine)
    # packed: the KV slot of every key, request after request ([>= cu_seq_k[-1]]; any slots
    # after the last request's keys are gathered but not read)
    key_slots: torch.Tensor | None = None
    # False when every request has one query, which sees all its keys anyway: flash then serves
    # the query heads of a KV head from one read of its keys (GQA) instead of one per head
    causal: bool = True


def _varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _mask_kwargs(fn: Callable, causal: bool) -> dict:
    """Causal (aligned to the end of each request's keys) or not, and GQA, in this build's
    spelling."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kwargs: dict = {"window_size": (-1, 0) if causal else (-1, -1)}
    else:
        kwargs = {"is_causal": causal}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def packed_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: VarlenMetadata
) -> torch.Tensor:
    """Varlen attention of ``q`` [T, Hq, D] over packed ``k``/``v`` [K, Hkv, D]."""
    fn = _varlen_attn()
    return fn(q, k, v, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, **_mask_kwargs(fn, meta.causal))


def varlen_attention(q: torch.Tensor, kv: KVCache, layer: int, meta: VarlenMetadata, page_size: int) -> torch.Tensor:
    """``q`` [T, Hq, D] → [T, Hq*D]; ``kv`` already holds this step's keys of ``layer``."""
    if meta.block_table is None:
        keys, values = kv.gather(layer, meta.key_slots)
        return packed_kernel(q, keys, values, meta).reshape(q.shape[0], -1)
    fn = _varlen_attn()
    k_cache, v_cache = kv.k[layer], kv.v[layer]
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
        seqused_k=meta.seq_used_k,
        block_table=meta.block_table,
        **_mask_kwargs(fn, meta.causal),
    )
    return out.reshape(q.shape[0], -1)


def choose_attention(
    requested: str, device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int
) -> tuple[str, str | None]:
    """(backend, why the paged kernel is not used or None) for ``requested`` in
    ``ATTENTION_CHOICES``. ``auto`` takes the paged kernel where it works, else gather + SDPA
    (the packed kernel is opt-in until it is measured on a GPU); an explicit varlen choice that
    does not work here is an error."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {requested!r}")
    if requested == SDPA:
        return SDPA, None
    mode = PACKED if requested == PACKED else PAGED
    why_not = probe_varlen(device, dtype, page_size, heads, kv_heads, dim, mode)
    if why_not is None:
        return mode, None
    if requested != "auto":
        raise ValueError(f"attention {requested!r} is unavailable: {why_not}")
    return SDPA, why_not


def probe_varlen(
    device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int, mode: str = PAGED
) -> str | None:
    """None if ``mode`` (``PAGED`` or ``PACKED``) works here and agrees with SDPA, else why not."""
    if device.type != "cuda":
        return "not a CUDA device"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention needs float16/bfloat16, not {dtype}"
    fn = _varlen_attn()
    if fn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if mode == PAGED and "block_table" not in inspect.signature(fn).parameters:
        return f"torch {torch.__version__} has no varlen_attn with a block table"
    try:
        for q_lens, causal in (((2, 1), True), ((1, 1), False)):  # chunks; decode rows as graphs run them
            why = _check_against_sdpa(device, dtype, page_size, heads, kv_heads, dim, mode, q_lens, causal)
            if why is not None:
                return why
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means: use the portable path
        return f"varlen_attn failed on this build/page size: {type(exc).__name__}: {exc}"


class _Pool:
    """What ``varlen_attention`` reads of a ``KVCache`` (one layer), for the probe."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k[None], v[None]

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)


def _check_against_sdpa(
    device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int, mode: str,
    q_lens: tuple[int, int] = (2, 1), causal: bool = True,
) -> str | None:
    """Two requests with 5 and 2 keys and ``q_lens`` queries (their last positions); request 1's
    pages come first in the pool."""
    lengths = (5, 2)
    pages = [-(-n // page_size) for n in lengths]
    first_page = (pages[1], 0)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(sum(q_lens), heads, dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(sum(pages) * page_size, kv_heads, dim, device=device, dtype=dtype, generator=gen)
    v = torch.randn(sum(pages) * page_size, kv_heads, dim, device=device, dtype=dtype, generator=gen)
    i32 = dict(device=device, dtype=torch.int32)
    slots = [list(range(first * page_size, first * page_size + n)) for first, n in zip(first_page, lengths)]
    table = [[first + j for j in range(max(pages))] for first in first_page]  # past the end: unread
    meta = VarlenMetadata(
        cu_seq_q=torch.tensor([0, q_lens[0], sum(q_lens)], **i32),
        cu_seq_k=torch.tensor([0, lengths[0], sum(lengths)], **i32),
        seq_used_k=torch.tensor(lengths, **i32),
        block_table=torch.tensor(table, **i32).clamp_(max=sum(pages) - 1) if mode == PAGED else None,
        max_q=max(q_lens),
        max_k=max(lengths),
        key_slots=None if mode == PAGED else torch.tensor(slots[0] + slots[1], device=device),
        causal=causal,
    )
    got = varlen_attention(q, _Pool(k, v), 0, meta, page_size).view(q.shape).float()
    want = []
    for (start, end), request_slots in zip(((0, q_lens[0]), (q_lens[0], sum(q_lens))), slots):
        index = torch.tensor(request_slots, device=device)
        keys = k.index_select(0, index).float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        values = v.index_select(0, index).float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        n_q, n_k = end - start, len(request_slots)
        mask = torch.arange(n_k, device=device)[None, :] <= torch.arange(n_k - n_q, n_k, device=device)[:, None]
        out = F.scaled_dot_product_attention(q[start:end].float().transpose(0, 1), keys, values, attn_mask=mask)
        want.append(out.transpose(0, 1))
    error = (got - torch.cat(want)).abs().max().item()
    kind = "causal" if causal else "decode"
    return None if error < 2e-2 else f"{mode} attention ({kind}) differs from SDPA by {error:.3g}"
