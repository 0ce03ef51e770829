"""The gRPC front: ``qil.v1.Inference`` servicer, health, reflection, auth, TLS, shutdown.

Runs on grpc.aio in the front process, which never imports torch: the model lives in the worker
process (see ``front`` and ``worker``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from grpc_reflection.v1alpha import reflection

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from qil_worker.service import limits
from qil_worker.service.auth import BearerTokenInterceptor
from qil_worker.service.decoding import Undecodable, add_servicer
from qil_worker.service.errors import (
    ServiceError,
    invalid,
    not_found,
    resource_exhausted,
    unavailable,
)
from qil_worker.service.front import Follower, Front, FrontConfig, Req, WorkerFailed, WorkerState
from qil_worker.service.health import SERVICE_NAME, Health
from qil_worker.service.heap import freeze_startup_heap
from qil_worker.service.requests import submit_args

log = logging.getLogger("qil.server")

SERVER_VERSION = "0.1.0"


def _metrics(final: tuple | None) -> pb.RequestMetrics | None:
    if final is None:
        return None
    queue, ttft, mean_itl, max_itl, e2e, preempt = final[2:8]
    return pb.RequestMetrics(
        queue_time_s=max(queue, 0.0),
        ttft_s=max(ttft, 0.0),
        mean_itl_s=max(mean_itl, 0.0),
        max_itl_s=max(max_itl, 0.0),
        e2e_s=max(e2e, 0.0),
        num_preemptions=preempt,
    )


def build_event(req: Req, cursor: int) -> tuple[pb.Event | None, int, bool]:
    """The event that takes a follower from ``cursor`` to the end of ``req``'s log.

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
    if final is not None:
        code, error, record = final
        ev.finished = True
        ev.finish_reason = code
        if error:
            ev.error = error
        ev.num_prompt_tokens = req.prompt_len
        ev.num_output_tokens = n
        metrics = _metrics(record)
        if metrics is not None:
            ev.metrics.CopyFrom(metrics)
        if record is not None and len(record) >= 10:
            ev.num_cached_tokens = record[8]
            stop = record[9]
            if isinstance(stop, str):
                ev.stop_string = stop
            elif stop is not None:
                ev.stop_token_id = stop
    return ev, n, final is not None


def _past_the_end(req: Req, from_seq: int) -> ServiceError:
    return invalid("from_seq", f"{from_seq} is past the end ({len(req.tokens)})")


async def _reject_undecodable(request: object, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await invalid("request", request.describe()).abort(context)


async def _submit(front: Front, request: pb.SubmitRequest) -> Req:
    args = submit_args(request)
    return await front.submit(
        args.request_id, args.token_ids, args.max_new_tokens, args.stop_token_ids, args.options
    )


def _backlog_bound(front: Front) -> int | None:
    bound = front.config.max_stream_backlog
    return bound if bound and bound > 0 else None


def _backlog_error(bound: int) -> ServiceError:
    return resource_exhausted(
        f"the client fell more than {bound} tokens behind this stream; its request(s) were cancelled"
    )


def _stream_fell_behind(front: Front, rids: list[str], bound: int, behind: str = "") -> None:
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


class _Session:
    """One StreamEvents call: frames in, events and answers out, bounded memory."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.max_backlog = _backlog_bound(front)
        self.writing_since: float | None = None  # monotonic time the pending write started
        # keyed by the request object, not its id: a finished request and a new one that reuses
        # its id are different streams
        self.subs: dict[Req, int] = {}  # req -> cursor
        self.dirty: dict[Req, None] = {}  # requests with news, in arrival order
        self.control: collections.deque = collections.deque()  # futures of answers, in order
        self.slots = asyncio.Semaphore(limits.MAX_PENDING_FRAMES)
        self.wakeup = asyncio.Event()
        self.owned: set[Req] = set()  # submitted on this session
        self.half_closed = False
        self.fault: ServiceError | None = None
        self.tasks: set[asyncio.Task] = set()

    # listener interface (see front.Follower)
    def wake(self, req: Req) -> None:
        cursor = self.subs.get(req)
        if cursor is not None:
            self.dirty[req] = None
            bound = self.max_backlog
            if (
                bound is not None
                and self.fault is None
                and req.final is None
                and len(req.tokens) - cursor > bound
                and self.writing_since is not None
                and time.monotonic() - self.writing_since >= limits.STREAM_STALL_S
            ):
                # the client stopped reading: gRPC flow control holds our writes while the
                # worker goes on producing; end the stream and free the pages of the requests
                # it submitted (a request it only subscribed to belongs to someone else)
                self.fault = _backlog_error(bound)
                _stream_fell_behind(self.front, self._live_owned(), bound, req.rid)
            self.wakeup.set()

    def worker_lost(self, req: Req) -> None:
        self.fault = unavailable("worker process died")
        self.wakeup.set()

    def _add_sub(self, req: Req, cursor: int) -> None:
        if req in self.subs:
            return
        self.subs[req] = cursor
        req.listeners.add(self)
        self.dirty[req] = None

    def _drop_sub(self, req: Req) -> None:
        del self.subs[req]
        self.owned.discard(req)
        req.listeners.discard(self)

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
                kind = frame.WhichOneof("frame")
                task = asyncio.ensure_future(self._answer(kind, frame))
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

    async def _answer(self, kind: str | None, frame: pb.StreamEventsRequest):
        """→ (response or None, action to run when the response is written, or None)."""
        front = self.front
        if kind == "submit":
            s = frame.submit
            try:
                req = await _submit(front, s)
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
            results = await front.cancel(frame.cancel.request_ids)
            resp = pb.CancelResponse(
                results=[pb.CancelResult(request_id=r, was_active=a) for r, a in results]
            )
            return pb.StreamEventsResponse(cancelled=resp), None
        if kind == "subscribe":
            sub = frame.subscribe
            req = front.find(sub.request_id)
            if req is None:
                return self._error(sub.request_id, not_found(sub.request_id)), None
            if req.final is not None and sub.from_seq > len(req.tokens):
                return self._error(sub.request_id, _past_the_end(req, sub.from_seq)), None
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
                    self.writing_since = time.monotonic()
                    yield resp
                    self.writing_since = None
                if action is not None:
                    action()
            if self.fault is not None:
                await self.fault.abort(context)
            while self.dirty:
                if self.fault is not None:
                    await self.fault.abort(context)
                req = next(iter(self.dirty))
                del self.dirty[req]
                cursor = self.subs.get(req)
                if cursor is None:
                    continue
                # (a request lost with the worker while subscribed faulted the session above;
                # subscribed later, it gets its tokens and the final ERROR event, like any end)
                if cursor > len(req.tokens):
                    if req.final is None:
                        continue  # subscribed ahead of the output; wait for more
                    # it ended before reaching the cursor: as a subscription after its end
                    self._drop_sub(req)
                    yield self._error(req.rid, _past_the_end(req, cursor))
                    continue
                ev, self.subs[req], done = build_event(req, cursor)
                if done:
                    self._drop_sub(req)
                if ev is not None:
                    self.writing_since = time.monotonic()
                    yield pb.StreamEventsResponse(event=ev)
                    self.writing_since = None
            if self.half_closed and not self.control and not self.subs:
                return

    def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        for req in self.subs:
            req.listeners.discard(self)
        for rid in self._live_owned():
            self.front.cancel_nowait(rid)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, front: Front) -> None:
        self.front = front

    async def Submit(self, request: pb.SubmitRequest, context) -> pb.SubmitResponse:
        await _reject_undecodable(request, context)
        try:
            req = await _submit(self.front, request)
        except ServiceError as err:
            await err.abort(context)
        return pb.SubmitResponse(request_id=req.rid, num_prompt_tokens=req.prompt_len)

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        await _reject_undecodable(request, context)
        results = await self.front.cancel(request.request_ids)
        return pb.CancelResponse(
            results=[pb.CancelResult(request_id=r, was_active=a) for r, a in results]
        )

    async def Generate(self, request: pb.SubmitRequest, context) -> AsyncIterator[pb.Event]:
        await _reject_undecodable(request, context)
        try:
            req = await _submit(self.front, request)
        except ServiceError as err:
            await err.abort(context)
        bound = _backlog_bound(self.front)
        follower = Follower(
            bound, None if bound is None else (lambda r: _stream_fell_behind(self.front, [r.rid], bound))
        )
        req.listeners.add(follower)
        cursor, done = 0, False
        try:
            while True:
                if follower.lost:
                    await unavailable("worker process died").abort(context)
                if follower.exhausted:
                    await _backlog_error(bound).abort(context)
                ev, cursor, done = build_event(req, cursor)
                if ev is not None:
                    follower.writing_since = time.monotonic()
                    yield ev  # blocks while the client does not read (HTTP/2 flow control)
                    follower.writing_since = None
                    follower.written = cursor
                if done:
                    return
                await follower.wait()
        finally:
            req.listeners.discard(follower)
            if not done:
                # client cancel, disconnect or deadline: the request must not run on
                if self.front.cancel_nowait(req.rid):
                    log.info("Generate call ended early: cancelling", extra={"request_id": req.rid})

    async def StreamEvents(self, request_iterator, context) -> AsyncIterator[pb.StreamEventsResponse]:
        session = _Session(self.front)
        reader = asyncio.ensure_future(session.read_frames(request_iterator))
        try:
            async for resp in session.responses(context):
                yield resp
        finally:
            reader.cancel()
            session.close()

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        await _reject_undecodable(request, context)
        front = self.front
        total, used, free, running, waiting, cached, hit_rate = await front.fresh_stats()
        info = front.info
        eng = front.config.engine
        return pb.GetInfoResponse(
            model=pb.ModelInfo(
                name=str(info.get("name", front.config.model or "demo")),
                demo=bool(info.get("demo", not front.config.model)),
                vocab_size=info.get("vocab_size", 0),
                max_position_embeddings=info.get("max_position_embeddings", 0),
                eos_token_ids=info.get("eos_token_ids", []),
                dtype=info.get("dtype", ""),
                device=info.get("device", front.config.device),
                num_hidden_layers=info.get("num_hidden_layers", 0),
                hidden_size=info.get("hidden_size", 0),
                has_tokenizer=bool(info.get("has_tokenizer")),
                has_chat_template=bool(info.get("has_chat_template")),
            ),
            limits=pb.EngineLimits(
                page_size=info.get("page_size", eng.get("page_size", 0)),
                token_budget=info.get("token_budget", eng.get("token_budget", 0)),
                prefill_chunk=info.get("prefill_chunk", eng.get("prefill_chunk", 0)),
                max_active=info.get("max_active", eng.get("max_active", 0)),
                max_queued=front.config.max_queued,
                max_request_id_length=limits.MAX_REQUEST_ID_LENGTH,
                schedule_policy=info.get("schedule_policy", eng.get("schedule_policy", "")),
                attention_backend=info.get("attention", ""),
                cuda_graphs=bool(info.get("cuda_graphs")),
            ),
            pages=pb.PagePool(
                total=total, used=used, free=free, cached=cached, page_bytes=info.get("page_bytes", 0)
            ),
            num_running=running,
            num_waiting=waiting,
            worker=pb.WorkerInfo(state=int(front.state), restarts=front.restarts, pid=front.worker_pid),
            server_version=SERVER_VERSION,
            num_unfinished=front.num_unfinished,
            num_requests_total=front.num_requests_total,
            prefix_cache=pb.PrefixCacheInfo(
                enabled=bool(info.get("prefix_cache")), hit_rate=float(hit_rate)
            ),
        )


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    front: FrontConfig = field(default_factory=FrontConfig)
    grace_seconds: float = 10.0
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    metrics_port: int | None = None  # Prometheus /metrics on this port (None: off)
    metrics_host: str | None = None  # default: host


def _bind(server: grpc.aio.Server, address: str, creds: grpc.ServerCredentials | None) -> int:
    """Add the listening port; OSError when it cannot be bound (older grpcio returns 0, newer
    raises RuntimeError)."""
    try:
        port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot bind {address}: {exc}") from None
    if not port:
        raise OSError(f"cannot bind {address}")
    return port


class Server:
    """A started server: the grpc.aio server, the front and its worker, health."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.front = Front(config.front)
        self.health = Health()
        self.port = 0
        self._grpc: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self.metrics = None

    async def start(self) -> int:
        cfg = self.config
        if cfg.metrics_port is not None:
            from qil_worker.service.metrics import Metrics  # imports prometheus_client

            self.metrics = Metrics()
            # an IPv6 --host is written [::1] for gRPC; the HTTP server wants it bare
            self.metrics.serve((cfg.metrics_host or cfg.host).strip("[]"), cfg.metrics_port)
            self.front.metrics = self.metrics
        interceptors = [BearerTokenInterceptor(cfg.auth_token)] if cfg.auth_token else []
        server = grpc.aio.server(options=limits.SERVER_OPTIONS, interceptors=interceptors)
        add_servicer(InferenceServicer(self.front), server, pb, "Inference")
        self.health.add_to_server(server)
        await self.health.set_serving(False)
        reflection.enable_server_reflection(
            (SERVICE_NAME, "grpc.health.v1.Health", reflection.SERVICE_NAME), server
        )
        address = f"{cfg.host}:{cfg.port}"
        creds = None
        if cfg.tls_client_ca and not (cfg.tls_cert and cfg.tls_key):
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (client certificates are a TLS feature)")
        if cfg.tls_cert or cfg.tls_key:
            if not (cfg.tls_cert and cfg.tls_key):
                raise ValueError("--tls-cert and --tls-key go together")
            with open(cfg.tls_key, "rb") as f:
                key = f.read()
            with open(cfg.tls_cert, "rb") as f:
                cert = f.read()
            ca = None
            if cfg.tls_client_ca:
                with open(cfg.tls_client_ca, "rb") as f:
                    ca = f.read()
            creds = grpc.ssl_server_credentials(
                [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
            )
        try:
            self.port = _bind(server, address, creds)
        except OSError:
            if self.metrics is not None:
                self.metrics.close()
            raise
        await server.start()
        self._grpc = server
        log.info("qil listening on %s:%d (loading the model)", cfg.host, self.port)

        def on_state(state: WorkerState) -> None:
            asyncio.ensure_future(self.health.set_serving(state == WorkerState.READY and not self.front.draining))

        self.front.on_state_change = on_state
        try:
            await self.front.start()
        except BaseException:
            await server.stop(0)
            if self.metrics is not None:
                self.metrics.close()
            raise
        if self.metrics is not None:
            self.metrics.on_stats(self.front.stats, self.front.num_unfinished)
        await self.health.set_serving(True)
        return self.port

    async def shutdown(self) -> None:
        """NOT_SERVING, stop accepting, grace period, cancel the rest, stop the worker."""
        if self._stopped.is_set():
            return
        await self.health.shutdown()
        left = await self.front.drain(self.config.grace_seconds)
        if left:
            log.info("cancelled %d request(s) left after the grace period", left)
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        await self.front.stop_worker()
        if self.metrics is not None:
            self.metrics.close()
        self._stopped.set()


async def serve(config: ServeConfig, stop: asyncio.Event | None = None, announce=print) -> int:
    """Run a server until SIGTERM/SIGINT (or ``stop`` is set); returns the exit code."""
    stop = stop or asyncio.Event()
    server = Server(config)
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        # before loading: a stop while the model loads (minutes for a large one) ends the worker
        # too, where the default action would leave it loading without its front
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(server.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("stopped while starting: the worker is stopped, no request had arrived")
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return 0
    stopping.cancel()
    try:
        port = starting.result()
    except WorkerFailed as exc:
        log.error("the worker could not start: %s", exc)
        return 2
    except OSError as exc:  # a port in use (gRPC or metrics)
        log.error("cannot start the server: %s", exc)
        return 2
    log.debug("front: %d start-up objects frozen for the GC", freeze_startup_heap())
    demo = " (embedded DEMO model: random weights)" if server.front.info.get("demo") else ""
    announce(f"qil serving on {config.host}:{port}{demo}")
    await stop.wait()
    log.info("shutting down (grace %.1fs)", config.grace_seconds)
    await server.shutdown()
    log.info("stopped")
    return 0


class ServerThread:
    """A server on its own event loop in a thread (tests, benchmarks, embedding)."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.server: Server | None = None
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qil-server", daemon=True)

    def start(self, timeout: float = 300.0) -> "ServerThread":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("server did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self._main())
        loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self.server = Server(self.config)
        try:
            self.port = await self.server.start()
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stop.wait()
        await self.server.shutdown()

    def call(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's loop and return its result."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.port}"
