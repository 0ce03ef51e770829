"""The one interface every attention backend implements.

A backend turns a step's scheduled chunks (``StepLayout``, made by ``engine.runner.batch``) — or, for a
captured decode graph, its static buffers — into ``StepAttention``: the step's metadata, shared
by all layers, which attends one layer's queries. The model only writes its keys at
``slot_mapping`` and calls ``attend``; the batch builder and the decode graphs only call the two
builders and read the capability flags. A new backend is a new subclass; ``choice`` names it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from qil_worker.kv.cache import KVCache


class Chunk(Protocol):
    """What a backend reads of one scheduled chunk (the engine's ``ScheduledChunk``): its
    tokens ``[start, end)`` of a request whose KV lies on ``pages``."""

    start: int
    num_tokens: int

    @property
    def end(self) -> int: ...

    @property
    def pages(self) -> list[int]: ...


@dataclass
class StepLayout:
    """A step's chunks as the batch builder laid them out, for a backend's metadata."""

    groups: list[list[Chunk]]  # every chunk in flat token order, in groups of similar shape
    tables: torch.Tensor  # [chunks, max pages] long, each chunk's page table (zero-padded), flat order
    slot_mapping: torch.Tensor  # [T] where each token's K/V are written
    page_size: int
    query_groups: int  # query heads per KV head
    device: torch.device


class StepAttention(ABC):
    """One step's attention metadata; ``attend`` runs it for one layer."""

    slot_mapping: torch.Tensor  # [T] where each token's K/V are written (before ``attend``)

    @abstractmethod
    def attend(self, q: torch.Tensor, kv: KVCache, layer: int) -> torch.Tensor:
        """``q`` [T, Hq, D]; ``kv`` already holds this step's keys of ``layer`` → [T, Hq*D]."""

    def reads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(key slots [B, L], key counts [B]) that ``attend`` reads, for ``KVCache.check_reads``
        (debug); empty when the backend does not list them."""
        return []


class AttentionBackend(ABC):
    """Builds each step's ``StepAttention``; chosen once per engine (``choice.choose_backend``)."""

    name: str  # as GetInfo and the CLI spell it (``names``)
    # decode graphs: the packed key gather's length is the graph's second bucket (instead of the
    # context), since one graph then serves every context
    packs_keys: bool = False
    # decode graphs: keys are gathered into a workspace that a captured graph keeps reserved
    gathers_keys: bool = True
    # mixed-step graphs: ``static_step_metadata`` builds any step's metadata from fixed-size
    # buffers (backends whose metadata are offsets and tables, not per-group padded shapes)
    static_steps: bool = False

    @abstractmethod
    def step_metadata(self, step: StepLayout) -> StepAttention:
        """Metadata for an eager step."""

    @abstractmethod
    def decode_metadata(
        self,
        tables: torch.Tensor,
        positions: torch.Tensor,
        page_size: int,
        context: int,
        query_groups: int,
        keys: int = 0,
        scratch_slot: int = 0,
    ) -> StepAttention:
        """Metadata for one decode token per row, derived on the device (graph-safe).

        ``tables`` [B, pages] page ids (padding = scratch page), ``positions`` [B]: each row's
        token position, which is also how many keys it has before this token. ``context``: the
        keys a row may have at most (gathering backends: the padded width, ``tables``
        [B, context/page_size]). ``packs_keys`` backends: ``keys``, the static length of the
        packed key gather (at least the rows' total); slots after the last row's keys read
        ``scratch_slot``.
        """

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
    ) -> StepAttention:
        """Metadata for any step from fixed-size tensors, derived on the device (graph-safe);
        only where ``static_steps``.

        ``tables`` [R, pages] page ids, ``cu_seq_q`` [R+1] int32 query offsets in the flat
        tokens, ``seq_used_k`` [R] int32 keys of each request (its queries are its last ones);
        ``max_q`` / ``max_k`` bound every request's. ``causal`` False: every request has one
        query. ``packs_keys`` backends: ``keys``, the static length of the packed key gather (at
        least the total); slots after the last request's keys read ``scratch_slot``.
        """
        raise NotImplementedError(f"attention backend {self.name!r} has no static step metadata")
