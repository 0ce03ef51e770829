"""Flatten one step's scheduled chunks into the tensors of a single model forward.

Chunks of one token (decodes, and the last token of a recompute) come first, longer chunks
after. Each kind is split into attention groups of similar shape — a group is one padded SDPA
call, so a 60-token chunk never pads to a 250-token neighbour's length (see ``attention_groups``).
Within the step's flat token order every group is contiguous, so the model slices instead of
gathering. Small index tensors are built on the host and moved once; the larger ones (key
slots, masks) are derived on the device from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.engine.transfer import to_device
from qil_worker.model import attention as attention_paths
from qil_worker.model.attention import AttentionGroup, AttentionMetadata
from qil_worker.model.varlen import PACKED, VarlenMetadata


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: AttentionMetadata
    sample_indices: torch.Tensor  # [S] flat index of each sampled request's last token
    sampled: list[ScheduledChunk]  # chunks whose request gets a new token, in row order
    chunks: list[ScheduledChunk]  # every chunk, in flat token order


def build_step_batch(
    chunks: list[ScheduledChunk],
    page_size: int,
    query_groups: int,
    device: torch.device,
    varlen: str | None = None,
) -> StepBatch:
    """``query_groups``: query heads per KV head (the GQA fold of the attention mask).

    ``varlen`` (``varlen.PAGED`` or ``varlen.PACKED``): describe attention for that CUDA kernel
    instead of padded SDPA groups.
    """
    groups_of_chunks = attention_groups([c for c in chunks if c.num_tokens == 1]) + attention_groups(
        [c for c in chunks if c.num_tokens > 1]
    )
    ordered = [c for group in groups_of_chunks for c in group]

    input_ids: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    sample_indices: list[int] = []
    sampled: list[ScheduledChunk] = []
    for row, chunk in enumerate(ordered):
        input_ids.extend(chunk.request.token_ids(chunk.start, chunk.end))
        positions.extend(range(chunk.start, chunk.end))
        rows.extend([row] * chunk.num_tokens)
        if chunk.samples:
            sample_indices.append(len(input_ids) - 1)
            sampled.append(chunk)

    max_pages = max(len(c.request.page_table.pages) for c in ordered)
    tables = torch.tensor(
        [c.request.page_table.pages + [0] * (max_pages - len(c.request.page_table.pages)) for c in ordered],
        dtype=torch.long,
    ).to(device, non_blocking=True)
    positions_t = to_device(positions, device, torch.long)
    rows_t = to_device(rows, device, torch.long)
    slot_mapping = tables[rows_t, positions_t // page_size] * page_size + positions_t % page_size

    groups: list[AttentionGroup] = []
    start = first_row = 0
    for members in () if varlen else groups_of_chunks:
        groups.append(
            _group(members, start, first_row, tables[first_row : first_row + len(members)], page_size, query_groups, device)
        )
        start += sum(c.num_tokens for c in members)
        first_row += len(members)

    return StepBatch(
        input_ids=to_device(input_ids, device, torch.long),
        positions=positions_t,
        attention=AttentionMetadata(
            slot_mapping=slot_mapping,
            groups=groups,
            varlen=_varlen_metadata(ordered, tables, page_size, device, packed=varlen == PACKED) if varlen else None,
            page_size=page_size,
        ),
        sample_indices=to_device(sample_indices, device, torch.long),
        sampled=sampled,
        chunks=ordered,
    )


MAX_PADDING = 1.3  # a group's padded attention work may be at most this times its real work


def attention_groups(chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
    """Split chunks into groups whose padded shape wastes little attention work.

    A group computes ``batch x max(queries) x max(keys)`` scores; the real work is the sum of
    ``queries x keys`` of its members. Largest first, a chunk joins the current group while the
    padded work stays within ``MAX_PADDING`` of the real work, else it starts the next group.
    """
    groups: list[list[ScheduledChunk]] = []
    real = keys = 0  # the current group's real work and most keys
    for chunk in sorted(chunks, key=lambda c: (c.num_tokens, c.end), reverse=True):
        work = chunk.num_tokens * chunk.end
        if groups:
            group = groups[-1]
            # the group's first member has the most queries; keys may still grow
            if (len(group) + 1) * group[0].num_tokens * max(keys, chunk.end) <= MAX_PADDING * (real + work):
                group.append(chunk)
                real, keys = real + work, max(keys, chunk.end)
                continue
        groups.append([chunk])
        real, keys = work, chunk.end
    return groups


def _varlen_metadata(
    ordered: list[ScheduledChunk], tables: torch.Tensor, page_size: int, device: torch.device, packed: bool
) -> VarlenMetadata:
    q_lens = [c.num_tokens for c in ordered]
    k_lens = [c.end for c in ordered]
    offsets = torch.tensor([[0] + q_lens, [0] + k_lens], dtype=torch.int32).cumsum(1, dtype=torch.int32)
    offsets = offsets.to(device, non_blocking=True)
    seq_used_k = to_device(k_lens, device, torch.int32)
    return VarlenMetadata(
        cu_seq_q=offsets[0],
        cu_seq_k=offsets[1],
        seq_used_k=seq_used_k,
        block_table=None if packed else tables.to(torch.int32),
        max_q=max(q_lens),
        max_k=max(k_lens),
        key_slots=packed_key_slots(tables, seq_used_k, offsets[1], sum(k_lens), page_size) if packed else None,
        causal=max(q_lens) > 1,  # decode rows alone see all their keys (see VarlenMetadata.causal)
    )


def packed_key_slots(
    tables: torch.Tensor, lengths: torch.Tensor, cu_lengths: torch.Tensor, total: int, page_size: int
) -> torch.Tensor:
    """The KV slots of keys ``0..lengths[r]-1`` of every row ``r`` of ``tables``, row after row
    ([total]), computed on the device without a host round trip."""
    row = torch.repeat_interleave(
        torch.arange(tables.shape[0], device=tables.device), lengths.long(), output_size=total
    )
    position = torch.arange(total, device=tables.device) - cu_lengths[:-1].long()[row]
    return tables[row, position // page_size] * page_size + position % page_size


def _group(
    members: list[ScheduledChunk],
    start: int,
    first_row: int,
    tables: torch.Tensor,
    page_size: int,
    query_groups: int,
    device: torch.device,
) -> AttentionGroup:
    batch = len(members)
    q_max = max(c.num_tokens for c in members)
    l_max = max(c.end for c in members)
    on_cpu = attention_paths.cpu_kernels(device)
    if on_cpu:  # keys in whole pages, gathered page by page (``KVCache.gather_pages``)
        l_max = -(-l_max // page_size) * page_size
    shared = _shared_prefix_pages(members, page_size) if on_cpu and q_max == 1 else 0
    prefix_tokens = shared * page_size
    key_positions = torch.arange(prefix_tokens, l_max, device=device)
    key_slots = tables[:, key_positions // page_size] * page_size + key_positions % page_size
    # Padded query rows look at key 0 only (always written), so no row is fully masked.
    query_positions = torch.zeros(batch, q_max, dtype=torch.long)
    pad_index: list[int] = []
    for b, c in enumerate(members):
        query_positions[b, : c.num_tokens] = torch.arange(c.start, c.end)
        pad_index.extend(range(b * q_max, b * q_max + c.num_tokens))
    query_positions = query_positions.to(device, non_blocking=True)
    mask = key_positions[None, None, :] <= query_positions[:, :, None]  # [B, q_max, l_max]
    mask = mask.repeat_interleave(query_groups, dim=1).unsqueeze(1)
    return AttentionGroup(
        start=start,
        end=start + sum(c.num_tokens for c in members),
        batch=batch,
        q_max=q_max,
        pad_index=None if q_max == 1 else to_device(pad_index, device, torch.long),
        key_slots=key_slots,
        key_lengths=torch.tensor([c.end - prefix_tokens for c in members], dtype=torch.long),
        mask=mask,
        prefix_slots=(
            (tables[0, :shared, None] * page_size + torch.arange(page_size, device=device)).view(-1)
            if shared
            else None
        ),
        key_pages=tables[:, shared : l_max // page_size] if on_cpu else None,
    )


MIN_SHARED_PREFIX_TOKENS = 64


def _shared_prefix_pages(members: list[ScheduledChunk], page_size: int) -> int:
    """Leading pages that every decode row of the group holds (the same physical pages, shared
    through the prefix cache), all before every row's current token; 0 when too few to pay."""
    if len(members) < 2:
        return 0
    limit = min(c.start for c in members) // page_size
    shared = 0
    for column in zip(*(c.request.page_table.pages[:limit] for c in members)):
        if any(page != column[0] for page in column):
            break
        shared += 1
    return shared if shared * page_size >= MIN_SHARED_PREFIX_TOKENS else 0
