"""Who computes what in the next step, under one token budget and a finite page pool.

Running requests go first (decodes before prefill chunks, rotating the start so no request
starves when the budget is short), then waiting requests are admitted on the pages their first
chunk needs now — no reservation for their whole future — in the order of the admission policy
(``qil_worker.engine.schedule_policy``: arrival order, or fewest tokens left after the cached prefix).
When a running request cannot get a page, the most recently admitted running request is
preempted: its pages are freed and it goes back to the head of the queue to recompute its
prompt and generated tokens later. The oldest request can always take the whole pool, so
something always progresses.

A request whose last sampled token is still on the device (an overlapped engine,
``engine.in_flight``) counts that token in ``num_tokens`` and gets its decode row like any
other, unless that token is its last.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from qil_worker.engine.request import Request, RequestStatus, unforked
from qil_worker.kv.page_pool import PagePool
from qil_worker.kv.prefix_cache import PrefixCache
from qil_worker.engine.schedule_policy import MAX_BYPASS, SCHEDULE_POLICIES, SHORTEST_FIRST_WINDOW


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens ``[start, start + num_tokens)`` of ``request`` are computed this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def pages(self) -> list[int]:
        """The request's KV pages (``attention.backend.Chunk``)."""
        return self.request.page_table.pages

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last known token, so a new one is sampled."""
        return self.end == self.request.num_tokens and self.request.pooling is None

    @property
    def pools(self) -> bool:
        """Whether this chunk ends a pooled request's prompt: its answer is read off it."""
        return self.request.pooling is not None and self.end == self.request.num_tokens


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        token_budget: int,
        prefill_chunk: int,
        max_active: int,
        prefix_cache: PrefixCache | None = None,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULE_POLICIES:
            choices = ", ".join(SCHEDULE_POLICIES)
            raise ValueError(f"schedule policy must be one of {choices}, got {policy!r}")
        self.policy = policy
        self.pool = pool
        self.token_budget = token_budget
        self.prefill_chunk = prefill_chunk
        self.max_active = max_active
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix_cache = prefix_cache
        self._admissions = 0
        self._rotation = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished, cancelled or failed) and free its pages."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._release_pages(request)
        request.status = RequestStatus.FINISHED

    def adopt(self, request: Request, running: bool) -> None:
        """A forked sample (``engine.samples.fork``) joins: running on the pages it was given,
        or, without them, at the head of the queue to compute its prompt when admitted (as a
        preempted request: its admission counts as its request's, done)."""
        request.admitted_seq = self._admissions
        self._admissions += 1
        if running:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            request.page_table.pages = []
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

    def schedule(self, preempt: bool = True) -> list[ScheduledChunk] | None:
        """Pick this step's work; pages for every chosen token are allocated on return.

        ``preempt`` False: give up instead, returning None, where a running request's chunk
        would need a preemption. Nothing is undone then but the rotation; the pages taken so
        far stay with their requests, whose chunks the retry asks for again.
        """
        budget = self.token_budget
        rotation = self._rotation
        chosen: dict[Request, ScheduledChunk] = {}
        preempted_any = False
        if self.prefix_cache is not None:
            self.prefix_cache.begin_step()
        for request in self._running_order():
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            if request.num_output_tokens >= request.max_new_tokens:
                continue  # its token in flight is its last (``engine.in_flight``)
            count = min(request.num_tokens - request.num_computed_tokens, self.prefill_chunk, budget)
            table = request.page_table
            # most steps need no new page (a decode takes one every page_size tokens): test that first
            if request.num_computed_tokens + count > len(table.pages) * table.page_size:
                preempted_itself = False
                while not table.grow(request.num_computed_tokens + count, self.pool):
                    if not preempt:
                        self._rotation = rotation
                        return None
                    victim = max(self.running, key=lambda r: r.admitted_seq)
                    preempted_any = True
                    undone = chosen.pop(victim, None)
                    if undone is not None:
                        budget += undone.num_tokens
                    self._preempt(victim)
                    if victim is request:
                        preempted_itself = True
                        break
                if preempted_itself:
                    continue
            chosen[request] = ScheduledChunk(request, request.num_computed_tokens, count)
            budget -= count
        if not preempted_any:
            if self.prefix_cache is not None:
                for chunk in chosen.values():
                    if chunk.start < len(chunk.request.prompt_token_ids):  # decodes fill no prompt page
                        self._announce(chunk)
            budget = self._admit(chosen, budget)
        return list(chosen.values())

    def _running_order(self) -> list[Request]:
        """Decodes first, prefill chunks after; the start rotates every step for fairness."""
        if not self.running:
            return []
        k = self._rotation % len(self.running)
        self._rotation += 1
        rotated = self.running[k:] + self.running[:k]
        decodes = [r for r in rotated if r.num_tokens - r.num_computed_tokens <= 1]
        if len(decodes) == len(rotated):
            return rotated
        return decodes + [r for r in rotated if r.num_tokens - r.num_computed_tokens > 1]

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """After the forward: the chunks' tokens are in the KV cache; index full prompt pages."""
        cache = self.prefix_cache
        for chunk in chunks:
            request = chunk.request
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            if cache is not None and chunk.start < len(request.prompt_token_ids):  # decodes fill no prompt page
                for page in self._prompt_pages_filled(chunk):
                    cache.insert(*page)

    def _announce(self, chunk: ScheduledChunk) -> None:
        """Offer the prompt pages this chunk fills to requests admitted into the same step."""
        if self.prefix_cache is not None:
            for page in self._prompt_pages_filled(chunk):
                self.prefix_cache.announce(*page)

    def _prompt_pages_filled(self, chunk: ScheduledChunk) -> list[tuple[int, list[int], int]]:
        """(hash, tokens, page) of every full prompt page whose last token this chunk computes."""
        request = chunk.request
        prompt = request.prompt_token_ids
        if not request.page_hashes or chunk.start >= len(prompt):  # a decode fills no prompt page
            return []
        size = self.prefix_cache.page_size
        first = min(chunk.start, len(prompt)) // size
        last = min(chunk.end, len(prompt)) // size
        return [
            (request.page_hashes[i], prompt[i * size : (i + 1) * size], request.page_table.pages[i])
            for i in range(first, last)
        ]

    def _admit(self, chosen: dict[Request, ScheduledChunk], budget: int) -> int:
        if not self.waiting:
            return budget
        # a request of n samples takes n slots from its admission on: its samples fork into
        # running when its prompt is computed (``engine.samples``)
        slots = len(self.running) + sum(len(unforked(r)) for r in self.running)
        for request in self._admission_order():
            if budget <= 0 or slots + 1 + len(unforked(request)) > self.max_active:
                break
            cached = self._reuse_cached_prefix(request)
            count = min(request.num_tokens - request.num_computed_tokens, self.prefill_chunk, budget)
            if not request.page_table.grow(request.num_computed_tokens + count, self.pool):
                if cached:
                    self._release_pages(request)
                    request.num_computed_tokens = 0
                break
            if request.admitted_seq < 0:
                # first admission only: a preempted request finding its own pages again would
                # count its prompt twice and inflate the hit rate (vLLM reports it this way too)
                if self.prefix_cache is not None:
                    self.prefix_cache.record(len(request.prompt_token_ids), cached)
                request.num_cached_tokens = cached
            self._take_from_queue(request)
            request.status = RequestStatus.RUNNING
            request.admitted_seq = self._admissions
            self._admissions += 1
            self.running.append(request)
            slots += 1 + len(unforked(request))
            chosen[request] = ScheduledChunk(request, request.num_computed_tokens, count)
            self._announce(chosen[request])
            budget -= count
        return budget

    def _admission_order(self) -> list[Request]:
        """The waiting requests to try this step, best first (see the module docstring)."""
        slots = max(0, self.max_active - len(self.running))
        if self.policy == "fcfs" or len(self.waiting) < 2 or slots == 0:
            return list(itertools.islice(self.waiting, slots))
        window = list(itertools.islice(self.waiting, SHORTEST_FIRST_WINDOW))

        def rank(item: tuple[int, Request]) -> tuple[int, ...]:
            position, request = item
            # preempted requests (admitted before) and overtaken-too-often ones: queue order, first
            if request.admitted_seq >= 0 or request.times_bypassed >= MAX_BYPASS:
                return (0, position)
            return (1, self._work_left(request), position)

        return [request for _, request in sorted(enumerate(window), key=rank)][:slots]

    def _work_left(self, request: Request) -> int:
        """Tokens a waiting request would compute after the prefix the cache holds now."""
        if self.prefix_cache is None or not request.page_hashes:
            return request.num_tokens
        cached = self.prefix_cache.cached_tokens(request.page_hashes, self._shareable_pages(request))
        return request.num_tokens - cached

    def _take_from_queue(self, request: Request) -> None:
        """Remove an admitted request from the queue; under shortest-first, count it against
        every request it overtook."""
        if self.waiting[0] is request:
            self.waiting.popleft()
            return
        for overtaken in self.waiting:
            if overtaken is request:
                break
            overtaken.times_bypassed += 1
        self.waiting.remove(request)

    def _reuse_cached_prefix(self, request: Request) -> int:
        """Start a queued request after its longest cached prefix; the cached token count."""
        if self.prefix_cache is None or request.num_computed_tokens or not request.page_hashes:
            return 0
        pages = self.prefix_cache.match(
            request.prompt_token_ids, request.page_hashes, self._shareable_pages(request)
        )
        request.page_table.pages = pages
        request.num_computed_tokens = len(pages) * self.prefix_cache.page_size
        return request.num_computed_tokens

    def _shareable_pages(self, request: Request) -> int:
        """Leading pages a request may take from the cache: the last known token is always
        computed, so that it yields logits to sample from; and a request that collects prompt
        logprobs computes every position it has not scored yet."""
        pages = (request.num_tokens - 1) // self.prefix_cache.page_size
        if request.prompt_logprobs is not None:
            pages = min(pages, request.prompt_logprobs.num_scored // self.prefix_cache.page_size)
        return pages

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_pages(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release_pages(self, request: Request) -> None:
        request.page_table.release(self.pool)
