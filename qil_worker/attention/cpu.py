"""The CPU's own attention: the groups of ``sdpa`` attended by kernels that suit a CPU.

A CPU step is bound by memory traffic and by SDPA's exponentials rather than by launches, so:

- keys are gathered in whole pages (one index per page, not per token), except a lone decode
  row's whose pages are consecutive in the pool: those are attended in place by SDPA;
- decode rows that share leading pages (a cached prompt prefix) attend those keys once for the
  whole group, and the rows' own keys after them; the two parts merge by log-sum-exp;
- bf16/fp16 decode rows, and decodes with a shared prefix, run as two matmuls over keys gathered
  head-major (each KV head's keys contiguous), where SDPA's CPU kernel is slow for so few query
  rows per head; float32 decode rows without a shared prefix keep SDPA, which is ahead there;
- prefill chunks run as QK^T → masked softmax → PV, at GEMM speed;
- every kernel works in chunks of rows whose big intermediate (decode rows' gathered K and V,
  prefill rows' scores) is about ``CPU_CHUNK_BYTES``, so the next operation reads it from the
  CPU's cache instead of memory, and no temporary is above glibc's 32 MiB mapping threshold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from qil_worker.attention.backend import Chunk
from qil_worker.attention.sdpa import AttentionGroup, GatherSdpa, GroupKernel, bias, gather_keys
from qil_worker.kv.page_table import consecutive_start

if TYPE_CHECKING:
    from qil_worker.kv.cache import KVCache

CPU_CHUNK_BYTES = 8 << 20
MIN_SHARED_PREFIX_TOKENS = 64  # fewer shared keys than this are not worth a separate pass


class CpuAttention(GatherSdpa):
    """``sdpa``'s groups (and name: the choice is the same), gathered and attended as above."""

    whole_pages = True

    def kernel(self, q_max: int) -> GroupKernel:
        return decode_kernel if q_max == 1 else prefill_kernel

    def shared_prefix_pages(self, members: list[Chunk], page_size: int) -> int:
        """Leading pages that every decode row of the group holds (the same physical pages,
        shared through the prefix cache), all before every row's current token; 0 when too few
        to pay."""
        if len(members) < 2:
            return 0
        limit = min(c.start for c in members) // page_size
        tables = [c.pages for c in members]
        first = tables[0]
        shared = 0  # column by column, stopping at the first row that differs (mostly row 2)
        while shared < limit and all(table[shared] == first[shared] for table in tables):
            shared += 1
        return shared if shared * page_size >= MIN_SHARED_PREFIX_TOKENS else 0

    def key_run(self, members: list[Chunk], key_pages: int, page_size: int) -> int | None:
        """A lone decode row whose pages are consecutive in the pool (what the page pool gives a
        request growing alone: the common batch-1 case): its keys lie back to back already, so
        they are attended in place instead of being copied out first."""
        if len(members) != 1:
            return None
        first = consecutive_start(members[0].pages, key_pages)
        return None if first is None else first * page_size


def decode_kernel(q: torch.Tensor, kv: KVCache, layer: int, group: AttentionGroup) -> torch.Tensor:
    """Decode rows ``q`` [B, Hkv, G, D]: a lone row with consecutive pages by SDPA over its keys
    in place; otherwise by matmuls where SDPA's CPU kernel is slow for them (bf16/fp16) or where
    a shared prefix is merged in; float32 rows by SDPA."""
    if group.key_run is not None:
        return _decode_in_place(q, kv, layer, group)
    prefix = _prefix_partial(q, kv, layer, group.prefix_slots) if group.prefix_slots is not None else None
    if prefix is not None or q.dtype != torch.float32:
        return _decode_by_matmuls(q, kv, layer, group, prefix)
    return _decode_by_sdpa(q, kv, layer, group)


def prefill_kernel(q: torch.Tensor, kv: KVCache, layer: int, group: AttentionGroup) -> torch.Tensor:
    """Prefill chunks ``q`` [B, Hkv, Q*G, D] over their keys gathered in whole pages."""
    keys, values = gather_keys(kv, layer, group, 0, group.batch)
    return _prefill_by_matmuls(q, keys, values, bias(group, q.dtype))


def _decode_by_matmuls(
    q: torch.Tensor,
    kv: KVCache,
    layer: int,
    group: AttentionGroup,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Decode rows ``q`` [B, Hkv, G, D] over their keys gathered head-major
    (``_head_major_rows``), merged with the shared-prefix parts when the group has them; rows
    in chunks of about ``CPU_CHUNK_BYTES`` of K and V, so the matmuls read the gathered keys
    from cache rather than memory."""
    b, kv_heads, _, dim = q.shape
    l_max = group.key_slots.shape[1]
    rows = _head_major_rows(group, kv)
    per_row = kv_heads * l_max
    row_bias = bias(group, torch.float32 if prefix is not None else q.dtype)
    outs = []
    for i, j in _row_chunks(b, 2 * per_row * dim * kv.k.element_size()):
        keys, values = kv.gather_rows(layer, rows[i * per_row : j * per_row])
        keys, values = keys.view(j - i, kv_heads, l_max, dim), values.view(j - i, kv_heads, l_max, dim)
        if prefix is None:
            outs.append(_explicit_attention(q[i:j], keys, values, row_bias[i:j]))
        else:
            outs.append(_merge_with_prefix(tuple(t[i:j] for t in prefix), q[i:j], keys, values, row_bias[i:j]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _decode_in_place(q: torch.Tensor, kv: KVCache, layer: int, group: AttentionGroup) -> torch.Tensor:
    """One decode row ``q`` [1, Hkv, G, D] by SDPA over its keys where they lie in the cache
    (``AttentionGroup.key_run``): a strided view, no gather. Copying a lone row's keys out costs
    more than attending them: they come from memory, not cache, after a step's worth of weights."""
    start, length = group.key_run, group.key_slots.shape[1]
    keys = kv.k[layer, start : start + length].unsqueeze(0).transpose(1, 2)  # [1, Hkv, L, D]
    values = kv.v[layer, start : start + length].unsqueeze(0).transpose(1, 2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias(group, q.dtype))


def _decode_by_sdpa(q: torch.Tensor, kv: KVCache, layer: int, group: AttentionGroup) -> torch.Tensor:
    """Float32 decode rows ``q`` [B, Hkv, G, D] by SDPA over their keys gathered page by page,
    in row chunks as ``_decode_by_matmuls``."""
    b, kv_heads, _, dim = q.shape
    l_max = group.key_slots.shape[1]
    row_bias = bias(group, q.dtype)
    outs = []
    for i, j in _row_chunks(b, 2 * l_max * kv_heads * dim * kv.k.element_size()):
        keys, values = gather_keys(kv, layer, group, i, j)
        outs.append(F.scaled_dot_product_attention(q[i:j], keys, values, attn_mask=row_bias[i:j]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill_by_matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Prefill rows ``q`` [B, Hkv, Q*G, D] over their keys [B, Hkv, L, D]: a few requests at a
    time, or blocks of one request's queries when its scores alone exceed ``CPU_CHUNK_BYTES``.
    Splitting a request's queries changes how float32 matmuls sum (1e-5 relative), not what
    they compute."""
    b, kv_heads, rows, _ = q.shape
    score_row = kv_heads * k.shape[2] * 4  # bytes of one query row's scores, float32 at most
    if b * rows * score_row <= CPU_CHUNK_BYTES:
        return _explicit_attention(q, k, v, bias)
    outs = []
    for i, j in _row_chunks(b, rows * score_row):
        keys, values = k[i:j].contiguous(), v[i:j].contiguous()
        block = max(1, CPU_CHUNK_BYTES // ((j - i) * score_row))
        parts = [
            _explicit_attention(q[i:j, :, s : s + block], keys, values, bias[i:j, :, s : s + block])
            for s in range(0, rows, block)
        ]
        outs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _row_chunks(batch: int, bytes_per_row: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of about ``CPU_CHUNK_BYTES`` each (at least one row)."""
    step = max(1, CPU_CHUNK_BYTES // bytes_per_row)
    return [(i, min(batch, i + step)) for i in range(0, batch, step)]


def _explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention as QK^T → masked softmax → PV, as transformers' eager attention does it (scores
    in the model dtype, softmax accumulated in float32): for prefill chunks, and for bf16/fp16
    decode rows whose keys were gathered head-major (``_head_major_rows``). On CPU the two
    matmuls run at GEMM speed, while SDPA's fused kernel is bound by its exponentials."""
    scores = _scores(q, k, q.dtype).add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), v.contiguous())


def _head_major_rows(group: AttentionGroup, kv: KVCache) -> torch.Tensor:
    """The rows that gather the group's keys [batch, Hkv, l_max]: each head's keys contiguous, as
    the two matmuls of ``_explicit_attention`` read them, with no copy in between. Made once per
    step (``KVCache.head_rows``), shared by all layers."""
    if group.key_rows is None:
        group.key_rows = kv.head_rows(group.key_slots)
    return group.key_rows


def _scores(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scaled QK^T in ``dtype`` for q [B, Hkv, Q, D] and gathered keys viewed [B, Hkv, L, D]."""
    # The view is [B, L, Hkv, D] underneath: one copy with 256-byte runs here, or matmul makes a
    # far slower element-strided copy of k^T.
    return torch.matmul(q, k.contiguous().transpose(-1, -2)).to(dtype).mul_(q.shape[-1] ** -0.5)


def _softmax_parts(
    scores: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised softmax attention over float32 ``scores``: (row max, sum of exponentials,
    exp-weighted ``values``), so partial results over disjoint key sets can be merged."""
    high = scores.amax(-1, keepdim=True)
    weights = scores.sub_(high).exp_()
    return high, weights.sum(-1, keepdim=True), torch.matmul(weights.to(dtype), values).float()


def _prefix_partial(
    q: torch.Tensor, kv: KVCache, layer: int, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention parts (``_softmax_parts``) of decode queries ``q`` [B, Hkv, G, D] over the keys
    every row shares, gathered (head-major) and read once for the whole group instead of once per
    row.

    Shaped [B, Hkv, G, *] like the rows' own parts.
    """
    b, kv_heads, groups, dim = q.shape
    q_heads = q.permute(1, 0, 2, 3).reshape(kv_heads, b * groups, dim)
    keys, values = kv.gather_rows(layer, kv.head_rows(slots))
    keys, values = keys.view(kv_heads, -1, dim), values.view(kv_heads, -1, dim)  # [Hkv, Lp, D]
    scores = torch.bmm(q_heads, keys.transpose(1, 2)).float().mul_(dim**-0.5)  # [Hkv, B*G, Lp]
    parts = _softmax_parts(scores, values, q.dtype)
    return tuple(t.view(kv_heads, b, groups, t.shape[-1]).permute(1, 0, 2, 3) for t in parts)


def _merge_with_prefix(
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Attention over the rows' own keys, combined with the shared-prefix part by log-sum-exp."""
    high_p, total_p, weighted_p = prefix
    scores = _scores(q, k, torch.float32).add_(bias)
    # high_s is finite: each row's own token is among these keys
    high_s, total_s, weighted_s = _softmax_parts(scores, v.contiguous(), q.dtype)
    high = torch.maximum(high_p, high_s)
    scale_p, scale_s = torch.exp(high_p - high), torch.exp(high_s - high)
    out = (weighted_p * scale_p + weighted_s * scale_s) / (total_p * scale_p + total_s * scale_s)
    return out.to(q.dtype)
