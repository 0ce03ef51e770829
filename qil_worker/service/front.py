"""The front's view of requests and of the worker process (asyncio, torch-free).

``Front`` owns the worker process (spawn, restart with bounded backoff, stop), turns the worker's
per-step batches into per-request logs (``front_request``), and lets RPC handlers follow those logs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from qil_worker.errors import CapacityError
from qil_worker.service import limits
from qil_worker.service import protocol as P
from qil_worker.service.errors import (
    ServiceError,
    already_exists,
    classify_engine_error,
    from_worker_rejection,
    invalid,
    resource_exhausted,
    unavailable,
)
from qil_worker.service.front_request import Follower, Req, Retention
from qil_worker.service.worker_process import WorkerFailed, WorkerProcess, WorkerState

log = logging.getLogger("qil.front")

CANCELLED_CODE = P.FINISH_CODES["cancelled"]
ERROR_CODE = P.FINISH_CODES["error"]
WORKER_DIED = "worker process died"


@dataclass
class FrontConfig:
    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    threads: int | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    # KV pool from a byte budget or a fraction of free device memory instead of engine["num_pages"]
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float | None = None
    # None: the model directory's tokenizer when it has one; a path: that tokenizer
    tokenizer: str | None = None
    use_tokenizer: bool = True
    max_queued: int = 1024
    max_restarts: int = 5
    restart_backoff_s: float = 0.5
    stable_after_s: float = 30.0
    start_timeout_s: float = 900.0
    retain_finished: int = limits.RETAIN_FINISHED
    retain_seconds: float = limits.RETAIN_SECONDS
    retain_tokens: int = limits.RETAIN_TOKENS
    log_level: str = "INFO"
    log_format: str = "text"  # or "json" (the worker logs in the same format)
    # A streaming call (Generate, StreamEvents) whose reader leaves more than this many produced
    # tokens unwritten is ended with RESOURCE_EXHAUSTED and its requests are cancelled.
    max_stream_backlog: int = limits.MAX_STREAM_BACKLOG


class Front:
    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self.requests: dict[str, Req] = {}
        self._retained = Retention(config.retain_finished, config.retain_tokens, config.retain_seconds)
        self._acks: dict[str, asyncio.Future] = {}
        self._tickets: dict[int, asyncio.Future] = {}
        self._next_ticket = 0
        self.num_unfinished = 0
        self.num_requests_total = 0
        self.stats: tuple = P.EMPTY_STATS
        self.info: dict[str, Any] = {}
        self.state = WorkerState.STARTING
        self.restarts = 0
        self._failures = 0  # worker deaths in a row (reset by a worker that ran stable_after_s)
        self._gen = 0
        self._worker: WorkerProcess | None = None
        self._ready_fut: asyncio.Future | None = None
        self._draining = False
        self._stopping = False
        self._idle = asyncio.Event()
        self._restart_task: asyncio.Task | None = None
        self.on_state_change: Callable[[WorkerState], Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.metrics: Any = None  # a metrics.Metrics when --metrics-port is given

    # ---------------------------------------------------------------- worker lifecycle

    @property
    def max_unfinished(self) -> int:
        return int(self.config.engine.get("max_active", 64)) + self.config.max_queued

    @property
    def worker_pid(self) -> int:
        return self._worker.pid if self._worker is not None else 0

    @property
    def draining(self) -> bool:
        """Shutting down: no new requests; the worker will not be restarted."""
        return self._draining

    def _set_state(self, state: WorkerState) -> None:
        if state != self.state:
            self.state = state
            if self.on_state_change is not None:
                self.on_state_change(state)

    async def start(self) -> None:
        """Start the first worker and wait until it is loaded and warm (or raise WorkerFailed)."""
        self._loop = asyncio.get_running_loop()
        await self._spawn()

    async def _spawn(self) -> None:
        loop = self._loop
        assert loop is not None
        self._gen += 1
        wcfg = {
            "model": self.config.model,
            "device": self.config.device,
            "dtype": self.config.dtype,
            "threads": self.config.threads,
            "engine": dict(self.config.engine),
            "kv_memory_bytes": self.config.kv_memory_bytes,
            "kv_memory_fraction": self.config.kv_memory_fraction,
            "tokenizer": self.config.tokenizer,
            "use_tokenizer": self.config.use_tokenizer,
            "log_level": self.config.log_level,
            "log_format": self.config.log_format,
        }

        def deliver(gen: int, msg: Any) -> None:
            try:
                loop.call_soon_threadsafe(self._on_message, gen, msg)
            except RuntimeError:  # loop closed
                pass

        self._ready_fut = loop.create_future()
        worker = WorkerProcess.spawn(self._gen, wcfg, deliver)
        self._worker = worker
        log.info("worker %d started (pid %d)", worker.gen, worker.pid)
        try:
            try:
                info = await asyncio.wait_for(asyncio.shield(self._ready_fut), self.config.start_timeout_s)
            except asyncio.TimeoutError:
                raise WorkerFailed("worker did not become ready in time") from None
        except BaseException as exc:
            # A failed start is over here: its late EOF must not count as another death (nor
            # start another restart loop), and its pipe, thread and process are released now.
            self._worker = None
            if isinstance(exc, asyncio.CancelledError):  # the server stops while the model loads
                self._stopping = True  # nothing to drain, no restart
                self._ready_fut.cancel()  # nobody awaits it any more (else its error goes unread)
            worker.kill()
            loop.run_in_executor(None, worker.reap, 5.0)
            raise
        worker.info = info
        worker.mark_ready()
        self.info = info
        self.stats = tuple(info.get("stats", self.stats))
        self._set_state(WorkerState.READY)
        log.info(
            "worker ready (pid %d): model %s%s, dtype %s, device %s; %s; memory: %s; tokenizer: %s; "
            "prefix cache: %s",
            worker.pid, info.get("name"), " [DEMO: random weights]" if info.get("demo") else "",
            info.get("dtype", "?"), info.get("device", "?"), info.get("kv_pool", "KV pool: ?"),
            info.get("memory", "?"), info.get("tokenizer") or "none (token ids only)",
            "on" if info.get("prefix_cache") else "off",
        )

    def _on_message(self, gen: int, msg: Any) -> None:
        worker = self._worker
        if worker is None or gen != worker.gen:
            return  # a message from a previous worker
        if msg is None:
            self._on_worker_gone(worker)
            return
        tag = msg[0]
        if tag == P.BATCH:
            self._on_batch(msg[1], msg[2], msg[3], msg[4], msg[5] if len(msg) > 5 else None)
        elif tag == P.READY:
            if self._ready_fut is not None and not self._ready_fut.done():
                self._ready_fut.set_result(msg[1])
        elif tag == P.FATAL:
            if self._ready_fut is not None and not self._ready_fut.done():
                self._ready_fut.set_exception(WorkerFailed(msg[1]))

    def _on_worker_gone(self, worker: WorkerProcess) -> None:
        worker.close_outbox()
        if self._ready_fut is not None and not self._ready_fut.done():
            self._ready_fut.set_exception(WorkerFailed("worker process exited while starting"))
            return
        if self._stopping:
            return
        log.error("worker process (pid %d) died; failing %d request(s)", worker.pid, self.num_unfinished)
        # State first (health NOT_SERVING), then the in-flight calls end with UNAVAILABLE.
        self._set_state(WorkerState.STOPPING if self._draining else WorkerState.RESTARTING)
        self._fail_in_flight()
        if self._draining:
            return
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.ensure_future(self._restart(worker))

    def _fail_in_flight(self) -> None:
        err = unavailable(WORKER_DIED)
        for fut in list(self._acks.values()):
            if not fut.done():
                fut.set_exception(err)
        self._acks.clear()
        for fut in self._tickets.values():
            if not fut.done():
                fut.set_exception(err)
        self._tickets.clear()
        for req in list(self.requests.values()):
            if req.final is None:
                req.lost = True
                req.final = (ERROR_CODE, WORKER_DIED, None)
                self._finished(req)
                for listener in list(req.listeners):
                    listener.worker_lost(req)
        total = self.stats[0]
        self.stats = (total, 0, total, 0, 0, 0, *self.stats[6:])
        if self.metrics is not None:
            self.metrics.on_stats(self.stats, self.num_unfinished)

    async def _restart(self, dead: WorkerProcess) -> None:
        loop = asyncio.get_running_loop()
        exitcode = await loop.run_in_executor(None, dead.reap, 5.0)
        log.warning("worker exit code: %s", exitcode)
        if dead.stable_for(self.config.stable_after_s):
            self._failures = 0
        while not self._draining:
            self._failures += 1
            if self._failures > self.config.max_restarts:
                log.error("worker died %d times in a row; giving up", self._failures)
                self._set_state(WorkerState.FAILED)
                return
            delay = min(self.config.restart_backoff_s * 2 ** (self._failures - 1), 30.0)
            log.warning("restarting worker in %.1fs (attempt %d)", delay, self._failures)
            await asyncio.sleep(delay)
            if self._draining:
                return
            try:
                self.restarts += 1
                if self.metrics is not None:
                    self.metrics.on_restart()
                await self._spawn()
                return
            except WorkerFailed as exc:
                log.error("worker restart failed: %s", exc)
                self._set_state(WorkerState.RESTARTING)

    # ---------------------------------------------------------------- batches from the worker

    def _on_batch(
        self, acks: list, events: list, stats: tuple, tickets: list, step: tuple | None = None
    ) -> None:
        for rid, err, num_prompt_tokens in acks:
            req = self.requests.get(rid)
            if req is not None and req.final is None:
                if err is None:
                    req.prompt_len = num_prompt_tokens  # known once the worker encoded the prompt
                else:  # here, not in ``submit``: its caller may be gone already
                    self._reject(req, err)
            fut = self._acks.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result((err, num_prompt_tokens))
        touched: dict[str, Req] = {}
        for rid, token, _index, code, error, final, text, logprob, top in events:
            req = self.requests.get(rid)
            if req is None or req.final is not None:
                continue
            req.add(token, text, logprob, top)
            if code:
                req.final = (code, error, final)
                self._finished(req)
            touched[rid] = req
        for req in touched.values():
            for listener in list(req.listeners):
                listener.wake(req)
        self.stats = tuple(stats)
        if self.metrics is not None:
            self.metrics.on_step(step)
            self.metrics.on_stats(self.stats, self.num_unfinished)
        for ticket in tickets:
            fut = self._tickets.pop(ticket, None)
            if fut is not None and not fut.done():
                fut.set_result(self.stats)

    def _reject(self, req: Req, err: tuple) -> None:
        """The worker refused a submit: forget the request (its id is free again), end it for
        whoever subscribed or waits to cancel it meanwhile, and count it out."""
        del self.requests[req.rid]
        req.final = (ERROR_CODE, err[2], None)
        self._count_out()
        for listener in list(req.listeners):
            listener.wake(req)

    def _count_out(self) -> None:
        """One request fewer is unfinished."""
        self.num_unfinished -= 1
        if self.num_unfinished <= 0:
            self.num_unfinished = 0
            self._idle.set()

    def _finished(self, req: Req) -> None:
        self._report_finished(req)
        self._count_out()
        self._forget_finished(self._retained.keep(req))

    def _forget_finished(self, rids: list[str]) -> None:
        for rid in rids:
            old = self.requests.get(rid)
            if old is not None and old.final is not None:
                del self.requests[rid]

    def find(self, rid: str) -> Req | None:
        """A live or retained request for a subscriber (age is enforced here too: an idle
        server finishes nothing that would prune the old ones)."""
        self._forget_finished(self._retained.expired())
        return self.requests.get(rid)

    def _report_finished(self, req: Req) -> None:
        """One INFO line per finished request, and its metrics."""
        assert req.final is not None
        code, error, record = req.final
        reason = P.FINISH_NAMES.get(code, "error")
        n_out = len(req.tokens)
        fields: dict[str, Any] = {
            "reason": reason, "prompt_tokens": req.prompt_len, "output_tokens": n_out,
        }
        timing = ""
        if record is not None:
            queue, ttft, mean_itl, max_itl, e2e, preempt = record[2:8]
            for name, value in (("queue_s", queue), ("ttft_s", ttft), ("mean_itl_s", mean_itl),
                                ("max_itl_s", max_itl), ("e2e_s", e2e)):
                fields[name] = round(value, 6) if value >= 0 else None
            fields["preemptions"] = preempt
            fields["cached_tokens"] = record[8] if len(record) > 8 else 0
            timing = " ttft=%s itl=%s e2e=%s" % tuple(
                "-" if fields[k] is None else f"{fields[k] * 1000:.1f}ms"
                for k in ("ttft_s", "mean_itl_s", "e2e_s")
            )
        if error:
            fields["error"] = error
        log.info(
            "finished: reason=%s tokens_in=%d tokens_out=%d%s%s", reason, req.prompt_len, n_out,
            timing, f" error={error!r}" if error else "",
            extra={"request_id": req.rid, "fields": fields},
        )
        if self.metrics is not None:
            try:
                self.metrics.on_finished(reason, req.prompt_len, n_out, record)
            except Exception:  # noqa: BLE001 - metrics never break serving
                log.exception("metrics update failed")

    # ---------------------------------------------------------------- operations for handlers

    def _send(self, msg: tuple) -> None:
        if self._worker is not None:
            self._worker.send(msg)

    def check_accepting(self) -> None:
        if self._draining:
            raise unavailable("server is shutting down")
        if self.state != WorkerState.READY:
            raise unavailable(f"worker is {self.state.name.lower()}")

    async def submit(
        self,
        request_id: str,
        token_ids: Iterable[int] | None,
        max_new_tokens: int,
        stop_token_ids: Iterable[int] = (),
        options: dict[str, Any] | None = None,
    ) -> Req:
        """Queue a request in the worker; returns once the engine accepted it.

        ``token_ids`` None: the prompt is ``options["text"]`` or ``options["messages"]``;
        ``options``: further ``Engine.submit`` keyword arguments (see ``requests.submit_args``).
        """
        if len(request_id) > limits.MAX_REQUEST_ID_LENGTH:
            raise invalid(
                "request_id", f"at most {limits.MAX_REQUEST_ID_LENGTH} characters, got {len(request_id)}"
            )
        if not request_id.isprintable():  # ids go into log lines: no line breaks or controls
            raise invalid("request_id", f"printable characters only, got {request_id!r}")
        self.check_accepting()
        rid = request_id or uuid.uuid4().hex
        existing = self.requests.get(rid)
        if existing is not None and existing.final is None:
            raise already_exists(rid)
        if self.num_unfinished >= self.max_unfinished:
            raise resource_exhausted(
                f"{self.num_unfinished} unfinished requests; the server admits {self.max_unfinished}"
            )
        tokens = None if token_ids is None else list(token_ids)
        max_positions = self.info.get("max_position_embeddings")
        if tokens is not None and max_positions and len(tokens) + max_new_tokens > max_positions:
            # refused here as the engine would: millions of ids cost the worker seconds to receive
            too_long = CapacityError.positions(len(tokens), max_new_tokens, max_positions)
            raise from_worker_rejection(*classify_engine_error(too_long))
        req = Req(rid, len(tokens or ()))
        self._retained.forget(rid)
        self.requests[rid] = req
        self.num_unfinished += 1
        self._idle.clear()
        fut = asyncio.get_running_loop().create_future()
        self._acks[rid] = fut
        self._send((P.SUBMIT, rid, tokens, int(max_new_tokens), list(stop_token_ids), dict(options or {})))
        try:
            err, num_prompt_tokens = await fut
        except asyncio.CancelledError:
            self._send((P.CANCEL, rid))  # the caller is gone; the request must not run on
            raise
        except ServiceError:
            if self.requests.get(rid) is req:
                del self.requests[rid]
                self._retained.forget(rid)
            raise
        if err is not None:  # ``_on_batch`` has forgotten the request
            raise from_worker_rejection(*err)
        req.prompt_len = num_prompt_tokens
        self.num_requests_total += 1
        log.debug(
            "submitted: tokens_in=%d max_new_tokens=%d", num_prompt_tokens, max_new_tokens,
            extra={"request_id": rid},
        )
        return req

    def cancel_nowait(self, rid: str) -> bool:
        req = self.requests.get(rid)
        if req is None or req.final is not None:
            return False
        self._send((P.CANCEL, rid))
        return True

    async def cancel(self, request_ids: Iterable[str], timeout: float = 5.0) -> list[tuple[str, bool]]:
        """Cancel requests and wait until they are over (their pages are then free).

        Per id: True when the request was still active and ended cancelled. An id given twice
        counts once.
        """
        ids = list(request_ids)
        sent: dict[str, Req] = {}
        for rid in ids:
            req = self.requests.get(rid)
            if rid not in sent and req is not None and self.cancel_nowait(rid):
                sent[rid] = req
        if sent:
            follower = Follower()
            for req in sent.values():
                req.listeners.add(follower)
            deadline = time.monotonic() + timeout
            try:
                while any(r.final is None for r in sent.values()) and time.monotonic() < deadline:
                    await follower.wait(max(0.0, deadline - time.monotonic()))
            finally:
                for req in sent.values():
                    req.listeners.discard(follower)
        result = []
        for rid in ids:
            req = sent.get(rid)  # (an id given twice gets the same answer twice)
            active = req is not None and (
                req.final is None or req.final[0] == CANCELLED_CODE or req.lost
            )
            result.append((rid, active))
        return result

    async def fresh_stats(self, timeout: float = 2.0) -> tuple:
        """Page pool and queue numbers straight from the worker (cached ones if it is busy)."""
        if self.state != WorkerState.READY or self._worker is None:
            return self.stats
        self._next_ticket += 1
        ticket = self._next_ticket
        fut = asyncio.get_running_loop().create_future()
        self._tickets[ticket] = fut
        self._send((P.STATS, ticket))
        try:
            return await asyncio.wait_for(fut, timeout)
        except (asyncio.TimeoutError, ServiceError):
            self._tickets.pop(ticket, None)
            return self.stats

    # ---------------------------------------------------------------- shutdown

    async def drain(self, grace_s: float) -> int:
        """Stop accepting, let running requests finish for ``grace_s``, then cancel the rest."""
        self._draining = True
        if self.num_unfinished:
            log.info("draining %d request(s) for up to %.1fs", self.num_unfinished, grace_s)
            try:
                await asyncio.wait_for(self._idle.wait(), grace_s)
            except asyncio.TimeoutError:
                pass
        left = [rid for rid, r in self.requests.items() if r.final is None]
        if left:
            log.info("cancelling %d request(s) after the grace period", len(left))
            await self.cancel(left, timeout=3.0)
        return len(left)

    async def stop_worker(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._set_state(WorkerState.STOPPING)
        if self._restart_task is not None:
            self._restart_task.cancel()
        if self._worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._worker.stop, timeout)
