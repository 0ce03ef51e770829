"""Rank 0's step, sent once per step to the other ranks of a tensor-parallel group.

Rank 0 owns the scheduler and the page pool; every rank runs the same forward on the same
batch. So rank 0 sends each step's layout (the chunks' groups, starts, lengths and page tables)
and its flat token tensors, and each follower rebuilds the attention metadata from the layout
with its own backend: no per-layer traffic, and nothing backend-specific on the wire.

A message is two broadcasts: a fixed-size header (its kind and sizes) over the control group —
gloo on the host, whose timeout allows an idle server, see ``group.join_group`` — then, for a
step, one int64 payload over the device group. Page copies (forked samples share a prompt's
pages, ``engine.samples``) and the stop go the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from qil_worker.attention.backend import StepLayout
from qil_worker.parallel.state import ParallelState, collective

STOP, STEP, COPY_PAGES = 0, 1, 2
HEADER = 6  # kind, chunks, groups, tokens, logit rows, page-table width (or pages to copy)


@dataclass(frozen=True)
class FollowedChunk:
    """A chunk as a follower knows it: what an attention backend reads (``backend.Chunk``)."""

    start: int
    num_tokens: int
    pages: list[int]

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class FollowedStep:
    """A step received from rank 0: the forward's inputs and the layout of its attention."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logit_indices: torch.Tensor
    layout: StepLayout


class StepSender:
    """Rank 0's end: ``step``, ``copy_pages`` and ``stop`` each reach every follower."""

    def __init__(self, parallel: ParallelState, device: torch.device) -> None:
        self.parallel, self.device = parallel, device

    @classmethod
    def of(cls, parallel: ParallelState, device: torch.device) -> "StepSender | None":
        """The sender of a sharded model's rank 0 (the model's ``parallel`` state and device);
        None on one device. Any other rank follows
        rank 0 (``runner.follower.follow``) and runs no steps of its own."""
        if not parallel.sharded:
            return None
        if parallel.rank != 0:
            raise ValueError(
                f"tensor-parallel rank {parallel.rank} follows rank 0's steps "
                "(qil_worker.engine.runner.follower.follow); only rank 0 runs an engine"
            )
        return cls(parallel, device)

    def _header(self, *values: int) -> None:
        header = torch.zeros(HEADER, dtype=torch.long)
        header[: len(values)] = torch.tensor(values, dtype=torch.long)
        collective(dist.broadcast, header, 0, group=self.parallel.control_group)

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, logit_indices: torch.Tensor,
             layout: StepLayout) -> None:
        """Send a step about to run (its tensors as the forward takes them)."""
        chunks = [c for group in layout.groups for c in group]
        width = layout.tables.shape[1]
        self._header(STEP, len(chunks), len(layout.groups), input_ids.numel(), logit_indices.numel(), width)
        host = torch.tensor(
            [len(g) for g in layout.groups] + [c.start for c in chunks] + [c.num_tokens for c in chunks]
            + [len(c.pages) for c in chunks], dtype=torch.long,
        )
        payload = torch.cat([host.to(self.device), layout.tables.reshape(-1), input_ids, positions,
                             layout.slot_mapping, logit_indices])
        collective(dist.broadcast, payload, 0, group=self.parallel.group)

    def copy_pages(self, sources: list[int], targets: list[int]) -> None:
        """Send a copy of KV pages (each follower copies its own heads' K and V)."""
        self._header(COPY_PAGES, 0, 0, 0, 0, len(sources))
        payload = torch.tensor(sources + targets, dtype=torch.long, device=self.device)
        collective(dist.broadcast, payload, 0, group=self.parallel.group)

    def stop(self) -> None:
        """Tell the followers that no step follows."""
        self._header(STOP)


def receive(parallel: ParallelState, device: torch.device, page_size: int, query_groups: int
            ) -> tuple[int, FollowedStep | tuple[list[int], list[int]] | None]:
    """A follower's next message from rank 0: (``STEP``, the step), (``COPY_PAGES``, (sources,
    targets)) or (``STOP``, None)."""
    header = torch.empty(HEADER, dtype=torch.long)
    collective(dist.broadcast, header, 0, group=parallel.control_group)
    kind, n_chunks, n_groups, tokens, logits, width = header.tolist()
    if kind == STOP:
        return STOP, None
    if kind == COPY_PAGES:
        payload = torch.empty(2 * width, dtype=torch.long, device=device)
        collective(dist.broadcast, payload, 0, group=parallel.group)
        pages = payload.tolist()
        return COPY_PAGES, (pages[:width], pages[width:])
    host = n_groups + 3 * n_chunks
    payload = torch.empty(host + n_chunks * width + 3 * tokens + logits, dtype=torch.long, device=device)
    collective(dist.broadcast, payload, 0, group=parallel.group)
    counts = payload[:host].tolist()
    group_sizes, starts = counts[:n_groups], counts[n_groups : n_groups + n_chunks]
    lengths, num_pages = counts[n_groups + n_chunks : n_groups + 2 * n_chunks], counts[n_groups + 2 * n_chunks :]
    tables, input_ids, positions, slots, logit_indices = payload[host:].split(
        (n_chunks * width, tokens, tokens, tokens, logits))
    tables = tables.view(n_chunks, width)
    rows = tables.cpu().tolist()
    chunks = [FollowedChunk(s, n, row[:p]) for s, n, row, p in zip(starts, lengths, rows, num_pages)]
    groups, first = [], 0
    for size in group_sizes:
        groups.append(chunks[first : first + size])
        first += size
    layout = StepLayout(groups, tables, slots, page_size, query_groups, device)
    return STEP, FollowedStep(input_ids, positions, logit_indices, layout)
