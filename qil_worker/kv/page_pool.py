"""The explicit pool of KV pages: a free list, nothing guessed from device memory."""

from __future__ import annotations


class PagePool:
    """Hands out page ids and takes them back; freed pages are reused first."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.total = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.total - len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` pages, or ``None`` (taking nothing) when fewer are free."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if self._is_free[page]:
                raise RuntimeError(f"page {page} freed twice")
            self._is_free[page] = True
            self._free.append(page)
