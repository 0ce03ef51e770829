"""One request's page table: the pages holding its computed tokens, in order."""

from __future__ import annotations

from qil_worker.kv.page_pool import PagePool


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def consecutive_start(pages: list[int], count: int) -> int | None:
    """The first page when the first ``count`` of ``pages`` follow each other in the pool (what
    the pool gives a request growing alone: its keys lie back to back), else None."""
    first = pages[0]
    return first if pages[:count] == list(range(first, first + count)) else None


class PageTable:
    """Grows only as tokens are computed; gives everything back at once."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: list[int] = []

    def extra_pages_for(self, num_tokens: int) -> int:
        """Pages still to add so that ``num_tokens`` tokens fit."""
        return max(0, pages_for(num_tokens, self.page_size) - len(self.pages))

    def grow(self, num_tokens: int, pool: PagePool) -> bool:
        """Add pages so ``num_tokens`` tokens fit; False (and no change) if the pool is short."""
        needed = self.extra_pages_for(num_tokens)
        if needed == 0:
            return True
        pages = pool.allocate(needed, after=self.pages[-1] if self.pages else None)
        if pages is None:
            return False
        self.pages.extend(pages)
        return True

    def release(self, pool: PagePool) -> list[int]:
        """Return every page to the pool; the freed ids are returned for bookkeeping."""
        pages, self.pages = self.pages, []
        pool.free(pages)
        return pages
