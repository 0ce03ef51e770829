"""One StreamEvents call: submit, cancel and subscribe frames in; answers and coalesced events
out, in order, with bounded memory (a fixed number of frames in flight, cursors into the
front's request logs) and in-band errors for what concerns one request."""

from __future__ import annotations

import asyncio
import collections
from typing import AsyncIterator

import grpc

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.service.front import limits
from qil_worker.service.front.decoding import Undecodable
from qil_worker.service.errors import ServiceError, invalid, not_found, unavailable
from qil_worker.service.front.front import Front
from qil_worker.service.front.request_log import FrontRequest
from qil_worker.service.front.outsized_submit import OutsizedSubmit
from qil_worker.service.front.submit_spec import refuse_unfit, submit_to
from qil_worker.service.front.streams import (
    Subscription,
    WriteClock,
    backlog_bound,
    backlog_error,
    past_the_end,
    stream_fell_behind,
)


class StreamSession:
    """One StreamEvents call: frames in, events and answers out, bounded memory."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.max_backlog = backlog_bound(front)
        self.writes = WriteClock()  # one HTTP/2 stream: all subscriptions share its writes
        # keyed by the request object, not its id: a finished request and a new one that reuses
        # its id are different streams
        self.subs: dict[FrontRequest, Subscription] = {}
        self.dirty: dict[Subscription, None] = {}  # subscriptions with news, in arrival order
        self.control: collections.deque = collections.deque()  # futures of answers, in order
        self.slots = asyncio.Semaphore(limits.MAX_PENDING_FRAMES)
        self.wakeup = asyncio.Event()
        self.owned: set[FrontRequest] = set()  # submitted on this session
        self.half_closed = False
        self.fault: ServiceError | None = None
        self.tasks: set[asyncio.Task] = set()

    # callbacks of the subscriptions
    def _news(self, sub: Subscription) -> None:
        if sub.lost:
            self.fault = unavailable("worker process died")
        self.dirty[sub] = None
        self.wakeup.set()

    def _behind(self, sub: Subscription) -> None:
        if self.fault is None:
            # the client stopped reading: gRPC flow control holds our writes while the worker
            # goes on producing; end the stream and free the pages of the requests it
            # submitted (a request it only subscribed to belongs to someone else)
            bound = self.max_backlog
            assert bound is not None
            self.fault = backlog_error(bound)
            stream_fell_behind(self.front, self._live_owned(), bound, sub.req.rid)

    def _add_sub(self, req: FrontRequest, cursor: int) -> None:
        if req in self.subs:
            return
        sub = Subscription(req, cursor, self.max_backlog, self.writes, self._news, self._behind)
        self.subs[req] = sub
        self.dirty[sub] = None

    def _drop_sub(self, sub: Subscription) -> None:
        del self.subs[sub.req]
        self.owned.discard(sub.req)
        sub.close()

    def _live_owned(self) -> list[str]:
        """Ids of the unfinished requests this session submitted (safe to cancel by id)."""
        return sorted(r.rid for r in self.owned if r.final is None)

    async def read_frames(self, frames: AsyncIterator[pb.StreamEventsRequest]) -> None:
        try:
            async for frame in frames:
                if isinstance(frame, Undecodable):
                    # not a half-close: the session ends with INVALID_ARGUMENT, and close()
                    # cancels what it submitted
                    self.fault = invalid("frame", frame.describe())
                    return
                await self.slots.acquire()
                if isinstance(frame, OutsizedSubmit):
                    answer = self._answer_outsized(frame)
                else:
                    kind = frame.WhichOneof("frame")
                    answer = self._answer(kind, None if kind is None else getattr(frame, kind))
                task = asyncio.ensure_future(answer)
                self.tasks.add(task)
                task.add_done_callback(self._answered)
                self.control.append(task)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the stream broke; the handler ends with it
            pass
        finally:
            self.half_closed = True
            self.wakeup.set()

    def _answered(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.wakeup.set()

    async def _answer_outsized(self, frame: OutsizedSubmit):
        """``_answer`` of an outsized submit frame: refused from its prompt's size, or parsed
        whole and submitted (``outsized_submit``)."""
        try:
            refuse_unfit(self.front, frame)
        except ServiceError as err:
            return self._error(frame.request_id, err), None
        submit = frame.whole()
        if isinstance(submit, Undecodable):  # as a frame that did not parse: the session ends
            self.fault = invalid("frame", submit.describe())
            return None, None
        return await self._answer("submit", submit)

    async def _answer(self, kind: str | None, message):
        """``message``, the frame's ``kind`` → (response or None, action to run when the
        response is written, or None)."""
        front = self.front
        if kind == "submit":
            s = message
            try:
                req = await submit_to(front, s)
            except ServiceError as err:
                # in-band only, even UNAVAILABLE: a drain refuses new work but lets the session's
                # requests finish, and a dead worker reached their subscribers (worker_lost)
                return self._error(s.request_id, err), None
            self.owned.add(req)
            resp = pb.StreamEventsResponse(
                submitted=pb.SubmitResponse(request_id=req.rid, num_prompt_tokens=req.prompt_len)
            )
            return resp, (lambda: self._add_sub(req, 0))
        if kind == "cancel":
            results = await front.cancel(message.request_ids)
            resp = pb.CancelResponse(
                results=[pb.CancelResult(request_id=r, was_active=a) for r, a in results]
            )
            return pb.StreamEventsResponse(cancelled=resp), None
        if kind == "subscribe":
            sub = message
            req = front.find(sub.request_id)
            if req is None:
                return self._error(sub.request_id, not_found(sub.request_id)), None
            if req.final is not None and sub.from_seq > len(req.tokens):
                return self._error(sub.request_id, past_the_end(req, sub.from_seq)), None
            return None, (lambda: self._add_sub(req, sub.from_seq))
        err = invalid("frame", "empty StreamEventsRequest: set submit, cancel or subscribe")
        return self._error("", err), None

    @staticmethod
    def _error(rid: str, err: ServiceError) -> pb.StreamEventsResponse:
        return pb.StreamEventsResponse(
            error=pb.RequestError(
                request_id=rid, code=err.code.value[0], field=err.field or "", message=err.message
            )
        )

    async def responses(self, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StreamEventsResponse]:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.control and self.control[0].done():
                task = self.control.popleft()
                self.slots.release()
                resp, action = task.result()
                if resp is not None:
                    self.writes.started()
                    yield resp
                    self.writes.done()
                if action is not None:
                    action()
            if self.fault is not None:
                await self.fault.abort(context)
            while self.dirty:
                if self.fault is not None:
                    await self.fault.abort(context)
                sub = next(iter(self.dirty))
                del self.dirty[sub]
                if self.subs.get(sub.req) is not sub:
                    continue  # dropped meanwhile
                req = sub.req
                # (a request lost with the worker while subscribed faulted the session above;
                # subscribed later, it gets its tokens and the final ERROR event, like any end)
                if sub.cursor > len(req.tokens):
                    if req.final is None:
                        continue  # subscribed ahead of the output; wait for more
                    # it ended before reaching the cursor: as a subscription after its end
                    self._drop_sub(sub)
                    yield self._error(req.rid, past_the_end(req, sub.cursor))
                    continue
                ev = sub.next_event()
                if sub.done:
                    self._drop_sub(sub)
                if ev is not None:
                    self.writes.started()
                    yield pb.StreamEventsResponse(event=ev)
                    self.writes.done()
                    sub.written()
                    if sub.has_more and self.subs.get(req) is sub:
                        self.dirty[sub] = None  # the rest of a request of several samples
            if self.half_closed and not self.control and not self.subs:
                return

    def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for sub in self.subs.values():
            sub.close()
        for rid in self._live_owned():
            self.front.cancel_nowait(rid)
