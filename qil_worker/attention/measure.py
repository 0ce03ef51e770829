"""Which attention backend is fastest on this device: timed once at start-up.

Every backend that passes its numeric probe (``choice.probe_varlen``) computes the same
attention; which is fastest depends on the device, the torch build's kernels and the shapes.
So ``auto`` times each on one synthetic decode step — rows whose contexts spread from short to
long, as a serving batch has them, because that spread is what padding to the longest costs —
and takes the fastest. Each timing covers the step's metadata and several layers' ``attend``,
replayed from a CUDA graph as decode steps are, so that the device's work decides, not the
host's launches.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qil_worker.attention.backend import AttentionBackend
from qil_worker.kv.cache import KVCache

ROWS = 32
CONTEXTS = (128, 2048)  # each row's keys, uniform in this range
LAYERS = 4  # ``attend`` calls per timed step (one metadata build, as in a step)
Timer = Callable[[Callable[[], None]], float]  # seconds one call of the function takes


@dataclass
class DecodeWorkload:
    """One layer's KV pool and a decode step's queries over it (``decode_workload``)."""

    kv: KVCache
    q: torch.Tensor  # [rows, heads, dim]
    positions: torch.Tensor  # [rows] each row's token position (= its keys before this token)
    tables: torch.Tensor  # [rows, pages] page ids, padded with the scratch page
    page_size: int
    context: int  # the longest row's keys, page-aligned
    query_groups: int


def decode_workload(
    device: torch.device, dtype: torch.dtype, page_size: int, heads: int, kv_heads: int, dim: int,
    rows: int | None = None, contexts: tuple[int, int] | None = None, seed: int = 0,
) -> DecodeWorkload:
    """Random queries and keys (``ROWS`` rows with ``CONTEXTS`` keys by default); the rows'
    pages are interleaved in the pool, as they are after requests grew side by side."""
    rows, contexts = rows or ROWS, contexts or CONTEXTS
    rng = random.Random(seed)
    lengths = [rng.randint(*contexts) for _ in range(rows)]
    pages = [-(-n // page_size) for n in lengths]
    width = max(pages)
    total = sum(pages)
    kv = KVCache(1, total, page_size, kv_heads, dim, dtype, device, scratch_pages=1)
    gen = torch.Generator(device=device).manual_seed(seed)
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    order = list(range(total))
    rng.shuffle(order)
    tables = torch.full((rows, width), kv.scratch_page, dtype=torch.long)
    taken = 0
    for r, n in enumerate(pages):
        tables[r, :n] = torch.tensor(order[taken : taken + n])
        taken += n
    return DecodeWorkload(
        kv=kv,
        q=torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen),
        positions=torch.tensor([n - 1 for n in lengths], device=device),
        tables=tables.to(device),
        page_size=page_size,
        context=width * page_size,
        query_groups=heads // kv_heads,
    )


def time_backend(backend: AttentionBackend, work: DecodeWorkload, timer: Timer) -> float:
    """Seconds of one decode step's attention by ``backend``: its metadata, ``LAYERS`` attends."""
    keys = int(work.positions.sum().item()) + work.positions.numel()

    def step() -> None:
        meta = backend.decode_metadata(
            work.tables, work.positions, work.page_size, work.context, work.query_groups,
            keys=keys, scratch_slot=work.kv.scratch_page * work.page_size,
        )
        for _ in range(LAYERS):
            meta.attend(work.q, work.kv, 0)

    return timer(step)


def fastest_backend(
    backends: list[AttentionBackend], work: DecodeWorkload, timer: Timer
) -> tuple[AttentionBackend, dict[str, float]]:
    """The backend whose step takes least (the first on a tie), and every backend's seconds."""
    seconds = {b.name: time_backend(b, work, timer) for b in backends}
    return min(backends, key=lambda b: seconds[b.name]), seconds


def device_timer(device: torch.device, repeats: int = 5) -> Timer:
    """Median seconds of ``repeats`` timed calls after a warm-up call. On CUDA the call is
    captured into a graph first (``decode_metadata`` is graph-safe: decode graphs capture it)
    and its replays are timed with events — the device's time, as a decode graph runs it,
    without the host's launches, which would otherwise decide the timing at these sizes; if
    capture fails, the eager calls are timed with events. Elsewhere the host clock."""

    def timer(fn: Callable[[], None]) -> float:
        fn()
        run = graph_replay(fn, device) if device.type == "cuda" else None
        run = run or fn
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    return timer


def graph_replay(fn: Callable[[], None], device: torch.device) -> Callable[[], None] | None:
    """``fn`` as the replay of a CUDA graph it was captured into, or None if it cannot be."""
    try:
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                fn()
            torch.cuda.current_stream(device).wait_stream(side)
    except Exception:  # noqa: BLE001 - time the eager calls instead
        return None
    return graph.replay
