"""What the streaming calls (Generate, StreamEvents) share: a ``Subscription`` to a request's log,
which builds the event that takes its reader from its cursor to the end of the log and owns the
rule on how far a reader may fall behind."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.service.front import limits
from qil_worker.service.front.assistant_events import add_deltas, add_whole
from qil_worker.service.errors import ServiceError, invalid, resource_exhausted
from qil_worker.service.front.request_log import FrontRequest, SampleEnd
from qil_worker.service.protocol import RequestTimings

if TYPE_CHECKING:
    from qil_worker.service.front.front import Front

log = logging.getLogger("qil.server")


def request_metrics(metrics: RequestTimings) -> pb.RequestMetrics:
    return pb.RequestMetrics(
        queue_time_s=metrics.queue_time_s or 0.0,
        ttft_s=metrics.ttft_s or 0.0,
        mean_itl_s=metrics.mean_itl_s or 0.0,
        max_itl_s=metrics.max_itl_s or 0.0,
        e2e_s=metrics.e2e_s or 0.0,
        num_preemptions=metrics.num_preemptions,
    )


def build_event(req: FrontRequest, cursor: int) -> tuple[pb.Event | None, int, bool]:
    """The event that takes a new reader from ``cursor`` towards the end of ``req``'s log.

    Returns ``(event or None, new cursor, done)``. All tokens produced since the cursor go into
    one event (of one sample: see ``next_event``): that is the coalescing for readers slower
    than the worker.
    """
    ev, cursor, _, done = next_event(req, cursor, ends_before(req, cursor))
    return ev, cursor, done


def ends_before(req: FrontRequest, cursor: int) -> int:
    """How many sample ends a reader starting at ``cursor`` has seen: those before it."""
    return sum(1 for end in req.ends if end.position < cursor)


def next_event(req: FrontRequest, cursor: int, ends_seen: int) -> tuple[pb.Event | None, int, int, bool]:
    """The next event of a reader at ``cursor`` that has seen ``ends_seen`` of ``req.ends``:
    every token since the cursor up to the next token of another sample or the next sample end,
    and that end when it is this sample's. Returns ``(event or None, cursor, ends_seen, done)``.
    """
    n = len(req.tokens)
    ends = req.ends
    while ends_seen < len(ends) and ends[ends_seen].position < cursor:
        ends_seen += 1  # (a reader that subscribed ahead of the output: ended before its from_seq)
    end = ends[ends_seen] if ends_seen < len(ends) else None
    if end is not None and end.position <= cursor:  # an end with no token of its own left
        ev = pb.Event(request_id=req.rid, seq=cursor, sample_index=end.sample)
        if req.texts is not None:
            ev.text = end.text
        if req.parts is not None:
            add_deltas(ev, end.parts)
        return ev, cursor, ends_seen + 1, _close(ev, req, end, ends_seen + 1)
    if cursor >= n:
        return None, cursor, ends_seen, False
    stop = n if end is None else end.position
    sample = 0
    if req.samples is not None:
        samples = req.samples
        sample = samples[cursor]
        stop = next((i for i in range(cursor + 1, stop) if samples[i] != sample), stop)
    ev = pb.Event(request_id=req.rid, seq=cursor, token_ids=req.tokens[cursor:stop], sample_index=sample)
    closes = end is not None and end.position == stop and end.sample == sample
    if req.texts is not None:
        ev.text = "".join(req.texts[cursor:stop]) + (end.text if closes else "")
    if req.parts is not None:
        add_deltas(ev, [p for parts in req.parts[cursor:stop] for p in parts] + list(end.parts if closes else ()))
    if req.logprobs is not None:
        ev.logprobs.extend(req.logprobs[cursor:stop])
    if req.top is not None:
        for top in req.top[cursor:stop]:
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
    if not closes:
        return ev, stop, ends_seen, False
    return ev, stop, ends_seen + 1, _close(ev, req, end, ends_seen + 1)


def _close(ev: pb.Event, req: FrontRequest, end: SampleEnd, ends_seen: int) -> bool:
    """Make ``ev`` the final event of ``end``'s sample; True when it ends the request too."""
    final = end.record
    done = req.final is not None and ends_seen == len(req.ends)
    if req.parts is not None:
        add_whole(ev, req, end)
    ev.sample_finished = True
    ev.finished = done
    ev.finish_reason = final.reason.number
    if final.error:
        ev.error = final.error
    ev.num_prompt_tokens = req.prompt_len
    ev.num_output_tokens = final.num_output_tokens
    if final.metrics is not None:
        ev.metrics.CopyFrom(request_metrics(final.metrics))
    ev.num_cached_tokens = final.num_cached_tokens
    stop = final.stop_reason
    if isinstance(stop, str):
        ev.stop_string = stop
    elif stop is not None:
        ev.stop_token_id = stop
    return done


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
        "req", "cursor", "ends_seen", "done", "lost", "exhausted", "_written", "_max_backlog",
        "_writes", "_on_news", "_on_behind",
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
        self.ends_seen = ends_before(req, cursor)  # sample ends already built (``next_event``)
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
        ev, self.cursor, self.ends_seen, self.done = next_event(self.req, self.cursor, self.ends_seen)
        return ev

    def advance(self) -> tuple[int, int]:
        """Take the cursor to the end of the log without building an event; returns the slice
        ``(start, end)`` of the log now to be written (the HTTP front builds its own chunks,
        one request per sample)."""
        start = self.cursor
        self.cursor = len(self.req.tokens)
        self.ends_seen = len(self.req.ends)
        self.done = self.req.final is not None
        return start, self.cursor

    @property
    def has_more(self) -> bool:
        """Whether ``next_event`` has an event to build now (with several samples, one event
        may leave more: the next sample's tokens, or an end)."""
        return self.cursor < len(self.req.tokens) or self.ends_seen < len(self.req.ends)

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

