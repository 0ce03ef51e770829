"""The KV tensors of every layer, addressed by flat slot = page * page_size + offset."""

from __future__ import annotations

import torch

from qil_worker import cpu_memory


class KVCache:
    """K and V for ``num_pages`` pages of ``page_size`` tokens in every layer.

    In debug mode it remembers which slots were written since their page was last handed out and
    asserts that attention never reads an unwritten slot within a request's length.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        debug: bool = False,
        scratch_pages: int = 0,
    ) -> None:
        """``scratch_pages`` extra pages after the pool's (never handed out): padded rows of a
        CUDA-graph decode batch write their throwaway K/V there."""
        self.page_size = page_size
        self.scratch_page = num_pages if scratch_pages else None
        shape = (num_layers, (num_pages + scratch_pages) * page_size, num_kv_heads, head_dim)
        self.k = cpu_memory.zeros(shape, dtype, device)
        self.v = cpu_memory.zeros(shape, dtype, device)
        self.debug = debug
        # CPU: gathered K/V go to buffers reused across layers and steps. Fresh tensors of tens of
        # MB are new mappings every time, and their page faults cost more than the copy itself.
        # Not on CUDA, where the caching allocator already reuses memory and a captured graph
        # must keep the addresses it was captured with.
        self._reuse_gather = torch.device(device).type == "cpu"
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None
        self._written = torch.zeros((num_pages + scratch_pages) * page_size, dtype=torch.bool) if debug else None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this step's keys and values (``[T, Hkv, D]``) at ``slots`` [T]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)
        if self._written is not None and layer == 0:
            self._written[slots.cpu()] = True

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` at ``slots`` [N] as two contiguous [N, Hkv, D] tensors.

        On CPU they live in reused buffers: valid until the next ``gather``.
        """
        k, v = self.k[layer], self.v[layer]
        if not self._reuse_gather:
            return k.index_select(0, slots), v.index_select(0, slots)
        out_k, out_v = self._buffers(slots.numel())
        return torch.index_select(k, 0, slots, out=out_k), torch.index_select(v, 0, slots, out=out_v)

    def gather_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole ``pages`` [P] in order, as ``gather`` of their slots would give them
        ([P * page_size, Hkv, D]): one index per page instead of per token, less indexing work
        for the same bytes."""
        k, v = (t[layer].view(t.shape[1] // self.page_size, -1) for t in (self.k, self.v))
        shape = (pages.numel() * self.page_size, *self.k.shape[2:])
        if not self._reuse_gather:
            return k.index_select(0, pages).view(shape), v.index_select(0, pages).view(shape)
        out_k, out_v = (t.view(pages.numel(), -1) for t in self._buffers(shape[0]))
        return (
            torch.index_select(k, 0, pages, out=out_k).view(shape),
            torch.index_select(v, 0, pages, out=out_v).view(shape),
        )

    def head_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """For ``slots`` [..., L], the rows of ``gather_rows`` that give their keys head by head:
        flattened [..., Hkv, L], so each KV head's keys come out contiguous."""
        heads = torch.arange(self.k.shape[2], device=slots.device)
        return (slots.unsqueeze(-2) * self.k.shape[2] + heads[:, None]).reshape(-1)

    def gather_rows(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``layer`` viewed as one row per (slot, KV head) — row ``slot * Hkv + head`` —
        at ``rows`` [N], as two contiguous [N, D] tensors (``head_rows`` orders them head-major).
        On CPU in the reused buffers, like ``gather``."""
        kv_heads, dim = self.k.shape[2:]
        k, v = (t[layer].view(-1, dim) for t in (self.k, self.v))
        if not self._reuse_gather:
            return k.index_select(0, rows), v.index_select(0, rows)
        out_k, out_v = (t.view(-1, dim) for t in self._buffers(-(-rows.numel() // kv_heads)))
        n = rows.numel()
        return (
            torch.index_select(k, 0, rows, out=out_k[:n]),
            torch.index_select(v, 0, rows, out=out_v[:n]),
        )

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reused CPU gather buffers, at least ``n`` rows, cut to exactly ``n``."""
        if self._gathered is None or self._gathered[0].shape[0] < n:
            rows = n if self._gathered is None else n * 5 // 4  # grown: leave room to grow more
            self._gathered = tuple(cpu_memory.empty((rows, *self.k.shape[2:]), self.k.dtype) for _ in range(2))
        return self._gathered[0][:n], self._gathered[1][:n]

    def check_reads(self, slot_mapping: torch.Tensor, reads: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Debug check, before a step's forward: every key its attention ``reads`` (key slots
        [B, L], key counts [B]: ``StepAttention.reads``) was written, earlier or by this step
        itself (at ``slot_mapping``). Nothing outside debug mode."""
        if self._written is None:
            return
        written = self._written.clone()
        written[slot_mapping.cpu()] = True
        for key_slots, key_lengths in reads:
            self.check_readable(key_slots, key_lengths, written)

    def check_readable(
        self, key_slots: torch.Tensor, key_lengths: torch.Tensor, written: torch.Tensor | None = None
    ) -> None:
        """Debug check: the first ``key_lengths[b]`` slots of row ``b`` have all been written
        (per ``written``, default what this cache has recorded)."""
        if self._written is None:
            return
        written = self._written if written is None else written
        slots, lengths = key_slots.cpu(), key_lengths.cpu()
        valid = torch.arange(slots.shape[1])[None, :] < lengths[:, None]
        unwritten = ~written[slots[valid]]
        if bool(unwritten.any()):
            raise AssertionError(f"attention would read {int(unwritten.sum())} unwritten KV slot(s)")

    def copy_pages(self, sources: list[int], targets: list[int]) -> None:
        """K and V of page ``sources[i]`` into page ``targets[i]``, in every layer: one copy per
        tensor for all pages and layers (the forked samples of a request, ``engine.samples``)."""
        if not sources:
            return
        src = torch.tensor(sources, dtype=torch.long).to(self.k.device, non_blocking=True)
        dst = torch.tensor(targets, dtype=torch.long).to(self.k.device, non_blocking=True)
        for t in (self.k, self.v):
            pages = t.view(t.shape[0], t.shape[1] // self.page_size, -1)  # [layers, pages, page]
            pages.index_copy_(1, dst, pages.index_select(1, src))
        if self._written is not None:
            written = self._written.view(-1, self.page_size)
            written[dst.cpu()] = written[src.cpu()]

    def forget_pages(self, pages: list[int]) -> None:
        """Debug bookkeeping: freed pages hold nothing a later owner may read."""
        if self._written is None or not pages:
            return
        for page in pages:
            self._written[page * self.page_size : (page + 1) * self.page_size] = False
