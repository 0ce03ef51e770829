"""The explicit pool of KV pages: reference counts, a free list, nothing guessed from memory.

A page is *used* while some request holds it (reference count > 0). When the last holder lets
go it becomes *free* — or, if the prefix cache still indexes its contents, *idle*: reusable by
a later request with the same prefix, and evicted least-recently-used when the free list runs
dry. Idle pages count as available.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class PagePool:
    def __init__(self, num_pages: int, on_reuse: Callable[[list[int]], None] = lambda pages: None) -> None:
        """``on_reuse`` sees every page handed out with contents its new owner must not read."""
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.total = num_pages
        # free pages as an insertion-ordered set: a stack (``popitem`` takes the last one freed)
        # that can also hand out one given page at once (``allocate``'s ``after``)
        self._free: dict[int, None] = dict.fromkeys(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unheld; oldest first
        self._cached = [False] * num_pages
        self._on_reuse = on_reuse
        self.on_evict: Callable[[int], None] = lambda page: None  # set by the prefix cache

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free, or idle in the prefix cache)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.total - self.num_free

    @property
    def num_idle_cached(self) -> int:
        return len(self._idle)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, count: int, after: int | None = None) -> list[int] | None:
        """``count`` fresh pages, or ``None`` (taking nothing) when fewer are available.

        Each page is the one after the previous (the first: after ``after``, the holder's last
        page) when that one is free, so a request's pages stay consecutive where the pool
        allows: CPU attention reads a lone decode row's keys in place then
        (``CpuAttention.key_run``). Otherwise the page freed last."""
        if count > self.num_free:
            return None
        pages: list[int] = []
        previous = after
        while len(pages) < count and self._free:
            if previous is not None and previous + 1 in self._free:
                previous += 1
                del self._free[previous]
            else:
                previous, _ = self._free.popitem()
            pages.append(previous)
        while len(pages) < count:
            page, _ = self._idle.popitem(last=False)
            self._cached[page] = False
            self.on_evict(page)
            pages.append(page)
        for page in pages:
            self._refs[page] = 1
        self._on_reuse(pages)
        return pages

    def retain(self, page: int) -> None:
        """One more holder of a page (a prefix-cache hit); an idle page becomes used again."""
        if self._refs[page] == 0:
            if page not in self._idle:
                raise RuntimeError(f"page {page} is free, not cached: it cannot be shared")
            del self._idle[page]
        self._refs[page] += 1

    def mark_cached(self, page: int, cached: bool = True) -> None:
        self._cached[page] = cached

    def free(self, pages: list[int]) -> None:
        """One holder fewer for each page; unheld pages go idle (if cached) or free.

        Last page first: the free list is a stack, so the next request gets them back in the
        order this one held them."""
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise RuntimeError(f"page {page} freed twice")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if self._cached[page]:
                    self._idle[page] = None
                else:
                    self._free[page] = None
