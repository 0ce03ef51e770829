"""Flatten one step's scheduled chunks into the tensors of a single model forward.

Chunks of one token (decodes, and the last token of a recompute) come first, longer chunks
after. Each kind is split into groups of similar shape — for the gather + SDPA backends a group
is one padded attention call, so a 60-token chunk never pads to a 250-token neighbour's length
(see ``attention_groups``). Within the step's flat token order every group is contiguous, so
attention slices instead of gathering. The attention backend turns the layout into its own
metadata. Small index tensors are built on the host and moved once; the larger ones (key slots,
masks) are derived on the device from them.

Logits are computed at ``logit_indices`` only: the sampled rows first (one per sampled chunk),
then the prompt positions of requests that asked for prompt logprobs (``prompt_logprobs``),
then the last tokens of pooled scores, so one LM-head call covers them all and a step without
the latter two computes exactly the sampled rows.
A pooled request's last prompt token (an embedding, a score) is no logit row: its flat index
is in ``pool_indices``, and the runner reads its answer off the hidden state there.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from qil_worker.attention.backend import AttentionBackend, StepAttention, StepLayout
from qil_worker.engine.in_flight import decode_inputs, fill_inputs
from qil_worker.engine.prompt_logprobs import PromptRows
from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.engine.transfer import host_tensor, to_device
from qil_worker.kv.slots import kv_slots


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attention: StepAttention
    # [S + P] flat indices of the logit rows: each sampled request's last token (S), then the
    # prompt positions of ``prompt_rows`` (P, often none)
    logit_indices: torch.Tensor
    sampled: list[ScheduledChunk]  # chunks whose request gets a new token, in row order
    chunks: list[ScheduledChunk]  # every chunk, in flat token order
    prompt_rows: list[PromptRows]  # the P rows after the sampled ones, in order
    pooled: list[ScheduledChunk]  # chunks that end a pooled request's prompt, in row order
    pool_indices: torch.Tensor | None  # [len(pooled)] their last tokens' flat indices (None: no such chunk)
    num_score_rows: int  # logit rows after the prompt rows: the pooled scores' last tokens, in order
    layout: StepLayout  # what ``attention`` was built from (sent to tensor-parallel followers)


def build_step_inputs(
    chunks: list[ScheduledChunk],
    attention: AttentionBackend,
    page_size: int,
    query_groups: int,
    device: torch.device,
    in_flight_tokens: torch.Tensor | None = None,
) -> StepInputs:
    """``query_groups``: query heads per KV head (the GQA fold of the attention mask).
    ``in_flight_tokens``: the sampled tokens [S] of the step still on the device, where the
    input of a request whose token is in flight is taken from (``engine.in_flight``)."""
    decodes = [c for c in chunks if c.num_tokens == 1]
    groups_of_chunks = attention_groups(decodes) + attention_groups([c for c in chunks if c.num_tokens > 1])
    ordered = [c for group in groups_of_chunks for c in group]
    if len(decodes) == len(ordered) and all(c.request.prompt_logprobs is None and c.request.pooling is None for c in ordered):
        tokens = _one_token_each(ordered)
    else:
        tokens = flat_tokens(ordered)

    tables = page_tables(ordered).to(device, non_blocking=True)
    positions_t = to_device(tokens.positions, device, torch.long)
    rows_t = tokens.rows.to(device, non_blocking=True)
    slot_mapping = kv_slots(tables, positions_t, page_size, rows=rows_t)
    layout = StepLayout(groups_of_chunks, tables, slot_mapping, page_size, query_groups, device)
    input_ids = to_device(tokens.input_ids, device, torch.long)
    fill_inputs(input_ids, tokens.in_flight_indices, tokens.in_flight_sources, in_flight_tokens)
    return StepInputs(
        input_ids=input_ids,
        positions=positions_t,
        attention=attention.step_metadata(layout),
        logit_indices=to_device(tokens.logit_indices, device, torch.long),
        sampled=tokens.sampled,
        chunks=ordered,
        prompt_rows=tokens.prompt_rows,
        pooled=tokens.pooled,
        pool_indices=to_device(tokens.pool_indices, device, torch.long) if tokens.pooled else None,
        num_score_rows=tokens.num_score_rows,
        layout=layout,
    )


@dataclass
class StepTokens:
    """The step's flat tokens on the host, before they become tensors."""

    input_ids: list[int]
    positions: list[int]
    rows: torch.Tensor  # [T] the chunk (row of ``ordered``) of each token
    logit_indices: list[int]  # the sampled tokens, then the scored prompt positions
    sampled: list[ScheduledChunk]
    prompt_rows: list[PromptRows]
    pooled: list[ScheduledChunk]
    pool_indices: list[int]
    num_score_rows: int
    # flat indices whose input is a token still in flight, and that token's row in its step
    in_flight_indices: list[int]
    in_flight_sources: list[int]


def _one_token_each(ordered: list[ScheduledChunk]) -> StepTokens:
    """A step of one-token chunks (decodes), none scoring its prompt: token i is chunk i's."""
    sampled_rows = [row for row, c in enumerate(ordered) if c.samples]
    input_ids, in_flight_indices, in_flight_sources = decode_inputs(ordered)
    return StepTokens(
        input_ids=input_ids,
        positions=[c.start for c in ordered],
        rows=torch.arange(len(ordered)),
        logit_indices=sampled_rows,
        sampled=[ordered[row] for row in sampled_rows],
        prompt_rows=[],
        pooled=[],
        pool_indices=[],
        num_score_rows=0,
        in_flight_indices=in_flight_indices,
        in_flight_sources=in_flight_sources,
    )


def flat_tokens(ordered: list[ScheduledChunk]) -> StepTokens:
    """Any step: every chunk's tokens in order, and the prompt positions scored on the way."""
    input_ids: list[int] = []
    positions: list[int] = []
    sample_indices: list[int] = []
    sampled: list[ScheduledChunk] = []
    prompt_indices: list[int] = []
    prompt_rows: list[PromptRows] = []
    pooled: list[ScheduledChunk] = []
    pool_indices: list[int] = []
    score_indices: list[int] = []
    in_flight_indices: list[int] = []
    in_flight_sources: list[int] = []
    for chunk in ordered:
        if chunk.request.prompt_logprobs is not None:
            scored = chunk.request.prompt_logprobs.positions(chunk.start, chunk.end)
            if scored:
                offset = len(input_ids) - chunk.start
                prompt_indices.extend(range(scored.start + offset, scored.stop + offset))
                prompt_rows.append(PromptRows(chunk.request.prompt_token_ids, chunk.request.prompt_logprobs, scored.start, len(scored)))
        if chunk.request.in_flight_row >= 0:  # a decode of the token in flight: its one input
            in_flight_indices.append(len(input_ids))
            in_flight_sources.append(chunk.request.in_flight_row)
            input_ids.append(0)
        else:
            input_ids.extend(chunk.request.token_ids(chunk.start, chunk.end))
        positions.extend(range(chunk.start, chunk.end))
        if chunk.samples:
            sample_indices.append(len(input_ids) - 1)
            sampled.append(chunk)
        elif chunk.pools:
            pool_indices.append(len(input_ids) - 1)
            pooled.append(chunk)
            if chunk.request.pooling.kind == "score":  # its answer reads two of its logits
                score_indices.append(len(input_ids) - 1)
    lengths = host_tensor([c.num_tokens for c in ordered], torch.long)
    return StepTokens(
        input_ids=input_ids,
        positions=positions,
        rows=torch.repeat_interleave(torch.arange(len(ordered)), lengths),
        logit_indices=sample_indices + prompt_indices + score_indices,
        sampled=sampled,
        prompt_rows=prompt_rows,
        pooled=pooled,
        pool_indices=pool_indices,
        num_score_rows=len(score_indices),
        in_flight_indices=in_flight_indices,
        in_flight_sources=in_flight_sources,
    )


def page_tables(chunks: list[ScheduledChunk], width: int | None = None, pad: int = 0) -> torch.Tensor:
    """[chunks, width] long on the host: each chunk's page table padded with ``pad`` to
    ``width`` (None: the longest table's), copied from the requests' ``page_ids`` arrays (no
    Python int per page)."""
    tables = [c.request.page_ids() for c in chunks]
    if width is None:
        width = max(len(t) for t in tables)
    padding = array("q", [pad]) * width
    flat = array("q")
    for t in tables:
        flat += t
        if len(t) < width:
            flat += padding[len(t) :]
    return host_tensor(flat, torch.long).view(len(tables), width)


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
