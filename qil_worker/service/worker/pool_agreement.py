"""The KV pool every tensor-parallel rank allocates: one size for all. Torch is imported inside
``agreed_pool``: the front imports the worker's modules only to name its spawn target."""

from __future__ import annotations

import dataclasses
from typing import Any

from qil_worker.service import protocol as P


def agreed_pool(model: Any, config: P.WorkerConfig, parallel: Any) -> Any:
    """The KV pool ``config`` asks for (pages, a byte budget or a fraction of free device
    memory), sized by every rank of ``parallel`` for its own shard and device, and the fewest
    pages any rank can hold taken by all: rank 0's scheduler hands out one pool's pages, which
    every rank holds its heads of. Each rank calls it at the same point of its start-up (a
    fraction's warm-up forward runs on all ranks together)."""
    from qil_worker.engine.memory import size_pool
    from qil_worker.engine.runner.model_runner import scratch_pages
    from qil_worker.parallel.group import gather_ints

    engine_config = config.engine
    memory_bytes, memory_fraction = config.kv_memory_bytes, config.kv_memory_fraction
    sized = memory_bytes is not None or memory_fraction is not None  # else: engine_config.num_pages
    scratch = scratch_pages(model, engine_config.cuda_graphs, engine_config.debug)
    pool = size_pool(
        model, engine_config.page_size, num_pages=None if sized else engine_config.num_pages,
        memory_bytes=memory_bytes, memory_fraction=memory_fraction, warmup_tokens=engine_config.token_budget,
        reserved_pages=scratch, graphs=scratch > 0,  # the scratch page means graphs
    )
    fewest = min(gather_ints(parallel, pool.num_pages))
    if fewest == pool.num_pages:
        return pool
    return dataclasses.replace(pool, num_pages=fewest, reason=f"{pool.reason}, the fewest pages of any rank")
