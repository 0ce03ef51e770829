"""Decode steps replayed from CUDA graphs captured per (batch bucket, context or key bucket).

A decode step launches hundreds of small kernels whose Python and launch overhead dominates at
small batch. Here a decode-only step (every chunk is one token that is sampled) is padded to a
batch bucket and a context bucket and replayed from a graph captured for that shape:

- static inputs — token ids, positions and a block table — are the only things copied per step;
  everything attention needs (KV slots, the mask or the varlen offsets) is derived from them
  *inside* the graph by the attention backend (``decode_metadata``), whichever backend it is;
- gathering backends pad every row to the context bucket; a backend that packs keys
  (``packs_keys``) gathers only real keys, so its second bucket is the step's total key count
  (powers of two) instead;
- padded rows read and write only the KV cache's scratch page, never a real request's;
- the graph stops at the decoder stack's hidden states, and the final norm + LM head run eagerly
  on the real rows only, so each graph's output stays small and memory is one shared pool.

Graphs are captured lazily on first use of a shape (logged with the time it took). Shapes
beyond the largest bucket run eagerly. On a non-CUDA device the same padded path runs without
capture — this is how CPU tests check the padding, scratch page and bucket logic.
"""

from __future__ import annotations

import bisect

import torch

from qil_worker.attention.backend import AttentionBackend
from qil_worker.engine.runner.batch import page_tables
from qil_worker.engine.runner.graph_buckets import MAX_GATHER_BYTES, batch_buckets, context_buckets, key_buckets
from qil_worker.engine.runner.graph_capture import GraphCapture
from qil_worker.engine.in_flight import decode_inputs, fill_inputs
from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.engine.transfer import host_tensor
from qil_worker.kv import KVCache
from qil_worker.model import Qwen3

class DecodeGraphs:
    """Runs decode-only steps through padded static buffers, from CUDA graphs where possible."""

    def __init__(
        self,
        model: Qwen3,
        kv: KVCache,
        page_size: int,
        max_batch: int,
        max_context: int,
        attention: AttentionBackend,
        capture: GraphCapture,
    ) -> None:
        """``attention``: the engine's backend, which builds the metadata inside each graph;
        ``capture``: the engine's (its pool is shared with the mixed-step graphs)."""
        if kv.scratch_page is None:
            raise ValueError("the KV cache needs a scratch page for padded decode rows")
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.attention = attention
        self.capture = capture
        self._pin = model.device.type == "cuda"  # staging buffers in pinned memory
        self._bytes_per_key = kv.k.shape[2] * kv.k.shape[3] * kv.k.element_size()
        self.batches = batch_buckets(max_batch)
        self.contexts = context_buckets(max_context, page_size)
        self.keys = key_buckets(self.batches[-1] * self.contexts[-1])
        device = model.device
        max_pages = self.contexts[-1] // page_size
        self._ids = torch.zeros(self.batches[-1], dtype=torch.long, device=device)
        self._positions = torch.zeros(self.batches[-1], dtype=torch.long, device=device)
        self._tables = torch.full(
            (self.batches[-1], max_pages), kv.scratch_page, dtype=torch.long, device=device
        )
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = 0  # decode steps run through this path

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def handles(self, chunks: list[ScheduledChunk]) -> bool:
        """A decode-only step that fits the buckets (and, for a gathering backend, the gather cap)."""
        if len(chunks) > self.batches[-1] or not all(c.num_tokens == 1 and c.samples for c in chunks):
            return False
        if max(c.end for c in chunks) > self.contexts[-1]:
            return False
        if not self.attention.gathers_keys:
            return True
        batch, context, keys = self._shape(chunks)
        gathered = keys if self.attention.packs_keys else batch * context
        return 2 * gathered * self._bytes_per_key <= MAX_GATHER_BYTES

    def _shape(self, chunks: list[ScheduledChunk]) -> tuple[int, int, int]:
        """The (batch, context, keys) buckets a step is padded to; keys only for a backend that
        packs keys (each padded row has one key, on the scratch page)."""
        batch = self.batches[bisect.bisect_left(self.batches, len(chunks))]
        context = self.contexts[bisect.bisect_left(self.contexts, max(c.end for c in chunks))]
        if not self.attention.packs_keys:
            return batch, context, 0
        total = sum(c.end for c in chunks) + batch - len(chunks)
        return batch, context, self.keys[bisect.bisect_left(self.keys, total)]

    def run(self, chunks: list[ScheduledChunk], in_flight_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [len(chunks), vocab] for a step that ``handles`` accepted, rows in chunk order;
        ``in_flight_tokens``: as ``build_step_inputs``'s (``engine.in_flight``)."""
        rows = len(chunks)
        self.steps += 1
        batch, context, keys = self._shape(chunks)
        self._stage(chunks, batch, context // self.page_size, in_flight_tokens)
        # packed graphs read the whole table width, so one graph serves every context
        shape = (batch, keys) if self.attention.packs_keys else (batch, context)
        captured = self._graphs.get(shape)
        if captured is None and self.capture.enabled:
            what = f"decode, batch {shape[0]}, {'keys' if self.attention.packs_keys else 'context'} {shape[1]}"
            captured = self.capture.capture(lambda: self._body(shape), what)
            if captured is not None:
                self._graphs[shape] = captured
        if captured is None:
            hidden = self._body(shape)
        else:
            graph, hidden = captured
            graph.replay()
        return self.model.logits(hidden[:rows])

    def _stage(
        self, chunks: list[ScheduledChunk], batch: int, pages: int, in_flight_tokens: torch.Tensor | None = None
    ) -> None:
        """Copy this step's ids, positions and page tables into the static buffers (padded);
        ids of tokens still in flight are taken from ``in_flight_tokens`` on the device."""
        rows = len(chunks)
        pin = self._pin
        ids = torch.zeros(batch, dtype=torch.long, pin_memory=pin)
        positions = torch.zeros(batch, dtype=torch.long, pin_memory=pin)
        known, in_flight_rows, sources = decode_inputs(chunks)
        ids[:rows] = host_tensor(known, torch.long)
        positions[:rows] = host_tensor([c.start for c in chunks], torch.long)
        table = torch.full((batch, pages), self.kv.scratch_page, dtype=torch.long, pin_memory=pin)
        table[:rows] = page_tables(chunks, pages, pad=self.kv.scratch_page)
        self._ids[:batch].copy_(ids, non_blocking=True)
        fill_inputs(self._ids, in_flight_rows, sources, in_flight_tokens)
        self._positions[:batch].copy_(positions, non_blocking=True)
        self._tables[:batch, :pages].copy_(table, non_blocking=True)

    def _body(self, shape: tuple[int, int]) -> torch.Tensor:
        """The graph's contents: metadata from the static buffers, then the decoder stack."""
        batch, second = shape
        positions = self._positions[:batch]
        query_groups = self.model.heads.query_groups
        if self.attention.packs_keys:
            # no row has more keys than all rows together: a bound on the longest that is tighter
            # than the largest context for small batches
            meta = self.attention.decode_metadata(
                self._tables[:batch], positions, self.page_size, min(second, self.contexts[-1]), query_groups,
                keys=second, scratch_slot=self.kv.scratch_page * self.page_size,
            )
        else:
            meta = self.attention.decode_metadata(
                self._tables[:batch, : second // self.page_size], positions, self.page_size, second, query_groups,
            )
        return self.model.hidden_states(self._ids[:batch], positions, meta, self.kv)
