"""Sharing full pages of prompt tokens between requests.

Page ``i`` of a prompt is named by a chained digest: BLAKE2b(name of page ``i-1``, its tokens),
so one name stands for the whole prefix up to that page. The digest is cryptographic (128 bits):
two different prefixes with one name cannot be found, not even deliberately by a client that
wants another request's KV — with Python's ``hash`` they could be computed offline, and a hit
that compared only the page's own tokens would then hand out KV computed under another prefix.
A hit still compares the stored tokens. Only full pages of the prompt are
shared, never the last partial one, so shared pages are never written again. Pages nobody
holds stay indexed (idle in the pool) until the pool evicts them, least recently used first.

Pages being computed in the step now being scheduled are matched too (``announce``): the model
writes every token's K/V of a layer before any attention of that layer, so a request admitted
into the same step can read a page another request of that step fills. Requests that share a
new system prompt and arrive together then compute it once, not once per request that fits
into the first step. Announcements last one scheduling pass; pages are indexed for good at
commit, once their step has run.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from qil_worker.kv.page_pool import PagePool

DIGEST_BYTES = 16


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """Chained digests of every full page of ``token_ids``, as ints (see the module docstring)."""
    hashes: list[int] = []
    parent = bytes(DIGEST_BYTES)
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        tokens = array("q", token_ids[start : start + page_size]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=DIGEST_BYTES).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._by_hash: dict[int, int] = {}
        self._page_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # page → (hash, tokens)
        self._in_flight: dict[int, tuple[int, tuple[int, ...]]] = {}  # hash → (page, tokens)
        pool.on_evict = self._forget
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_key)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def match(self, token_ids: Sequence[int], hashes: Sequence[int], max_pages: int) -> list[int]:
        """Hold and return the cached pages of the longest cached prefix (at most ``max_pages``)."""
        pages: list[int] = []
        for i, h in enumerate(hashes[:max_pages]):
            page = self._by_hash.get(h)
            stored = self._page_key[page][1] if page is not None else None
            if page is None and h in self._in_flight:
                page, stored = self._in_flight[h]
            tokens = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            if page is None or stored != tokens:  # not cached, or a hash collision
                break
            pages.append(page)
        for page in pages:
            self.pool.retain(page)
        return pages

    def cached_tokens(self, hashes: Sequence[int], max_pages: int) -> int:
        """Leading tokens a prompt with these page hashes would find cached now, holding nothing.

        By hash alone (an estimate, to rank waiting requests cheaply); ``match`` confirms tokens.
        """
        found = 0
        for h in hashes[:max_pages]:
            if h not in self._by_hash and h not in self._in_flight:
                break
            found += 1
        return found * self.page_size

    def record(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count one admitted request for the hit rate."""
        self.queried_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def begin_step(self) -> None:
        """Forget the previous scheduling pass's announcements (its step has run or failed)."""
        self._in_flight.clear()

    def announce(self, page_hash: int, tokens: Sequence[int], page: int) -> None:
        """``page`` will hold ``tokens`` once the step being scheduled has run: shareable by
        requests admitted into that same step (see the module docstring)."""
        if page_hash not in self._by_hash:
            self._in_flight.setdefault(page_hash, (page, tuple(tokens)))

    def insert(self, page_hash: int, tokens: Sequence[int], page: int) -> None:
        """Index a page whose KV now holds ``tokens`` (a full page of some prompt)."""
        if page_hash in self._by_hash or page in self._page_key:
            return  # the same prefix was computed twice at once; keep the first
        self._by_hash[page_hash] = page
        self._page_key[page] = (page_hash, tuple(tokens))
        self.pool.mark_cached(page)

    def _forget(self, page: int) -> None:
        page_hash, _ = self._page_key.pop(page)
        del self._by_hash[page_hash]
