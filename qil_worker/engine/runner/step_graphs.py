"""Any step — prefill chunks beside decodes — replayed from CUDA graphs bucketed by (tokens, requests).

The decode graphs (``decode_graphs``) cover steps of one token per request. A step that carries
a prefill chunk has a shape of its own every time (how many tokens each request computes), so
it is padded to a bucket of (total tokens T, requests R) instead, and its attention metadata are
derived inside the graph from fixed-size buffers — which only backends whose metadata are
offsets and block tables can do (``AttentionBackend.static_steps``: the varlen kernels; gather +
SDPA pads per group of requests, a shape per step):

- static inputs, copied per step: token ids, positions and each token's request row [T], the
  requests' page tables [R, pages], query offsets [R+1] and key counts [R]; the KV slots, key
  offsets and (packed kernel) the key gather are derived from them in the graph;
- padding adds pad requests, each with at least one pad token: a pad request attends only its
  own tokens, causally, and its page table is the KV cache's scratch page only, so pad tokens
  read and write nothing any request owns — and no request has zero queries or keys, a case
  the kernels need not handle;
- the kernels' ``max_q`` / ``max_k`` are fixed per bucket: the longest chunk the scheduler can
  give or a pad request's most tokens (``bucket_max_q``), and the longest context;
- token buckets are powers of two up to the budget, the budget, and the budget plus room for a
  pad request per request; request buckets powers of two and one more than the most requests.
  Every step the scheduler can make under those limits fits one (the tests check many limits);
- the graph stops at the hidden states; the final norm and LM head run eagerly on the sampled
  rows only.

Shapes are captured lazily on first use (``graph_capture``, logged); a step that fits no bucket,
or scores prompt log-probabilities, runs eagerly. On a non-CUDA device the same padded path runs
without capture, which is how the CPU tests check buckets, padding and the scratch page.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from qil_worker.attention.backend import AttentionBackend
from qil_worker.engine.runner.batch import StepTokens, flat_tokens, page_tables
from qil_worker.engine.runner.graph_buckets import (
    MAX_GATHER_BYTES, bucket_max_q, key_buckets, pad_requests, request_buckets, token_buckets,
)
from qil_worker.engine.runner.graph_capture import GraphCapture
from qil_worker.engine.in_flight import fill_inputs
from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.engine.transfer import host_tensor
from qil_worker.kv import KVCache
from qil_worker.kv.slots import kv_slots
from qil_worker.model import Qwen3

@dataclass(frozen=True)
class Bucket:
    tokens: int
    requests: int
    keys: int  # the packed key gather's length (0 unless the backend packs keys)
    pads: tuple[int, ...]  # tokens of each pad request


class StepGraphs:
    """Runs steps through padded static buffers, from CUDA graphs where possible."""

    def __init__(
        self,
        model: Qwen3,
        kv: KVCache,
        page_size: int,
        max_tokens: int,
        max_chunk: int,
        max_requests: int,
        max_context: int,
        attention: AttentionBackend,
        capture: GraphCapture,
    ) -> None:
        """``max_tokens``: the token budget; ``max_chunk``: the most tokens one request computes
        in a step; ``max_requests``: the most requests in a step; ``max_context``: the most keys
        one request has; ``attention``: a ``static_steps`` backend."""
        if kv.scratch_page is None:
            raise ValueError("the KV cache needs a scratch page for padded tokens")
        if not attention.static_steps:
            raise ValueError(f"attention backend {attention.name!r} cannot build a step's metadata in a graph")
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.attention = attention
        self.capture = capture
        self.max_chunk = max_chunk
        self.requests = request_buckets(max_requests)
        self.tokens = token_buckets(max_tokens, self.requests[-1])
        # a pad request's keys are its tokens
        self.max_k = max(max_context, max(bucket_max_q(t, max_chunk) for t in self.tokens))
        self.max_context = max_context
        self.pages = -(-self.max_k // page_size)  # the page tables' width
        bytes_per_key = kv.k.shape[2] * kv.k.shape[3] * kv.k.element_size()
        max_keys = min(self.requests[-1] * self.max_k, MAX_GATHER_BYTES // (2 * bytes_per_key))
        self.keys = key_buckets(max_keys) if attention.packs_keys else []
        self._pin = model.device.type == "cuda"
        device = model.device
        t, r = self.tokens[-1], self.requests[-1]
        self._ids = torch.zeros(t, dtype=torch.long, device=device)
        self._positions = torch.zeros(t, dtype=torch.long, device=device)
        self._rows = torch.zeros(t, dtype=torch.long, device=device)
        self._tables = torch.full((r, self.pages), kv.scratch_page, dtype=torch.long, device=device)
        self._cu_q = torch.zeros(r + 1, dtype=torch.int32, device=device)
        self._used_k = torch.zeros(r, dtype=torch.int32, device=device)
        self._graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = 0  # steps run through this path
        self.misses = 0  # steps offered to ``bucket`` that run eagerly

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def bucket(self, chunks: list[ScheduledChunk]) -> Bucket | None:
        """The bucket a step is padded to, or None if it runs eagerly (counted in ``misses``):
        it scores prompt log-probabilities, or fits no bucket (or, packed, the gather cap)."""
        bucket = self._bucket(chunks)
        self.misses += bucket is None
        return bucket

    def _bucket(self, chunks: list[ScheduledChunk]) -> Bucket | None:
        if any(c.request.prompt_logprobs is not None or c.request.pooling is not None for c in chunks):
            return None
        if any(c.end > self.max_context or len(c.request.page_table.pages) > self.pages for c in chunks):
            return None
        tokens = sum(c.num_tokens for c in chunks)
        start = bisect.bisect_left(self.tokens, tokens)
        for token_bucket in self.tokens[start:]:
            max_q = bucket_max_q(token_bucket, self.max_chunk)
            for request_bucket in self.requests[bisect.bisect_left(self.requests, len(chunks)):]:
                pads = pad_requests(tokens, len(chunks), token_bucket, request_bucket, max_q)
                if pads is None:
                    continue
                keys = 0
                if self.attention.packs_keys:
                    total = sum(c.end for c in chunks) + sum(pads)
                    if total > self.keys[-1]:
                        return None
                    keys = self.keys[bisect.bisect_left(self.keys, total)]
                return Bucket(token_bucket, request_bucket, keys, tuple(pads))
        return None

    def run(
        self, chunks: list[ScheduledChunk], bucket: Bucket, in_flight_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [S, vocab] of the chunks that sample, rows in chunk order, for a step that
        ``bucket`` accepted; ``in_flight_tokens``: as ``build_step_inputs``'s (``engine.in_flight``)."""
        self.steps += 1
        tokens = flat_tokens(chunks)
        self._stage(chunks, bucket, tokens, in_flight_tokens)
        shape = Bucket(bucket.tokens, bucket.requests, bucket.keys, ())  # one graph for every padding
        captured = self._graphs.get(shape)
        if captured is None and self.capture.enabled:
            what = f"step, {shape.tokens} tokens, {shape.requests} requests" + (
                f", {shape.keys} keys" if shape.keys else ""
            )
            captured = self.capture.capture(lambda: self._body(shape), what)
            if captured is not None:
                self._graphs[shape] = captured
        hidden = self._body(shape) if captured is None else self._replay(captured)
        index = host_tensor(tokens.logit_indices, torch.long).to(self.model.device, non_blocking=True)
        return self.model.logits(hidden.index_select(0, index))

    @staticmethod
    def _replay(captured: tuple[torch.cuda.CUDAGraph, torch.Tensor]) -> torch.Tensor:
        graph, hidden = captured
        graph.replay()
        return hidden

    def _stage(
        self, chunks: list[ScheduledChunk], bucket: Bucket, tokens: StepTokens, in_flight_tokens: torch.Tensor | None
    ) -> None:
        """Copy the step's tokens, rows and tables into the static buffers, padded to ``bucket``."""
        real_tokens, real_requests = len(tokens.input_ids), len(chunks)
        pin = self._pin
        t, r = bucket.tokens, bucket.requests
        ids = torch.zeros(t, dtype=torch.long, pin_memory=pin)
        positions = torch.zeros(t, dtype=torch.long, pin_memory=pin)  # pad tokens: position 0
        rows = torch.empty(t, dtype=torch.long, pin_memory=pin)
        ids[:real_tokens] = host_tensor(tokens.input_ids, torch.long)
        positions[:real_tokens] = host_tensor(tokens.positions, torch.long)
        rows[:real_tokens] = tokens.rows
        pads = host_tensor(bucket.pads, torch.long)
        rows[real_tokens:] = torch.repeat_interleave(torch.arange(real_requests, r), pads)
        table = torch.full((r, self.pages), self.kv.scratch_page, dtype=torch.long, pin_memory=pin)
        table[:real_requests] = page_tables(chunks, self.pages, pad=self.kv.scratch_page)
        queries = host_tensor([c.num_tokens for c in chunks] + list(bucket.pads), torch.int32)
        cu_q = torch.zeros(r + 1, dtype=torch.int32, pin_memory=pin)
        cu_q[1:] = queries.cumsum(0)
        used_k = torch.empty(r, dtype=torch.int32, pin_memory=pin)
        used_k[:real_requests] = host_tensor([c.end for c in chunks], torch.int32)
        used_k[real_requests:] = pads  # a pad request's keys are its own tokens
        self._ids[:t].copy_(ids, non_blocking=True)
        fill_inputs(self._ids, tokens.in_flight_indices, tokens.in_flight_sources, in_flight_tokens)
        self._positions[:t].copy_(positions, non_blocking=True)
        self._rows[:t].copy_(rows, non_blocking=True)
        self._tables[:r].copy_(table, non_blocking=True)
        self._cu_q[: r + 1].copy_(cu_q, non_blocking=True)
        self._used_k[:r].copy_(used_k, non_blocking=True)

    def _body(self, shape: Bucket) -> torch.Tensor:
        """The graph's contents: metadata from the static buffers, then the decoder stack."""
        t, r = shape.tokens, shape.requests
        positions, tables = self._positions[:t], self._tables[:r]
        meta = self.attention.static_step_metadata(
            kv_slots(tables, positions, self.page_size, rows=self._rows[:t]),
            tables,
            self._cu_q[: r + 1],
            self._used_k[:r],
            self.page_size,
            max_q=bucket_max_q(t, self.max_chunk),
            max_k=self.max_k,
            keys=shape.keys,
            scratch_slot=self.kv.scratch_page * self.page_size,
        )
        return self.model.hidden_states(self._ids[:t], positions, meta, self.kv)
