"""Decode attention read in place, page by page, for torch builds whose varlen kernel takes no
block table (torch 2.11 on CUDA).

Without a block table, ``varlen-packed`` gathers every request's keys into one buffer per layer
and step; at a serving batch's contexts that copy moves more bytes than the attention reads.
The flash kernel underneath (``aten::_flash_attention_forward``) already takes ``seqused_k``:
then each sequence's keys start at its ``cu_seq_k`` entry and run ``seqused_k`` keys, with no
order between sequences. A page is such a run. So each decode row is split into one sequence
per page of its table — its query repeated, the page's slot as the start, the keys it uses of
that page as the length — and the per-page results are merged with their log-sum-exps, as
split-KV decoding does. Nothing is gathered; every shape depends only on (rows, pages), so the
decode graphs capture it.

Steps with prefill chunks (several queries per request, causal) run the packed path instead:
a page-split causal mask would not align. ``choice`` offers this backend only where its start-up
probe agrees with SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qil_worker.attention.backend import AttentionBackend, StepAttention, StepLayout
from qil_worker.attention.names import SEGMENTS
from qil_worker.attention.varlen import VarlenPacked
from qil_worker.kv.slots import kv_slots

if TYPE_CHECKING:
    from qil_worker.kv.cache import KVCache

# kernel(q [S, Hq, D], k [slots, Hkv, D], v, cu_seq_q [S+1] int32, starts [S+1] int32, max_q,
# max_k, seqused_k [S] int32) -> (out [S, Hq, D], log-sum-exp [S, Hq] float32)
SegmentKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def torch_segment_attn() -> SegmentKernel | None:
    """This build's flash kernel with ``seqused_k`` in the segment contract, or None."""
    try:
        op = torch.ops.aten._flash_attention_forward
        arguments = {a.name for a in op.default._schema.arguments}
    except (AttributeError, RuntimeError):
        return None
    if "seqused_k" not in arguments:
        return None

    def attn(q, k, v, cu_seq_q, starts, max_q, max_k, seqused_k):
        out, lse, *_ = op(q, k, v, cu_seq_q, starts, max_q, max_k, 0.0, False, False, seqused_k=seqused_k)
        return out, lse_per_query(lse, q.shape[0], q.shape[1])

    return attn


def lse_per_query(lse: torch.Tensor, queries: int, heads: int) -> torch.Tensor:
    """The kernel's log-sum-exp as [queries, heads]: builds store it [heads, total queries]
    (unpadded) or [sequences, heads, max queries] (padded; one query per sequence here)."""
    if lse.dim() == 3:
        return lse[:, :, 0]
    if lse.shape == (heads, queries):
        return lse.t()
    raise ValueError(f"unexpected log-sum-exp shape {tuple(lse.shape)} for {queries} queries of {heads} heads")


@dataclass
class SegmentMetadata(StepAttention):
    """A decode step's attention as one kernel call over (row, page) sequences per layer."""

    slot_mapping: torch.Tensor  # [B]
    pages: int  # P: sequences per row (the table's width)
    page_size: int
    cu_seq_q: torch.Tensor  # [B*P + 1] int32: one query per sequence
    starts: torch.Tensor  # [B*P + 1] int32: each sequence's first slot (the last entry unread)
    used: torch.Tensor  # [B*P] int32: keys each sequence reads (at least 1: see ``valid``)
    valid: torch.Tensor  # [B, P] bool: the page holds keys of its row
    kernel: SegmentKernel

    def attend(self, q: torch.Tensor, kv: KVCache, layer: int) -> torch.Tensor:
        rows, heads, dim = q.shape
        out, lse = self.kernel(
            q.repeat_interleave(self.pages, dim=0), kv.k[layer], kv.v[layer], self.cu_seq_q, self.starts,
            1, self.page_size, self.used,
        )
        return merge_pages(out, lse, self.valid).to(q.dtype).reshape(rows, heads * dim)


def merge_pages(out: torch.Tensor, lse: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each row's attention from its pages' partial results: ``out`` [B*P, H, D] and ``lse``
    [B*P, H] of each (row, page) sequence, ``valid`` [B, P] → [B, H, D] float32. A page that
    holds none of its row's keys weighs nothing (every row has at least one key)."""
    rows, pages = valid.shape
    lse = lse.float().view(rows, pages, -1).masked_fill(~valid[:, :, None], float("-inf"))
    weights = torch.softmax(lse, dim=1)  # [B, P, H]
    partial = out.float().view(rows, pages, *out.shape[1:])
    return (weights.unsqueeze(-1) * partial).sum(dim=1)


def segment_metadata(
    slot_mapping: torch.Tensor, tables: torch.Tensor, keys: torch.Tensor, page_size: int, kernel: SegmentKernel
) -> SegmentMetadata:
    """Metadata for rows of one query each: ``tables`` [B, P] page ids (any valid page past a
    row's keys), ``keys`` [B] keys of each row (at least 1), on the device, no host sync."""
    rows, pages = tables.shape
    first = torch.arange(pages, device=tables.device) * page_size
    used = (keys.long()[:, None] - first[None, :]).clamp_(0, page_size)
    starts = (tables.long() * page_size).to(torch.int32).reshape(-1)
    return SegmentMetadata(
        slot_mapping=slot_mapping,
        pages=pages,
        page_size=page_size,
        cu_seq_q=torch.arange(rows * pages + 1, dtype=torch.int32, device=tables.device),
        starts=torch.cat([starts, starts[-1:]]),
        used=used.clamp(min=1).to(torch.int32).reshape(-1),
        valid=used > 0,
        kernel=kernel,
    )


class VarlenSegments(AttentionBackend):
    """Decode rows attended page by page in place (``SegmentMetadata``); steps with prefill
    chunks through ``VarlenPacked``."""

    name = SEGMENTS
    gathers_keys = False  # decode graphs: nothing gathered, tables as wide as the context bucket

    def __init__(self, kernel: SegmentKernel | None = None, packed: VarlenPacked | None = None) -> None:
        self.kernel = kernel if kernel is not None else torch_segment_attn()
        if self.kernel is None:
            raise ValueError(f"torch {torch.__version__} has no flash kernel taking seqused_k")
        self.packed = packed if packed is not None else VarlenPacked()

    def step_metadata(self, step: StepLayout) -> StepAttention:
        ordered = [c for group in step.groups for c in group]
        if any(c.num_tokens != 1 for c in ordered):
            return self.packed.step_metadata(step)
        keys = torch.tensor([c.end for c in ordered], dtype=torch.int32).to(step.device, non_blocking=True)
        return segment_metadata(step.slot_mapping, step.tables, keys, step.page_size, self.kernel)

    def decode_metadata(
        self,
        tables: torch.Tensor,
        positions: torch.Tensor,
        page_size: int,
        context: int,
        query_groups: int,
        keys: int = 0,
        scratch_slot: int = 0,
    ) -> SegmentMetadata:
        rows = tables.shape[0]
        slots = kv_slots(tables, positions, page_size, rows=torch.arange(rows, device=tables.device))
        return segment_metadata(slots, tables, positions + 1, page_size, self.kernel)
