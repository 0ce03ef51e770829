"""Logits of every computed position through the real paged path — for validation and tests.

The engine only ever computes logits for sampled positions. Checking the forward against a
reference needs all of them, for chunks chosen by hand (token by token, irregular chunks,
several sequences in one batch); this runs exactly the engine's batch building, KV writes and
model forward, with every position marked for logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qil_worker.attention.backend import AttentionBackend
from qil_worker.attention.choice import choose_backend
from qil_worker.engine.runner.batch import build_step_inputs
from qil_worker.engine.outputs import RequestMetrics
from qil_worker.engine.request import Request
from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.kv import KVCache, PagePool, PageTable
from qil_worker.model import Qwen3
from qil_worker.parallel.step_broadcast import StepSender


class ForwardProbe:
    def __init__(
        self, model: Qwen3, num_pages: int = 256, page_size: int = 16, attention: str | AttentionBackend = "sdpa"
    ) -> None:
        """``attention``: a backend's name (as ``Engine`` takes it) or the backend itself."""
        c = model.config
        self.model = model
        self.page_size = page_size
        if not isinstance(attention, AttentionBackend):
            attention, _ = choose_backend(
                attention, model.device, model.dtype, page_size, model.heads.q_heads, model.heads.kv_heads,
                c.head_dim,
            )
        self.attention = attention
        self.kv = KVCache(
            c.num_hidden_layers, num_pages, page_size, model.heads.kv_heads, c.head_dim,
            model.dtype, model.device, debug=True,
        )
        self.pool = PagePool(num_pages, on_reuse=self.kv.forget_pages)
        # rank 0 of a tensor-parallel group: its forwards are the followers' too (its engine's
        # ``close`` releases them)
        self.sender = StepSender.of(model.parallel, model.device)

    def sequence(self, token_ids: Sequence[int]) -> Request:
        """A sequence whose tokens are all known up front; compute it with ``forward``."""
        return Request(
            request_id=f"probe-{id(token_ids)}",
            prompt_token_ids=list(token_ids),
            max_new_tokens=1,
            stop_token_ids=frozenset(),
            page_table=PageTable(self.page_size),
            metrics=RequestMetrics(arrival_time=0.0),
        )

    def forward(self, pieces: Sequence[tuple[Request, int]]) -> list[torch.Tensor]:
        """Compute the next ``n`` tokens of each ``(sequence, n)`` in ONE forward.

        Returns float32 logits ``[n, vocab]`` per piece, in the order given.
        """
        chunks = []
        for seq, n in pieces:
            if not seq.page_table.grow(seq.num_computed_tokens + n, self.pool):
                raise RuntimeError("probe page pool exhausted")
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
        batch = build_step_inputs(
            chunks, self.attention, self.page_size, self.model.heads.query_groups, self.model.device,
        )
        self.kv.check_reads(batch.attention.slot_mapping, batch.attention.reads())
        total = sum(c.num_tokens for c in batch.chunks)
        every = torch.arange(total, device=self.model.device)
        if self.sender is not None:
            self.sender.step(batch.input_ids, batch.positions, every, batch.layout)
        logits = self.model(batch.input_ids, batch.positions, batch.attention, self.kv, every).float()
        by_chunk = dict(zip(map(id, batch.chunks), logits.split([c.num_tokens for c in batch.chunks])))
        for c in chunks:
            c.request.num_computed_tokens = c.end
        return [by_chunk[id(c)] for c in chunks]

    def release(self, seq: Request) -> None:
        seq.page_table.release(self.pool)
