"""How an engine runs: everything but the model and the tokenizer, in one typed record
(torch-free: the serve command line builds it once and the front sends it to the worker whole).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

RETAINED_RESULTS = 1024  # finished requests whose ``result()`` stays known (newest first)


@dataclass(frozen=True)
class EngineConfig:
    """``num_pages`` × ``page_size``: the KV pool (tokens per page). ``token_budget``: tokens one
    step computes, all requests together; ``prefill_chunk``: prompt tokens of one request per step
    at most; ``max_active``: requests running at once (the rest wait). ``prefix_cache``: reuse the
    KV of shared prompt prefixes. ``schedule_policy``: the order waiting requests are admitted in
    (``engine.schedule_policy``). ``attention``: ``"auto"``, ``"sdpa"``, ``"varlen"`` (paged),
    ``"varlen-packed"`` or ``"varlen-pages"`` (CUDA; ``attention.choice``).

    ``cuda_graphs``: replay decode-only steps from captured graphs (default: on for CUDA, off
    with ``debug``); ``True`` on another device runs the same padded decode path without capture
    (for tests). ``step_graphs``: with ``cuda_graphs``, replay the other steps (prefill chunks
    beside decodes) from graphs too, where the attention backend builds their metadata in a graph
    (opt-in: padding those steps to their bucket measured slower on an H200 than running them
    eagerly, see docs/performance.md). ``overlap``: schedule and stage each step while the previous one runs on
    the device (default: on for CUDA; ``engine.in_flight``). ``debug``: check every KV read.
    ``retained_results``: finished requests whose ``result()`` stays known (0: none, as a server
    that reads results from the events wants). ``compile_decode`` (CPU): run a lone request's
    decode steps through the model's decode forward compiled by inductor's C++ backend
    (``model.compiled_decode``; compiled on first use, once per model, which takes minutes for a
    real model on a few cores and is not cached on disk: opt-in, see docs/performance.md).
    """

    num_pages: int = 512
    page_size: int = 16
    token_budget: int = 512
    prefill_chunk: int = 512
    max_active: int = 64
    prefix_cache: bool = True
    schedule_policy: str = "fcfs"
    attention: str = "auto"
    cuda_graphs: bool | None = None
    step_graphs: bool | None = None
    overlap: bool | None = None
    debug: bool = False
    retained_results: int = RETAINED_RESULTS
    compile_decode: bool = False

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "token_budget", "prefill_chunk", "max_active"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        value = self.retained_results
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"retained_results must be a non-negative integer, got {value!r}")
        # (the policy's and the attention's names are checked where they are used: the
        # scheduler and attention.choice)


FIELDS = tuple(f.name for f in fields(EngineConfig))
