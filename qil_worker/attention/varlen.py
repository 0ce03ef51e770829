"""CUDA fast paths: torch's own variable-length flash attention, one call per layer per step.

``torch.nn.attention.varlen.varlen_attn`` attends every request of a step at once, each with its
own query and key count, causally aligned to the end of its keys — no padding, no mask. Two ways
to hand it the keys:

- **paged** (``VarlenPaged``): K/V read straight from the page pool through a block table;
  nothing is gathered. Only some torch builds take ``block_table`` (2.13 does, 2.11 does not).
- **packed** (``VarlenPacked``): every request's keys gathered from the pool, request after
  request, into one [total keys, Hkv, D] tensor — what the padded SDPA path gathers, without
  padding each request to the longest and without a mask. Works wherever ``varlen_attn``
  exists at all.

Both take the kernel as an argument (default: this build's ``varlen_attn``), so the plain-torch
``reference.reference_varlen_attn`` runs the same wiring on any device. Which of them a build
supports is found at start-up by ``choice.probe_varlen``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qil_worker.attention.backend import AttentionBackend, StepAttention, StepLayout
from qil_worker.attention.names import PACKED, PAGED
from qil_worker.kv.slots import kv_slots

if TYPE_CHECKING:
    from qil_worker.kv.cache import KVCache


def torch_varlen_attn() -> Callable | None:
    """This build's ``varlen_attn``, or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _mask_kwargs(fn: Callable, causal: bool) -> dict:
    """Causal (aligned to the end of each request's keys) or not, and GQA, in ``fn``'s spelling
    (torch 2.11 takes ``is_causal``, later builds ``window_size``)."""
    params = inspect.signature(fn).parameters
    if "window_size" in params:
        kwargs: dict = {"window_size": (-1, 0) if causal else (-1, -1)}
    else:
        kwargs = {"is_causal": causal}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def takes_block_table(fn: Callable) -> bool:
    return "block_table" in inspect.signature(fn).parameters


@dataclass
class VarlenMetadata(StepAttention):
    """A step's attention as one varlen kernel call per layer."""

    slot_mapping: torch.Tensor  # [T]
    cu_seq_q: torch.Tensor  # [N+1] int32, query offsets of each request in the flat tokens
    cu_seq_k: torch.Tensor  # [N+1] int32, cumulative key counts
    seq_used_k: torch.Tensor  # [N] int32, keys of each request (its context length)
    block_table: torch.Tensor | None  # [N, max_pages] int32 (paged); None when packed
    max_q: int
    max_k: int  # at least the longest request's keys (an upper bound is fine)
    kernel: Callable  # varlen_attn or a stand-in with its contract
    mask: dict  # the kernel's causal / GQA keywords (``_mask_kwargs``)
    page_size: int
    # packed: the KV slot of every key, request after request ([>= cu_seq_k[-1]]; any slots
    # after the last request's keys are gathered but not read)
    key_slots: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, kv: KVCache, layer: int) -> torch.Tensor:
        if self.block_table is None:
            keys, values = kv.gather(layer, self.key_slots)
            out = self.kernel(q, keys, values, self.cu_seq_q, self.cu_seq_k, self.max_q, self.max_k, **self.mask)
            return out.reshape(q.shape[0], -1)
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        slots, heads, dim = k_cache.shape
        pages = slots // self.page_size
        out = self.kernel(
            q,
            k_cache.view(pages, self.page_size, heads, dim),
            v_cache.view(pages, self.page_size, heads, dim),
            self.cu_seq_q,
            self.cu_seq_k,
            self.max_q,
            self.max_k,
            seqused_k=self.seq_used_k,
            block_table=self.block_table,
            **self.mask,
        )
        return out.reshape(q.shape[0], -1)


class VarlenPaged(AttentionBackend):
    """Varlen flash attention reading K/V through each request's block table."""

    name = PAGED
    gathers_keys = False
    static_steps = True

    def __init__(self, kernel: Callable | None = None) -> None:
        self.kernel = kernel if kernel is not None else torch_varlen_attn()
        if self.kernel is None:
            raise ValueError(f"torch {torch.__version__} has no torch.nn.attention.varlen")
        # causal is False when every request has one query, which sees all its keys anyway:
        # flash then serves the query heads of a KV head from one read of its keys (GQA)
        self._mask = {causal: _mask_kwargs(self.kernel, causal) for causal in (False, True)}

    def step_metadata(self, step: StepLayout) -> VarlenMetadata:
        ordered = [c for group in step.groups for c in group]
        q_lens = [c.num_tokens for c in ordered]
        k_lens = [c.end for c in ordered]
        offsets = torch.tensor([[0] + q_lens, [0] + k_lens], dtype=torch.int32).cumsum(1, dtype=torch.int32)
        offsets = offsets.to(step.device, non_blocking=True)
        seq_used_k = torch.tensor(k_lens, dtype=torch.int32).to(step.device, non_blocking=True)
        key_slots = (
            packed_key_slots(step.tables, seq_used_k, offsets[1], sum(k_lens), step.page_size)
            if self.packs_keys
            else None
        )
        return self.metadata(
            step.slot_mapping, offsets[0], offsets[1], seq_used_k, step.tables, max(q_lens), max(k_lens),
            max(q_lens) > 1, step.page_size, key_slots,
        )

    def metadata(
        self, slot_mapping: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, seq_used_k: torch.Tensor,
        tables: torch.Tensor, max_q: int, max_k: int, causal: bool, page_size: int,
        key_slots: torch.Tensor | None,
    ) -> VarlenMetadata:
        """The metadata around this backend's kernel. ``tables`` [N, pages] long: the block table,
        unless the keys are packed (then ``key_slots``, the slot of every key, is read instead)."""
        return VarlenMetadata(
            slot_mapping, cu_seq_q, cu_seq_k, seq_used_k, None if self.packs_keys else tables.to(torch.int32),
            max_q, max_k, self.kernel, self._mask[causal], page_size, key_slots,
        )

    def decode_metadata(
        self,
        tables: torch.Tensor,
        positions: torch.Tensor,
        page_size: int,
        context: int,
        query_groups: int,
        keys: int = 0,
        scratch_slot: int = 0,
    ) -> VarlenMetadata:
        rows = tables.shape[0]
        return self.static_step_metadata(
            kv_slots(tables, positions, page_size, rows=torch.arange(rows, device=tables.device)),
            tables,
            torch.arange(rows + 1, dtype=torch.int32, device=tables.device),
            (positions + 1).to(torch.int32),
            page_size, 1, context, causal=False, keys=keys, scratch_slot=scratch_slot,
        )

    def static_step_metadata(
        self,
        slot_mapping: torch.Tensor,
        tables: torch.Tensor,
        cu_seq_q: torch.Tensor,
        seq_used_k: torch.Tensor,
        page_size: int,
        max_q: int,
        max_k: int,
        causal: bool = True,
        keys: int = 0,
        scratch_slot: int = 0,
    ) -> VarlenMetadata:
        cu_k = torch.zeros(tables.shape[0] + 1, dtype=torch.int32, device=tables.device)
        cu_k[1:] = seq_used_k.cumsum(0, dtype=torch.int32)
        key_slots = (
            static_packed_key_slots(tables, seq_used_k, cu_k, keys, page_size, scratch_slot)
            if self.packs_keys
            else None
        )
        return self.metadata(
            slot_mapping, cu_seq_q, cu_k, seq_used_k, tables, max_q, max_k, causal, page_size, key_slots,
        )


class VarlenPacked(VarlenPaged):
    """Varlen flash attention over every request's keys gathered back to back."""

    name = PACKED
    packs_keys = True
    gathers_keys = True


def packed_key_slots(
    tables: torch.Tensor, lengths: torch.Tensor, cu_lengths: torch.Tensor, total: int, page_size: int
) -> torch.Tensor:
    """The KV slots of keys ``0..lengths[r]-1`` of every row ``r`` of ``tables``, row after row
    ([total]), computed on the device without a host round trip."""
    row = torch.repeat_interleave(
        torch.arange(tables.shape[0], device=tables.device), lengths.long(), output_size=total
    )
    position = torch.arange(total, device=tables.device) - cu_lengths[:-1].long()[row]
    return kv_slots(tables, position, page_size, rows=row)


def static_packed_key_slots(
    tables: torch.Tensor, lengths: torch.Tensor, cu_lengths: torch.Tensor, keys: int, page_size: int,
    scratch_slot: int,
) -> torch.Tensor:
    """``packed_key_slots`` into a gather of a static length ``keys`` (at least the total): the
    rows' key slots back to back, then ``scratch_slot`` — no output size that depends on the
    lengths, so it can be captured."""
    ends = cu_lengths[1:].long()
    index = torch.arange(keys, device=tables.device)
    row = torch.searchsorted(ends, index, right=True).clamp_(max=tables.shape[0] - 1)
    position = (index - ends[row] + lengths.long()[row]).clamp_(0, tables.shape[1] * page_size - 1)
    slots = kv_slots(tables, position, page_size, rows=row)
    return torch.where(index < ends[-1], slots, scratch_slot)
