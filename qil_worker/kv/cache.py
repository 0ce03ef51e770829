"""The KV tensors of every layer, addressed by flat slot = page * page_size + offset."""

from __future__ import annotations

import torch


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
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.debug = debug
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

    def check_readable(self, key_slots: torch.Tensor, key_lengths: torch.Tensor) -> None:
        """Debug check: the first ``key_lengths[b]`` slots of row ``b`` have all been written."""
        if self._written is None:
            return
        slots, lengths = key_slots.cpu(), key_lengths.cpu()
        valid = torch.arange(slots.shape[1])[None, :] < lengths[:, None]
        unwritten = ~self._written[slots[valid]]
        if bool(unwritten.any()):
            raise AssertionError(f"attention would read {int(unwritten.sum())} unwritten KV slot(s)")

    def forget_pages(self, pages: list[int]) -> None:
        """Debug bookkeeping: freed pages hold nothing a later owner may read."""
        if self._written is None or not pages:
            return
        for page in pages:
            self._written[page * self.page_size : (page + 1) * self.page_size] = False
