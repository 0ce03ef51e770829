"""The requests of one HTTP call (its prompts x ``n``), submitted together and followed
together through ``streams.Subscription`` (the gRPC streams' reader of a request's log, with
its backlog bound), and cancelled when the call ends early (a client gone mid-stream)."""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import grpc

from qil_worker.engine.spec import RequestSpec  # torch-free
from qil_worker.errors import InvalidRequestError
from qil_worker.service.errors import ServiceError, invalid_from, unavailable
from qil_worker.service.front.front import Front
from qil_worker.service.front.request_log import FrontRequest, SampleEnd
from qil_worker.service.front.http.params import CallParams
from qil_worker.service.protocol import FinishReason
from qil_worker.service.front.streams import (
    Subscription,
    WriteClock,
    backlog_bound,
    backlog_error,
    stream_fell_behind,
)

log = logging.getLogger("qil.http")


def specs_of(params: CallParams) -> list[RequestSpec]:
    """The spec of each prompt's request, its ``n`` samples in it; ``ServiceError`` naming the
    engine's field at fault (the caller maps it to the API's parameter)."""
    specs = []
    for prompt in params.prompts:
        options = dict(params.options, n=params.n) if params.n > 1 else params.options
        try:
            specs.append(RequestSpec.of(
                prompt.token_ids, params.max_new_tokens, params.stop_token_ids,
                text=prompt.text, messages=prompt.messages, **options,
            ))
        except InvalidRequestError as exc:
            raise invalid_from(exc) from None
    return specs


async def submit_all(front: Front, params: CallParams, call_id: str) -> list[FrontRequest]:
    """One request per prompt, its ``n`` samples in it (the engine computes the prompt once and
    forks; choice ``p * n + j`` is sample ``j`` of prompt ``p``, the API's order). All or none:
    when one is refused the others are cancelled and the refusal raised."""
    jobs = [front.submit(f"{call_id}-{p}", spec) for p, spec in enumerate(specs_of(params))]
    if len(jobs) == 1:  # (the common call: no task for it)
        return [await jobs[0]]
    results = await asyncio.gather(*jobs, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if isinstance(r, FrontRequest):
                front.cancel_nowait(r.rid)
        raise failed[0]
    return results  # type: ignore[return-value]


def request_failure(req: FrontRequest, ends: list[SampleEnd] | None = None) -> ServiceError | None:
    """The error a request (or one of ``ends``) ended with (None: it did not)."""
    failed = [e.record for e in (req.ends if ends is None else ends) if e.record.reason is FinishReason.ERROR]
    if not failed:
        return None
    final = failed[0]
    if req.lost:
        return unavailable(final.error or "worker process died")
    return ServiceError(grpc.StatusCode.INTERNAL, final.error or "the request failed")


class Choices:
    """Followers of the requests of one call; ``updates()`` yields ``(request, start, end,
    ends)`` as they produce, ``close()`` cancels the ones not over."""

    def __init__(self, front: Front, reqs: list[FrontRequest]) -> None:
        self.front = front
        self.reqs = reqs
        self.writes = WriteClock()  # one HTTP response: all choices share its writes
        self._bound = backlog_bound(front)
        self._news = asyncio.Event()
        self._dirty: dict[int, None] = {}
        self._fault: ServiceError | None = None
        self._ends_seen = [0] * len(reqs)
        self.subs = [
            Subscription(req, 0, self._bound, self.writes, self._on_news(i), self._behind)
            for i, req in enumerate(reqs)
        ]
        for i in range(len(reqs)):
            self._dirty[i] = None

    def _on_news(self, index: int):
        def news(sub: Subscription) -> None:
            if sub.lost and self._fault is None:
                self._fault = unavailable("worker process died")
            self._dirty[index] = None
            self._news.set()

        return news

    def _behind(self, sub: Subscription) -> None:
        if self._fault is None:
            assert self._bound is not None
            self._fault = backlog_error(self._bound)
            stream_fell_behind(self.front, [r.rid for r in self.reqs if r.final is None], self._bound)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.subs)

    async def updates(self) -> AsyncIterator[tuple[int, int, int, list[SampleEnd]]]:
        """``(request, start, end, ends)``: log positions ``start:end`` of that request are new,
        and so are the sample ``ends``; ServiceError when the worker died or the reader fell
        behind."""
        while True:
            if self._fault is not None:
                raise self._fault
            while self._dirty:
                index = next(iter(self._dirty))
                del self._dirty[index]
                sub = self.subs[index]
                if sub.done:
                    continue
                start, end = sub.advance()
                ends = sub.req.ends[self._ends_seen[index]:]
                self._ends_seen[index] += len(ends)
                if end > start or ends:
                    yield index, start, end, ends
                    sub.written()
                if self._fault is not None:
                    raise self._fault
            if self.done:
                return
            await self._news.wait()
            self._news.clear()

    async def wait(self) -> None:
        """Until every request is over (non-streaming calls)."""
        async for _ in self.updates():
            pass

    def close(self) -> None:
        for sub in self.subs:
            sub.close()
        for req in self.reqs:
            if req.final is None and self.front.cancel_nowait(req.rid):
                log.info("HTTP call ended early: cancelling", extra={"request_id": req.rid})
