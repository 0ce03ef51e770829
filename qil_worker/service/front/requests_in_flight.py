"""The front's table of requests: those sent to the worker and not over, the submits waiting for
their ack, and finished ones retained for late subscribers. The worker's batches are applied
here; each request then tells its own listeners.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable, Iterable

from qil_worker.service import protocol as P
from qil_worker.service.errors import unavailable
from qil_worker.service.front.request_log import FrontRequest, Retention


class _EndWaiter:
    """Wakes a coroutine whenever one of the requests it waits for changes."""

    def __init__(self) -> None:
        self.news = asyncio.Event()

    def request_changed(self, req: FrontRequest) -> None:
        self.news.set()

    def request_lost(self, req: FrontRequest) -> None:
        self.news.set()


class RequestsInFlight:
    def __init__(self, retention: Retention, on_finished: Callable[[FrontRequest], None]) -> None:
        self._requests: dict[str, FrontRequest] = {}
        self._acks: dict[str, asyncio.Future[P.Ack]] = {}
        self._retained = retention
        self._on_finished = on_finished  # a finished request's log line and metrics
        self.num_unfinished = 0
        self._idle = asyncio.Event()

    def live(self, rid: str) -> FrontRequest | None:
        """The unfinished request of that id, if any."""
        req = self._requests.get(rid)
        return req if req is not None and req.final is None else None

    def find(self, rid: str) -> FrontRequest | None:
        """A live or retained request for a subscriber (age is enforced here too: an idle
        server finishes nothing that would prune the old ones)."""
        self._forget(self._retained.expired())
        return self._requests.get(rid)

    def unfinished_ids(self) -> list[str]:
        return [rid for rid, req in self._requests.items() if req.final is None]

    def add(self, rid: str, prompt_len: int, n: int = 1) -> tuple[FrontRequest, asyncio.Future[P.Ack]]:
        """A submit (of ``n`` samples) about to be sent: its request (replacing a finished one of
        that id) and the future of its ack."""
        req = FrontRequest(rid, prompt_len, n)
        self._retained.forget(rid)
        self._requests[rid] = req
        self.num_unfinished += 1
        self._idle.clear()
        ack = asyncio.get_running_loop().create_future()
        self._acks[rid] = ack
        return req, ack

    def withdraw(self, req: FrontRequest) -> None:
        """Forget a submit that never got its ack (the worker died meanwhile)."""
        if self._requests.get(req.rid) is req:
            del self._requests[req.rid]
            self._retained.forget(req.rid)

    def apply(self, batch: P.StepBatch) -> None:
        """One batch of the worker: answer the acks, extend the logs, end what ended."""
        for ack in batch.acks:
            req = self.live(ack.request_id)
            if req is not None:
                if ack.rejection is None:
                    req.accepted(ack.num_prompt_tokens)
                else:  # here, not in the submit: its caller may be gone already
                    self._reject(req, ack.rejection)
            fut = self._acks.pop(ack.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(ack)
        finals = batch.finals
        requests = self._requests
        for rid, cached in batch.cached.items():  # (before the events: a listener may read it)
            req = requests.get(rid)
            if req is not None:
                req.cached_tokens = cached
        for rid, scored in batch.prompt_logprobs.items():  # before the token that carries them
            req = requests.get(rid)
            if req is not None:
                req.prompt_logprobs = scored
        samples = batch.samples or itertools.repeat(0)
        for rid, token, text, logprob, top, sample in zip(
            batch.request_ids, batch.token_ids, batch.texts, batch.logprobs, batch.top_logprobs, samples
        ):
            req = requests.get(rid)
            if req is None or req.final is not None:
                continue
            final = finals.get((rid, sample) if sample else rid) if finals else None
            req.append(token, text, logprob, top, final, sample)
            if req.final is not None:  # its last sample ended: the request did
                self._finished(req)

    def lose_all(self, error: str) -> None:
        """The worker died: every unanswered submit and every unfinished request ends."""
        err = unavailable(error)
        for fut in self._acks.values():
            if not fut.done():
                fut.set_exception(err)
        self._acks.clear()
        for req in list(self._requests.values()):
            if req.final is None:
                req.lose(error)
                self._finished(req)

    async def wait_idle(self, timeout: float) -> None:
        """Until no request is unfinished, or ``timeout``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def wait_ended(self, reqs: Iterable[FrontRequest], timeout: float) -> None:
        """Until all of ``reqs`` are over, or ``timeout``."""
        reqs = list(reqs)
        waiter = _EndWaiter()
        for req in reqs:
            req.listen(waiter)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while any(r.final is None for r in reqs) and loop.time() < deadline:
                try:
                    await asyncio.wait_for(waiter.news.wait(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    pass
                waiter.news.clear()
        finally:
            for req in reqs:
                req.unlisten(waiter)

    def _reject(self, req: FrontRequest, rejection: P.Rejection) -> None:
        """The worker refused a submit: forget the request (its id is free again), end it for
        whoever subscribed or waits to cancel it meanwhile, and count it out."""
        del self._requests[req.rid]
        req.fail(rejection.message)
        self._count_out()

    def _finished(self, req: FrontRequest) -> None:
        self._on_finished(req)
        self._count_out()
        self._forget(self._retained.keep(req))

    def _count_out(self) -> None:
        self.num_unfinished -= 1
        if self.num_unfinished <= 0:
            self.num_unfinished = 0
            self._idle.set()

    def _forget(self, rids: list[str]) -> None:
        for rid in rids:
            old = self._requests.get(rid)
            if old is not None and old.final is not None:
                del self._requests[rid]
