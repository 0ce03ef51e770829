"""Gather + SDPA: causal attention over the paged KV cache, one call per group of requests.

A step mixes decode tokens (one query per request) and prefill chunks (many). Requests come in
groups of similar shape (decodes apart from prefill chunks; see ``batch.attention_groups``) and
each group runs as one padded batch: queries scattered into ``[B, Qmax]``, keys gathered from
the page pool into ``[B, Lmax]`` through each request's slots, and a boolean mask that lets
query ``i`` see key ``j`` only when ``j <= position(i)``. Because a request's keys are exactly
positions ``0..ctx_len-1``, that one comparison is both the causal mask and the "only what was
written" mask.

GQA without copying keys: the G query heads that share a KV head are folded into the query
length, so K/V stay at ``num_kv_heads`` and SDPA sees ``[B, Hkv, Qmax*G, D]`` queries.

``GatherSdpa`` is the portable backend (what CUDA runs); ``cpu.CpuAttention`` keeps its groups
and replaces how keys are gathered and attended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from qil_worker.attention.backend import AttentionBackend, Chunk, StepAttention, StepLayout
from qil_worker.attention.names import SDPA
from qil_worker.kv.slots import kv_slots, range_slots

if TYPE_CHECKING:
    from qil_worker.kv.cache import KVCache

# one group's attention: (folded queries [B, Hkv, Qmax*G, D], cache, layer, group) → same shape
GroupKernel = Callable[[torch.Tensor, "KVCache", int, "AttentionGroup"], torch.Tensor]


@dataclass
class AttentionGroup:
    """Requests whose queries are attended together in one padded call.

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
    kernel: GroupKernel  # chosen by the backend when the group is made
    bias: torch.Tensor | None = None  # the mask as 0 / -inf in the attention dtype, made on first use
    # CPU decodes sharing leading pages: those keys' slots, attended once for all rows; then
    # key_slots / mask / key_lengths cover only the keys after them
    prefix_slots: torch.Tensor | None = None
    # CPU: the same keys as whole pages [batch, l_max / page_size] (l_max is page-aligned there)
    key_pages: torch.Tensor | None = None
    # CPU decodes attended by matmuls: ``KVCache.head_rows`` of key_slots (each KV head's keys
    # contiguous once gathered), made on first use
    key_rows: torch.Tensor | None = None
    # CPU, one decode row whose pages are consecutive in the pool: the slot its keys start at,
    # so they are attended where they lie (slots key_run..key_run+l_max-1), with no gather
    key_run: int | None = None


@dataclass
class GroupedAttention(StepAttention):
    """A step's attention as padded groups, each attended by its own kernel."""

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup] = field(default_factory=list)

    def attend(self, q: torch.Tensor, kv: KVCache, layer: int) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = kv.k.shape[2]
        groups_per_kv = num_heads // num_kv_heads
        outputs = []
        for g in self.groups:
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
            out = g.kernel(q_pad, kv, layer, g)
            out = (
                out.view(b, num_kv_heads, qm, groups_per_kv, head_dim)
                .permute(0, 2, 1, 3, 4)
                .reshape(b * qm, num_heads * head_dim)
            )
            outputs.append(out if g.pad_index is None else out[g.pad_index])
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def reads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for g in self.groups:
            out.append((g.key_slots, g.key_lengths))
            if g.prefix_slots is not None:
                out.append((g.prefix_slots[None], torch.tensor([g.prefix_slots.numel()])))
        return out


class GatherSdpa(AttentionBackend):
    """Keys gathered by slot per group, padded, attended by SDPA with the step's additive mask."""

    name = SDPA
    whole_pages = False  # gather keys page by page (l_max page-aligned) instead of slot by slot

    def kernel(self, q_max: int) -> GroupKernel:
        """How a group with ``q_max`` queries per request is attended."""
        return sdpa_kernel

    def shared_prefix_pages(self, members: list[Chunk], page_size: int) -> int:
        """Leading pages every decode row of a group shares, attended once for all (0: none)."""
        return 0

    def key_run(self, members: list[Chunk], key_pages: int, page_size: int) -> int | None:
        """For a decode group whose keys (its first ``key_pages`` pages) can be attended in
        place, the slot they start at; None (the default): gather them."""
        return None

    def step_metadata(self, step: StepLayout) -> GroupedAttention:
        groups: list[AttentionGroup] = []
        start = first_row = 0
        for members in step.groups:
            tables = step.tables[first_row : first_row + len(members)]
            groups.append(self._group(members, start, tables, step))
            start += sum(c.num_tokens for c in members)
            first_row += len(members)
        return GroupedAttention(step.slot_mapping, groups)

    def _group(
        self, members: list[Chunk], start: int, tables: torch.Tensor, step: StepLayout
    ) -> AttentionGroup:
        page_size, device = step.page_size, step.device
        batch = len(members)
        q_max = max(c.num_tokens for c in members)
        l_max = max(c.end for c in members)
        if self.whole_pages:  # keys in whole pages, gathered page by page (``KVCache.gather_pages``)
            l_max = -(-l_max // page_size) * page_size
        shared = self.shared_prefix_pages(members, page_size) if q_max == 1 else 0
        prefix_tokens = shared * page_size
        key_positions = torch.arange(prefix_tokens, l_max, device=device)
        # [batch, q_max]: each chunk's positions start.. end-1; padded query rows look at key 0
        # only (always written), so no row is fully masked. Made from two host lists in a few
        # tensor ops: a Python loop over the members costs milliseconds at hundreds of requests.
        starts = torch.tensor([c.start for c in members], dtype=torch.long)[:, None]
        pad_index: list[int] = []
        if q_max == 1:
            query_positions = starts
        else:
            counts = [c.num_tokens for c in members]
            offsets = torch.arange(q_max)
            valid = offsets < torch.tensor(counts, dtype=torch.long)[:, None]
            query_positions = torch.where(valid, starts + offsets, 0)
            for b, n in enumerate(counts):
                pad_index.extend(range(b * q_max, b * q_max + n))
        query_positions = query_positions.to(device, non_blocking=True)
        mask = key_positions[None, None, :] <= query_positions[:, :, None]  # [B, q_max, l_max]
        mask = mask.repeat_interleave(step.query_groups, dim=1).unsqueeze(1)
        return AttentionGroup(
            start=start,
            end=start + sum(c.num_tokens for c in members),
            batch=batch,
            q_max=q_max,
            pad_index=None if q_max == 1 else torch.tensor(pad_index).to(device, non_blocking=True),
            key_slots=range_slots(tables, shared, l_max - prefix_tokens, page_size),
            key_lengths=torch.tensor([c.end - prefix_tokens for c in members], dtype=torch.long),
            mask=mask,
            kernel=self.kernel(q_max),
            prefix_slots=(
                kv_slots(tables[:1], torch.arange(prefix_tokens, device=device), page_size)[0] if shared else None
            ),
            key_pages=tables[:, shared : l_max // page_size] if self.whole_pages else None,
            key_run=self.key_run(members, l_max // page_size, page_size) if q_max == 1 and not shared else None,
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
    ) -> GroupedAttention:
        rows = torch.arange(tables.shape[0], device=tables.device)
        key_positions = torch.arange(context, device=tables.device)
        mask = (key_positions[None, :] <= positions[:, None])[:, None, None, :]
        group = AttentionGroup(
            start=0,
            end=tables.shape[0],
            batch=tables.shape[0],
            q_max=1,
            pad_index=None,
            key_slots=kv_slots(tables, key_positions, page_size),
            key_lengths=positions + 1,
            mask=mask.expand(-1, 1, query_groups, -1),
            kernel=self.kernel(1),
        )
        return GroupedAttention(kv_slots(tables, positions, page_size, rows=rows), [group])


def sdpa_kernel(q: torch.Tensor, kv: KVCache, layer: int, group: AttentionGroup) -> torch.Tensor:
    """SDPA over the group's gathered keys; the mask as an additive bias made once per step
    (SDPA would turn a boolean mask into one itself, in every layer: two more kernels each on
    CUDA)."""
    keys, values = gather_keys(kv, layer, group, 0, group.batch)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias(group, q.dtype))


def gather_keys(kv: KVCache, layer: int, group: AttentionGroup, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the group's rows ``i..j-1``, viewed [rows, Hkv, l_max, D]: by whole pages where
    the group has them (CPU steps), else by slots (and on the padded decode path of the graphs)."""
    if group.key_pages is not None:
        keys, values = kv.gather_pages(layer, group.key_pages[i:j].reshape(-1))
    else:
        keys, values = kv.gather(layer, group.key_slots[i:j].reshape(-1))
    shape = (j - i, group.key_slots.shape[1], *kv.k.shape[2:])
    return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)


def bias(group: AttentionGroup, dtype: torch.dtype) -> torch.Tensor:
    """The group's mask as 0 / -inf in ``dtype``, made once and shared by all layers."""
    if group.bias is None or group.bias.dtype != dtype:
        group.bias = torch.zeros(group.mask.shape, dtype=dtype, device=group.mask.device).masked_fill_(
            ~group.mask, float("-inf")
        )
    return group.bias
