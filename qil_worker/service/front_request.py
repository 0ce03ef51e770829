"""The front's log of one request, and the followers that stream it.

A request's log is its list of output tokens plus its final record; a follower keeps only a
cursor into it, so a slow reader costs no memory beyond the log itself (bounded by
max_new_tokens) and never stalls anyone: when it catches up, everything produced meanwhile goes
out as one event (coalescing). ``Retention`` decides how long finished logs stay for late
subscribers.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

from qil_worker.service import limits


def retained_size(req: "Req") -> int:
    """What keeping a finished request costs, in token-equivalents: each output token, plus one
    per top-logprob candidate it carries (those dominate: ~100 bytes each in Python objects)."""
    width = len(req.top[0]) if req.top else 0
    return max(1, len(req.tokens) * (1 + width))


class Req:
    """One request as the front sees it: its output so far and, once over, its final record.

    Per output token i: ``tokens[i]``, and when the worker sends them ``texts[i]`` (the text
    delta that token released), ``logprobs[i]`` and ``top[i]``. Parallel lists, so a follower
    starting at any cursor gets aligned slices.
    """

    __slots__ = (
        "rid", "prompt_len", "tokens", "texts", "logprobs", "top", "final_text", "final", "lost",
        "listeners",
    )

    def __init__(self, rid: str, prompt_len: int) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.tokens: list[int] = []
        self.texts: list[str] | None = None  # None: the worker has no tokenizer
        self.logprobs: list[float] | None = None  # None: not asked for
        self.top: list[list[tuple[int, float]]] | None = None
        self.final_text = ""  # text released by the end itself (no token of its own)
        # (finish_code, error, final_tuple_or_None) once the request is over
        self.final: tuple[int, str | None, tuple | None] | None = None
        self.lost = False  # ended because the worker died
        self.listeners: set[Any] = set()

    @property
    def done(self) -> bool:
        return self.final is not None

    def add(self, token: int, text: str | None, logprob: float | None, top: list | None) -> None:
        """One event of the worker: a token (``token >= 0``) or the end's own text."""
        if text is not None and self.texts is None:
            self.texts = [""] * len(self.tokens)
        if token < 0:
            if text:
                self.final_text += text
            return
        self.tokens.append(token)
        if self.texts is not None:
            self.texts.append(text or "")
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = [0.0] * (len(self.tokens) - 1)
            self.logprobs.append(logprob)
        if top is not None:
            if self.top is None:
                self.top = [[] for _ in range(len(self.tokens) - 1)]
            self.top.append(top)


class Follower:
    """Wakes one coroutine whenever a request it follows has news.

    With ``max_backlog``, it also watches how far its reader is behind: ``written`` is the
    cursor up to which the follower's events have been written to the client and
    ``writing_since`` when the write in flight started (None: none is). When the request has
    produced more than ``max_backlog`` tokens past ``written`` while one write has been pending
    for ``limits.STREAM_STALL_S`` (the client stopped reading and HTTP/2 flow control holds the
    writer), ``on_backlog`` is called once and ``exhausted`` is set. A follower that is merely
    waiting for news is never behind: its next event takes everything at once. The stall time
    keeps a reader that is only briefly slow (a busy host) from being cut off.
    """

    __slots__ = (
        "_event", "lost", "written", "writing_since", "max_backlog", "exhausted", "on_backlog",
    )

    def __init__(self, max_backlog: int | None = None, on_backlog: Callable[[Req], Any] | None = None) -> None:
        self._event = asyncio.Event()
        self.lost = False
        self.written = 0
        self.writing_since: float | None = None
        self.max_backlog = max_backlog
        self.exhausted = False
        self.on_backlog = on_backlog

    def wake(self, req: Req) -> None:
        if (
            self.max_backlog is not None
            and self.writing_since is not None
            and not self.exhausted
            and req.final is None
            and len(req.tokens) - self.written > self.max_backlog
            and time.monotonic() - self.writing_since >= limits.STREAM_STALL_S
        ):
            self.exhausted = True
            if self.on_backlog is not None:
                self.on_backlog(req)
        self._event.set()

    def worker_lost(self, req: Req) -> None:
        self.lost = True
        self._event.set()

    async def wait(self, timeout: float | None = None) -> None:
        if timeout is None:
            await self._event.wait()
        else:
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        self._event.clear()


class Retention:
    """Which finished requests stay for late subscribers: the newest ones, within a count, a
    token-equivalent size (``retained_size``) and an age. Oldest first out."""

    def __init__(self, max_count: int, max_size: int, max_age_s: float) -> None:
        self.max_count = max_count
        self.max_size = max_size
        self.max_age_s = max_age_s
        self._kept: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()
        self.size = 0  # the sum of the kept requests' sizes

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, req: Req) -> list[str]:
        """Keep ``req`` (finished now); returns the ids that no longer fit, oldest first."""
        self.forget(req.rid)
        size = retained_size(req)
        self._kept[req.rid] = (time.monotonic(), size)
        self.size += size
        return self.expired()

    def forget(self, rid: str) -> None:
        entry = self._kept.pop(rid, None)
        if entry is not None:
            self.size -= entry[1]

    def expired(self) -> list[str]:
        """Drop and return the oldest kept ids beyond the count, size or age bounds."""
        cutoff = time.monotonic() - self.max_age_s
        dropped = []
        while self._kept and (
            len(self._kept) > self.max_count
            or self.size > self.max_size
            or next(iter(self._kept.values()))[0] < cutoff
        ):
            rid = next(iter(self._kept))
            self.forget(rid)
            dropped.append(rid)
        return dropped
