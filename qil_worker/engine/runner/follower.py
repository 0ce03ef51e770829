"""What a tensor-parallel rank other than 0 runs: rank 0's steps, on its own shard of the
weights and of the KV pool, until rank 0 stops.

The follower keeps no requests, scheduler or page bookkeeping: rank 0's messages
(``parallel.step_broadcast``) say where every token's K/V go and which pages each chunk reads.
It builds the attention metadata with the backend rank 0's config names, runs the forward (its
collectives pair with rank 0's) and drops the gathered logits: rank 0 samples.
"""

from __future__ import annotations

import dataclasses

import torch

from qil_worker.attention.backend import AttentionBackend
from qil_worker.attention.choice import choose_backend
from qil_worker.engine.config import EngineConfig
from qil_worker.engine.runner.model_runner import kv_cache
from qil_worker.model import Qwen3
from qil_worker.parallel.step_broadcast import COPY_PAGES, STOP, receive


class Follower:
    """Rank ``model.parallel.rank`` (> 0) of the group that rank 0's engine of ``config`` leads."""

    def __init__(self, model: Qwen3, config: EngineConfig, attention: AttentionBackend | None = None) -> None:
        if not model.parallel.sharded or model.parallel.rank == 0:
            raise ValueError("a follower is a tensor-parallel rank other than 0")
        heads = model.heads
        self.model, self.config = model, config
        if attention is None:
            attention, _ = choose_backend(config.attention, model.device, model.dtype, config.page_size,
                                          heads.q_heads, heads.kv_heads, heads.head_dim)
        self.attention = attention
        # no debug read checks here: rank 0 runs them on the same slots
        self.kv = kv_cache(model, dataclasses.replace(config, debug=False))
        self.steps = 0

    def run(self) -> int:
        """Follow until rank 0 stops (its engine's ``close``) → how many steps ran."""
        model, page_size, groups = self.model, self.config.page_size, self.model.heads.query_groups
        while True:
            kind, message = receive(model.parallel, model.device, page_size, groups)
            if kind == STOP:
                self.kv.k = self.kv.v = torch.empty(0)
                return self.steps
            if kind == COPY_PAGES:
                self.kv.copy_pages(*message)
                continue
            attention = self.attention.step_metadata(message.layout)
            model(message.input_ids, message.positions, attention, self.kv, message.logit_indices)
            self.steps += 1


def follow(model: Qwen3, config: EngineConfig) -> int:
    """Run rank ``model.parallel.rank``'s part of rank 0's engine until it closes → steps run."""
    return Follower(model, config).run()
