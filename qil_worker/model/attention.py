"""Causal attention over the paged KV cache with one SDPA call per group of requests.

A step mixes decode tokens (one query per request) and prefill chunks (many). Requests are put in
at most two groups — decodes, then prefill chunks — and each group runs as one padded batch:
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

from qil_worker.model.varlen import VarlenMetadata, varlen_paged_attention


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


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step, shared by all layers.

    Either ``groups`` (portable gather + SDPA) or ``varlen`` (CUDA paged flash attention).
    """

    slot_mapping: torch.Tensor  # [T] where each token's K/V are written
    groups: list[AttentionGroup]
    varlen: VarlenMetadata | None = None
    page_size: int = 0


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """``q`` [T, Hq, D]; caches [slots, Hkv, D] already holding this step's keys → [T, Hq*D]."""
    if meta.varlen is not None:
        return varlen_paged_attention(q, k_cache, v_cache, meta.varlen, meta.page_size)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
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
        slots = g.key_slots.view(-1)
        l_max = g.key_slots.shape[1]
        keys = k_cache.index_select(0, slots).view(b, l_max, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, slots).view(b, l_max, num_kv_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=g.mask)
        out = (
            out.view(b, num_kv_heads, qm, groups_per_kv, head_dim)
            .permute(0, 2, 1, 3, 4)
            .reshape(b * qm, num_heads * head_dim)
        )
        outputs.append(out if g.pad_index is None else out[g.pad_index])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
