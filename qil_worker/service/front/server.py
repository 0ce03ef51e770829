"""The gRPC server of the front: binds the port, wires the servicer (``servicer``), health,
reflection, auth, TLS and metrics around a ``Front``, and shuts it all down in order.

Runs on grpc.aio in the front process, which never imports torch: the model lives in the worker
process (see ``front`` and ``worker``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass, field

import grpc

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.service.front import limits
from qil_worker.service.front.auth import BearerTokenInterceptor
from qil_worker.service.front.decoding import add_servicer
from qil_worker.service.front.front import Front, FrontConfig
from qil_worker.service.front.health import SERVICE_NAME, Health
from qil_worker.service.heap import freeze_startup_heap
from qil_worker.service.front.reflection import enable_reflection
from qil_worker.service.front.servicer import InferenceServicer
from qil_worker.service.front.worker_process import WorkerFailed, WorkerState

log = logging.getLogger("qil.server")


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    front: FrontConfig = field(default_factory=FrontConfig)
    grace_seconds: float = 10.0
    auth_token: str | None = None
    open_reflection: bool = False  # with auth_token: reflection answers callers without it too
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    metrics_port: int | None = None  # Prometheus /metrics on this port (None: off)
    metrics_host: str | None = None  # default: host
    http_port: int | None = None  # the OpenAI-compatible HTTP API on this port (None: off)
    http_host: str | None = None  # default: host
    http_max_connections: int = limits.HTTP_MAX_CONNECTIONS  # clamped under RLIMIT_NOFILE (connection_cap)
    http_header_timeout: float = limits.HTTP_HEADER_TIMEOUT_S  # seconds for a request's line and headers
    http_keepalive_timeout: float = limits.HTTP_KEEPALIVE_TIMEOUT_S  # an idle kept-alive connection's seconds
    served_model_name: str | None = None  # the model's name in the HTTP API (default: its directory's)


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
        self.http = None  # an http.site.HttpSite with --http-port
        self.http_port = 0

    async def start(self) -> int:
        cfg = self.config
        if cfg.metrics_port is not None:
            from qil_worker.service.front.metrics import Metrics  # imports prometheus_client

            self.metrics = Metrics()
            # an IPv6 --host is written [::1] for gRPC; the HTTP server wants it bare
            self.metrics.serve((cfg.metrics_host or cfg.host).strip("[]"), cfg.metrics_port)
            self.front.metrics = self.metrics
        interceptors = (
            [BearerTokenInterceptor(cfg.auth_token, open_reflection=cfg.open_reflection)]
            if cfg.auth_token else []
        )
        server = grpc.aio.server(options=limits.SERVER_OPTIONS, interceptors=interceptors)
        add_servicer(InferenceServicer(self.front), server, pb, "Inference")
        self.health.add_to_server(server)
        await self.health.set_serving(False)
        enable_reflection((SERVICE_NAME, "grpc.health.v1.Health"), server)
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
        if cfg.http_port is not None:
            try:
                await self._start_http()
            except OSError:
                await server.stop(0)
                if self.metrics is not None:
                    self.metrics.close()
                raise
        log.info("qil listening on %s:%d (loading the model)", cfg.host, self.port)

        def on_state(state: WorkerState) -> None:
            asyncio.ensure_future(self.health.set_serving(state == WorkerState.READY and not self.front.draining))

        self.front.on_state_change = on_state
        try:
            await self.front.start()
        except BaseException:
            await server.stop(0)
            if self.http is not None:
                await self.http.stop()
            if self.metrics is not None:
                self.metrics.close()
            raise
        if self.metrics is not None:
            self.metrics.on_stats(self.front.stats, self.front.num_unfinished)
        await self.health.set_serving(True)
        return self.port

    async def _start_http(self) -> None:
        """The OpenAI-compatible API beside gRPC, on this loop, over the same front (its
        library is imported only here: a gRPC-only front never loads it)."""
        from qil_worker.service.front.http.context import HttpContext, served_model_name
        from qil_worker.service.front.http.site import HttpSite
        from qil_worker.service.front.http.token_strings import TokenStrings

        cfg = self.config
        ctx = HttpContext(
            front=self.front,
            health=self.health,
            model_name=served_model_name(cfg.front.worker.model, cfg.served_model_name),
            token_strings=TokenStrings(self.front),
            auth_token=cfg.auth_token.encode() if cfg.auth_token else None,
            metrics=self.metrics,
        )
        # an IPv6 --host is written [::1] for gRPC; the HTTP server wants it bare
        self.http = HttpSite(ctx, (cfg.http_host or cfg.host).strip("[]"), cfg.http_port,
                             max_connections=cfg.http_max_connections,
                             header_timeout_s=cfg.http_header_timeout,
                             keepalive_timeout_s=cfg.http_keepalive_timeout)
        self.http_port = await self.http.start()
        log.info("OpenAI-compatible HTTP API on %s:%d (at most %d connections; %gs for a request's "
                 "headers, %gs idle keep-alive)", self.http.host, self.http_port,
                 self.http.connections.limit, cfg.http_header_timeout, cfg.http_keepalive_timeout)

    async def shutdown(self) -> None:
        """NOT_SERVING, stop accepting, grace period (gRPC and HTTP calls alike), cancel the rest,
    stop both sites, stop the worker."""
        if self._stopped.is_set():
            return
        await self.health.shutdown()
        left = await self.front.drain(self.config.grace_seconds)
        if left:
            log.info("cancelled %d request(s) left after the grace period", left)
        if self.http is not None:
            await self.http.stop()
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
    except OSError as exc:  # a port in use (gRPC, HTTP or metrics)
        log.error("cannot start the server: %s", exc)
        return 2
    log.debug("front: %d start-up objects frozen for the GC", freeze_startup_heap())
    demo = " (embedded DEMO model: random weights)" if server.front.info and server.front.info.demo else ""
    try:
        http = f" (HTTP on {server.http.host}:{server.http_port})" if server.http is not None else ""
        announce(f"qil serving on {config.host}:{port}{demo}{http}")  # (a closed stdout raises here)
        await stop.wait()
    finally:
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
        self.http_port = 0
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
            self.http_port = self.server.http_port
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

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def target(self) -> str:
        return f"{self.config.host}:{self.port}"
