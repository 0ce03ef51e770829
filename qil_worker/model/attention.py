"""Causal attention over the paged KV cache with one attention call per group of requests.

A step mixes decode tokens (one query per request) and prefill chunks (many). Requests are put in
groups of similar shape (decodes apart from prefill chunks; see ``batch.attention_groups``) and
each group runs as one padded batch:
queries scattered into ``[B, Qmax]``, keys gathered from the page pool into ``[B, Lmax]``
through each request's slot table, and a boolean mask that lets query ``i`` see key ``j`` only
when ``j <= position(i)``. Because a request's keys are exactly positions ``0..ctx_len-1``, that
one comparison is both the causal mask and the "only what was written" mask.

GQA without copying keys: the G query heads that share a KV head are folded into the query
length, so K/V stay at ``num_kv_heads`` and SDPA sees ``[B, Hkv, Qmax*G, D]`` queries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qil_worker.kv.cache import KVCache
from qil_worker.model.varlen import VarlenMetadata, varlen_attention


@dataclass
class AttentionGroup:
    """Requests whose queries are attended together in one padded SDPA call.

    The group's tokens are the contiguous slice ``[start, end)`` of the step's flat tokens.
    """

    start: int
    end: int
    batch: int
    q_max: int
    pad_index: torch.Tensor | None  # [end-start] → row in the padded [batch*q_max]; None if q_max == 1
    key_slots: torch.Tensor  # [batch, l_max] KV slots to gather (padding points at a valid slot)
    key_lengths: torch.Tensor  # [batch] how many keys each request has (for the debug check)
    mask: torch.Tensor  # [batch, 1, q_max*G, l_max] bool, True = may attend
    bias: torch.Tensor | None = None  # the mask as 0 / -inf in the attention dtype, made on first use
    # CPU decodes sharing leading pages: those keys' slots, attended once for all rows; then
    # key_slots / mask / key_lengths cover only the keys after them
    prefix_slots: torch.Tensor | None = None
    # CPU: the same keys as whole pages [batch, l_max / page_size] (l_max is page-aligned there)
    key_pages: torch.Tensor | None = None
    # CPU decodes attended by matmuls: ``KVCache.head_rows`` of key_slots (each KV head's keys
    # contiguous once gathered), made on first use
    key_rows: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers.

    Either ``groups`` (portable gather + SDPA) or ``varlen`` (CUDA varlen flash attention).
    """

    slot_mapping: torch.Tensor  # [T] where each token's K/V are written
    groups: list[AttentionGroup]
    varlen: VarlenMetadata | None = None
    page_size: int = 0


def cpu_kernels(device: torch.device) -> bool:
    """Whether attention on ``device`` takes the CPU's own paths (keys gathered in whole pages,
    shared prefixes read once, matmul kernels) rather than the portable one that CUDA runs (slot
    gathers and SDPA). One switch for ``batch.py`` and this module, so that a test can run the
    CUDA wiring on a CPU."""
    return device.type == "cpu"


def paged_attention(q: torch.Tensor, kv: KVCache, layer: int, meta: AttentionMetadata) -> torch.Tensor:
    """``q`` [T, Hq, D]; ``kv`` already holds this step's keys of ``layer`` → [T, Hq*D]."""
    if meta.varlen is not None:
        return varlen_attention(q, kv, layer, meta.varlen, meta.page_size)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[2]
    groups_per_kv = num_heads // num_kv_heads
    outputs = []
    for g in meta.groups:
        b, qm = g.batch, g.q_max
        qg = q[g.start : g.end]
        if g.pad_index is None:
            q_pad = qg
        else:
            q_pad = qg.new_zeros(b * qm, num_heads, head_dim).index_copy_(0, g.pad_index, qg)
        q_pad = (
            q_pad.view(b, qm, num_kv_heads, groups_per_kv, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(b, num_kv_heads, qm * groups_per_kv, head_dim)
        )
        prefix = _prefix_partial(q_pad, kv, layer, g.prefix_slots) if g.prefix_slots is not None else None
        on_cpu = cpu_kernels(q.device)
        if on_cpu and qm == 1 and (prefix is not None or q.dtype != torch.float32):
            # decode rows attended by matmuls (SDPA's CPU kernel is slow for them in bf16/fp16)
            out = _decode_by_matmuls(q_pad, kv, layer, g, prefix)
        elif on_cpu and qm == 1:  # float32 decode rows: SDPA measured ahead of matmuls there
            out = _decode_by_sdpa(q_pad, kv, layer, g)
        else:  # no shared prefix here: groups get one only on CPU, and only decode groups
            keys, values = _gather_keys(kv, layer, g, 0, b)
            if on_cpu and qm > 1:  # prefill chunks
                out = _prefill_by_matmuls(q_pad, keys, values, _bias(g, q.dtype))
            else:
                # the mask as an additive bias made once per step: SDPA would turn a boolean mask
                # into one itself, in every layer (two more kernels each on CUDA)
                out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=_bias(g, q.dtype))
        out = (
            out.view(b, num_kv_heads, qm, groups_per_kv, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(b * qm, num_heads * head_dim)
        )
        outputs.append(out if g.pad_index is None else out[g.pad_index])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


# CPU attention works in chunks of rows whose big intermediate — decode rows' gathered K and V,
# prefill rows' scores — takes about this much, so the next operation reads it from the CPU's
# cache instead of memory (and no temporary is above glibc's 32 MiB mapping threshold).
CPU_CHUNK_BYTES = 8 << 20


def _decode_by_matmuls(
    q: torch.Tensor,
    kv: KVCache,
    layer: int,
    group: AttentionGroup,
    prefix: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """CPU decode rows ``q`` [B, Hkv, G, D] over their keys gathered head-major
    (``_head_major_rows``), merged with the shared-prefix parts when the group has them;
    rows in chunks of about ``CPU_CHUNK_BYTES`` of K and V.

    Gathering all rows first wrote tens of MB that the matmuls then read back from memory
    (16 rows at 1,000 tokens: 65 MB per layer); chunked, they read it from cache. Measured on
    whole bf16 decode steps (0.6B shape, 2 threads, in one process): 16 rows at 1,000 tokens of
    context 268 → 183 ms, 4 x 2,000 161 → 114 ms, 32 x 500 268 → 228 ms, 8 x 600 111 → 96 ms;
    16 x 300 and 16 x 150 unchanged.
    """
    b, kv_heads, _, dim = q.shape
    l_max = group.key_slots.shape[1]
    rows = _head_major_rows(group, kv)
    per_row = kv_heads * l_max
    bias = _bias(group, torch.float32 if prefix is not None else q.dtype)
    outs = []
    for i, j in _row_chunks(b, 2 * per_row * dim * kv.k.element_size()):
        keys, values = kv.gather_rows(layer, rows[i * per_row : j * per_row])
        keys, values = keys.view(j - i, kv_heads, l_max, dim), values.view(j - i, kv_heads, l_max, dim)
        if prefix is None:
            outs.append(_explicit_attention(q[i:j], keys, values, bias[i:j]))
        else:
            outs.append(_merge_with_prefix(tuple(t[i:j] for t in prefix), q[i:j], keys, values, bias[i:j]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _decode_by_sdpa(q: torch.Tensor, kv: KVCache, layer: int, group: AttentionGroup) -> torch.Tensor:
    """CPU float32 decode rows ``q`` [B, Hkv, G, D] by SDPA over their keys gathered page by page,
    in row chunks as ``_decode_by_matmuls``. Measured on whole float32 decode steps as there:
    16 x 1,000 486 → 299 ms, 4 x 2,000 270 → 190 ms, 8 x 600 220 → 162 ms, 16 x 300 239 → 188
    ms, 32 x 500 479 → 442 ms, 16 x 150 172 → 162 ms."""
    b, kv_heads, _, dim = q.shape
    l_max = group.key_slots.shape[1]
    bias = _bias(group, q.dtype)
    outs = []
    for i, j in _row_chunks(b, 2 * l_max * kv_heads * dim * kv.k.element_size()):
        keys, values = _gather_keys(kv, layer, group, i, j)
        outs.append(F.scaled_dot_product_attention(q[i:j], keys, values, attn_mask=bias[i:j]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _gather_keys(kv: KVCache, layer: int, group: AttentionGroup, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the group's rows ``i..j-1``, viewed [rows, Hkv, l_max, D]: whole pages on CPU,
    slots elsewhere (and on the padded decode path of ``decode_graphs``, which has slots only)."""
    if group.key_pages is not None:
        keys, values = kv.gather_pages(layer, group.key_pages[i:j].reshape(-1))
    else:
        keys, values = kv.gather(layer, group.key_slots[i:j].reshape(-1))
    shape = (j - i, group.key_slots.shape[1], *kv.k.shape[2:])
    return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)


def _prefill_by_matmuls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """CPU prefill rows ``q`` [B, Hkv, Q*G, D] over their keys [B, Hkv, L, D]: a few requests
    at a time, or blocks of one request's queries when its scores alone exceed
    ``CPU_CHUNK_BYTES``. Measured on whole prefills (0.6B shape, 2 threads, one process): float32
    a 1,024-token prompt in one chunk 4.39 → 3.86 s, 2,048 tokens in 512-token chunks 9.41 →
    8.54 s, four 128-token prompts over a cached 512-token prefix 1.68 → 1.63 s; bf16 within
    noise (0.99-1.04x). Splitting a request's queries changes how float32 matmuls sum (1e-5
    relative here), not what they compute."""
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
    """CPU attention as QK^T → masked softmax → PV, as transformers' eager attention does it
    (scores in the model dtype, softmax accumulated in float32): for prefill chunks, and for
    bf16/fp16 decode rows whose keys were gathered head-major (``_head_major_rows``).

    On CPU the two matmuls run at GEMM speed while SDPA's fused kernel is bound by its
    exponentials (measured, bfloat16, scores [2, 8, 436, 730]: SDPA 17 ms, this 5 ms; float32
    on par).
    """
    scores = _scores(q, k, q.dtype).add_(bias)
    return torch.matmul(torch.softmax(scores, dim=-1), v.contiguous())


def _head_major_rows(group: AttentionGroup, kv: KVCache) -> torch.Tensor:
    """The rows that gather the group's keys [batch, Hkv, l_max]: each head's keys contiguous, as
    the two matmuls of ``_explicit_attention`` read them, with no copy in between. Made once per
    step (``KVCache.head_rows``), shared by all layers.

    Measured for bf16 decode steps (0.6B shape, 2 threads, median of 3): 16 rows at 1,000 tokens
    of context 318 → 247 ms, 8 at 600 116 → 94 ms, 16 at 300 107 → 99 ms, against page gather +
    SDPA, whose CPU kernel is slow for so few query rows per head. In float32 SDPA stays ahead
    (0.94-0.97x), so float32 decodes keep it unless they share a cached prefix: that path was
    matmuls already and gains from contiguous keys in both dtypes (decode steps of the
    prefix-heavy benchmark, bf16 10.4 → 9.3 s, float32 25.5-29.8 → 23.9-24.8 s).
    """
    if group.key_rows is None:
        group.key_rows = kv.head_rows(group.key_slots)
    return group.key_rows


def _scores(q: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scaled QK^T in ``dtype`` for q [B, Hkv, Q, D] and gathered keys viewed [B, Hkv, L, D]."""
    # The view is [B, L, Hkv, D] underneath: one copy with 256-byte runs here, or matmul makes a
    # far slower element-strided one of k^T (measured 2.8 vs 11.5 ms per call).
    return torch.matmul(q, k.contiguous().transpose(-1, -2)).to(dtype).mul_(q.shape[-1] ** -0.5)


def _bias(group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    """The group's mask as 0 / -inf in ``dtype``, made once and shared by all layers."""
    if group.bias is None or group.bias.dtype != dtype:
        group.bias = torch.zeros(group.mask.shape, dtype=dtype, device=group.mask.device).masked_fill_(
            ~group.mask, float("-inf")
        )
    return group.bias


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
