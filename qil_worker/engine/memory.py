"""Sizing the KV page pool from a memory budget instead of an explicit page count."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qil_worker.model import Qwen3


def bytes_per_page(model: Qwen3, page_size: int) -> int:
    """K and V of ``page_size`` tokens in every layer (of this rank's KV heads, under tensor
    parallelism)."""
    c = model.config
    element = torch.empty((), dtype=model.dtype).element_size()
    return 2 * c.num_hidden_layers * page_size * model.heads.kv_heads * c.head_dim * element


@dataclass(frozen=True)
class PoolSize:
    num_pages: int
    page_size: int
    page_bytes: int
    reason: str
    reserved_pages: int = 0  # allocated beside the pool: the decode graphs' scratch page

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def total_bytes(self) -> int:
        """What the KV tensors take, reserved pages included."""
        return (self.num_pages + self.reserved_pages) * self.page_bytes

    def summary(self) -> str:
        reserved = f" + {self.reserved_pages} scratch page" if self.reserved_pages else ""
        return (
            f"KV pool: {self.num_pages} pages x {self.page_size} tokens = {self.num_tokens} tokens"
            f"{reserved}, {format_bytes(self.total_bytes)} ({self.reason})"
        )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def size_pool(
    model: Qwen3,
    page_size: int,
    num_pages: int | None = None,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    warmup_tokens: int = 512,
    reserved_pages: int = 0,
    graphs: bool = False,
) -> PoolSize:
    """Choose the number of pages: explicit, a byte budget, or a fraction of free CUDA memory.

    ``reserved_pages``: pages the engine allocates beside the pool (``runner.model_runner.scratch_pages``);
    a budget covers them too. For a fraction, one forward of ``warmup_tokens`` tokens (the
    engine's token budget: its largest step) runs first on a throwaway pool; the fraction is
    then taken of the free memory less that step's activation peak, which later steps need
    again — twice with ``graphs`` (CUDA graphs on): a captured step of that size keeps its
    activations in the graphs' own memory pool, beside what eager steps allocate.
    """
    page_bytes = bytes_per_page(model, page_size)
    if sum(x is not None for x in (num_pages, memory_bytes, memory_fraction)) != 1:
        raise ValueError("give exactly one of num_pages, memory_bytes or memory_fraction")
    if num_pages is not None:
        return PoolSize(num_pages, page_size, page_bytes, "explicit page count", reserved_pages)
    if memory_bytes is not None:
        if memory_bytes < (1 + reserved_pages) * page_bytes:
            raise ValueError(
                f"kv memory budget {format_bytes(memory_bytes)} is below one page "
                f"({format_bytes(page_bytes)}{' plus a scratch page' if reserved_pages else ''})"
            )
        return PoolSize(
            memory_bytes // page_bytes - reserved_pages, page_size, page_bytes,
            f"budget of {format_bytes(memory_bytes)}", reserved_pages,
        )
    assert memory_fraction is not None
    if not 0.0 < memory_fraction < 1.0:
        raise ValueError(f"kv memory fraction must be in (0, 1), got {memory_fraction}")
    if model.device.type != "cuda":
        raise ValueError("a kv memory fraction needs a CUDA device; give a byte budget instead")
    warmup_tokens, peak = _warm_up(model, page_size, warmup_tokens)
    free, total = torch.cuda.mem_get_info(model.device)
    peaks = 2 if graphs else 1
    budget = int(max(0, free - peaks * peak) * memory_fraction)
    if budget < (1 + reserved_pages) * page_bytes:
        raise ValueError(f"{memory_fraction:.0%} of free device memory is less than one KV page")
    return PoolSize(
        budget // page_bytes - reserved_pages, page_size, page_bytes,
        f"{memory_fraction:.0%} of {free / 2**30:.2f} GiB free after the weights, less the "
        f"{format_bytes(peak)} activation peak of a {warmup_tokens}-token step"
        f"{' (twice: eager and in CUDA graphs)' if graphs else ''} "
        f"(device total {total / 2**30:.2f} GiB)",
        reserved_pages,
    )


def _warm_up(model: Qwen3, page_size: int, tokens: int) -> tuple[int, int]:
    """Run one ``tokens``-token step (fewer if the model has fewer positions) on a throwaway
    pool; returns the tokens it ran and the bytes it allocated at its peak beyond the weights and
    that pool (activations, attention workspace, logits). The allocator's cache is emptied
    after, so free memory is read without it."""
    from qil_worker.engine.engine import Engine

    device = model.device
    tokens = max(2, min(tokens, model.config.max_position_embeddings - 1))
    pages = -(-tokens // page_size)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    engine = Engine(model, num_pages=pages, page_size=page_size, token_budget=tokens,
                    prefill_chunk=tokens, prefix_cache=False, cuda_graphs=False)
    engine.generate([[0] * (tokens - 1)], max_new_tokens=1)
    engine.close()
    del engine
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - pages * bytes_per_page(model, page_size)
    torch.cuda.empty_cache()
    return tokens, max(0, peak)
