"""What the streaming calls (Generate, StreamEvents) share: a ``Subscription`` to a request's log,
which builds the event that takes its reader from its cursor to the end of the log and owns the
rule on how far a reader may fall behind."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.service import limits
from qil_worker.service.errors import ServiceError, invalid, resource_exhausted
from qil_worker.service.front_request import FrontRequest
from qil_worker.service.protocol import RequestMetrics

if TYPE_CHECKING:
    from qil_worker.service.front import Front

log = logging.getLogger("qil.server")


def request_metrics(metrics: RequestMetrics) -> pb.RequestMetrics:
    return pb.RequestMetrics(
        queue_time_s=metrics.queue_time_s or 0.0,
        ttft_s=metrics.ttft_s or 0.0,
        mean_itl_s=metrics.mean_itl_s or 0.0,
        max_itl_s=metrics.max_itl_s or 0.0,
        e2e_s=metrics.e2e_s or 0.0,
        num_preemptions=metrics.num_preemptions,
    )


def build_event(req: FrontRequest, cursor: int) -> tuple[pb.Event | None, int, bool]:
    """The event that takes a reader from ``cursor`` to the end of ``req``'s log.

    Returns ``(event or None, new cursor, done)``. All tokens produced since the cursor go into
    one event: that is the coalescing for readers slower than the worker.
    """
    n = len(req.tokens)
    final = req.final
    if cursor >= n and final is None:
        return None, cursor, False
    ev = pb.Event(request_id=req.rid, seq=cursor, token_ids=req.tokens[cursor:])
    if req.texts is not None:
        ev.text = "".join(req.texts[cursor:]) + (req.final_text if final is not None else "")
    if req.logprobs is not None:
        ev.logprobs.extend(req.logprobs[cursor:])
    if req.top is not None:
        for top in req.top[cursor:]:
            ev.top_logprobs.add().candidates.extend(
                pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top
            )
    if cursor == 0 and req.prompt_logprobs is not None:
        scored = req.prompt_logprobs
        ev.prompt_logprobs.extend(scored.logprobs)
        for top in scored.top or ():
            ev.prompt_top_logprobs.add().candidates.extend(
                pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in top
            )
    if final is not None:
        ev.finished = True
        ev.finish_reason = final.reason
        if final.error:
            ev.error = final.error
        ev.num_prompt_tokens = req.prompt_len
        ev.num_output_tokens = n
        if final.metrics is not None:
            ev.metrics.CopyFrom(request_metrics(final.metrics))
        ev.num_cached_tokens = final.num_cached_tokens
        stop = final.stop_reason
        if isinstance(stop, str):
            ev.stop_string = stop
        elif stop is not None:
            ev.stop_token_id = stop
    return ev, n, final is not None


def past_the_end(req: FrontRequest, from_seq: int) -> ServiceError:
    return invalid("from_seq", f"{from_seq} is past the end ({len(req.tokens)})")


class WriteClock:
    """When the write in flight on one gRPC stream began (None: none is). A write that stays
    pending means HTTP/2 flow control holds it: the client stopped reading."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def started(self) -> None:
        self.since = time.monotonic()

    def done(self) -> None:
        self.since = None

    def stalled(self) -> bool:
        return self.since is not None and time.monotonic() - self.since >= limits.STREAM_STALL_S


class Subscription:
    """A reader of one request's log: a cursor, what of it was written, and a backlog bound.

    ``next_event()`` takes the cursor to the end of the log; ``written()`` records that the
    event went out. When the request has produced more than ``max_backlog`` tokens past what
    was written while the stream's write has been pending for ``limits.STREAM_STALL_S``,
    ``on_behind(self)`` is called once and ``exhausted`` is set. A reader that is merely waiting
    for news is never behind: its next event takes everything at once, and the stall time keeps
    a reader that is only briefly slow (a busy host) from being cut off. ``on_news(self)`` is
    called on every change of the request, ``lost`` set when the worker died with it.
    """

    __slots__ = (
        "req", "cursor", "done", "lost", "exhausted", "_written", "_max_backlog", "_writes",
        "_on_news", "_on_behind",
    )

    def __init__(
        self,
        req: FrontRequest,
        cursor: int,
        max_backlog: int | None,
        writes: WriteClock,
        on_news: Callable[["Subscription"], None],
        on_behind: Callable[["Subscription"], None],
    ) -> None:
        self.req = req
        self.cursor = cursor
        self.done = False  # the final event was built
        self.lost = False
        self.exhausted = False
        self._written = cursor
        self._max_backlog = max_backlog
        self._writes = writes
        self._on_news = on_news
        self._on_behind = on_behind
        req.listen(self)

    def close(self) -> None:
        self.req.unlisten(self)

    def next_event(self) -> pb.Event | None:
        ev, self.cursor, self.done = build_event(self.req, self.cursor)
        return ev

    def advance(self) -> tuple[int, int]:
        """Take the cursor to the end of the log without building an event; returns the slice
        ``(start, end)`` of the log now to be written (the HTTP front builds its own chunks)."""
        start = self.cursor
        self.cursor = len(self.req.tokens)
        self.done = self.req.final is not None
        return start, self.cursor

    def written(self) -> None:
        self._written = self.cursor

    def request_changed(self, req: FrontRequest) -> None:
        bound = self._max_backlog
        if (
            bound is not None
            and not self.exhausted
            and req.final is None
            and len(req.tokens) - self._written > bound
            and self._writes.stalled()
        ):
            self.exhausted = True
            self._on_behind(self)
        self._on_news(self)

    def request_lost(self, req: FrontRequest) -> None:
        self.lost = True
        self._on_news(self)


def backlog_bound(front: "Front") -> int | None:
    bound = front.config.max_stream_backlog
    return bound if bound and bound > 0 else None


def backlog_error(bound: int) -> ServiceError:
    return resource_exhausted(
        f"the client fell more than {bound} tokens behind this stream; its request(s) were cancelled"
    )


def stream_fell_behind(front: "Front", rids: list[str], bound: int, behind: str = "") -> None:
    if not rids:
        log.warning(
            "stream reader more than %d tokens behind: ending the stream", bound,
            extra={"request_id": behind},
        )
    for rid in rids:
        log.warning(
            "stream reader more than %d tokens behind: cancelling", bound, extra={"request_id": rid}
        )
        front.cancel_nowait(rid)
    if front.metrics is not None:
        front.metrics.on_backlog_exceeded()
