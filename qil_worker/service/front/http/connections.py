"""The connections the HTTP site holds: at most ``limit`` at once (one more is answered 503 and
closed before aiohttp sees it), each given ``header_timeout_s`` to send a request's line and
headers, and the loop's accept-error log line held to one per interval.

aiohttp has no cap on connections and no timer on a request's head (a client trickling its
headers holds its descriptor until the keep-alive timer, an hour by default): each accepted
connection's aiohttp protocol (``RequestHandler``) sits behind a ``_Guarded`` protocol that
counts it and runs one timer, and ``GuardedSite`` passes that protocol's factory to
``loop.create_server`` where ``web.TCPSite`` passes ``runner.server`` itself.

Relies on aiohttp 3.x (as of 3.14): ``Server()`` makes a connection's ``RequestHandler``, an
``asyncio.Protocol`` that any protocol may drive; ``request.protocol`` is that handler (so the
``middleware`` finds its connection, and sees a request once its head is parsed); the
keep-alive timer, armed at connect and after each answer, closes a connection only while its
handler waits for a request, and bytes arriving do not extend it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_server import Server

from qil_worker.service.front import limits

log = logging.getLogger("qil.http")

# what asyncio's selector loop reports (through the loop's exception handler) when accept()
# fails with EMFILE, ENFILE, ENOBUFS or ENOMEM; it retries the accept a second later
ACCEPT_ERROR = "socket.accept() out of system resource"


def connection_cap(requested: int, backlog: int = limits.HTTP_BACKLOG) -> int:
    """``requested``, at most half of what the soft ``RLIMIT_NOFILE`` leaves beside one accept
    batch of ``backlog`` (the other half is gRPC's, the worker's pipes', the logs'), at least 1."""
    try:
        import resource
    except ImportError:  # not on POSIX: no descriptor limit to read
        return max(1, requested)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max(1, requested)
    return max(1, min(requested, (soft - backlog) // 2))


def _over_cap_answer() -> bytes:
    body = json.dumps({"error": {
        "message": "the HTTP API holds as many connections as it may; retry",
        "type": "service_unavailable", "param": None, "code": "unavailable",
    }}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


_OVER_CAP = _over_cap_answer()


class Connections:
    """The HTTP site's connections: ``open`` held now, ``rejected`` and ``header_timeouts`` so
    far (read from other threads by tests; plain ints, written on the loop only)."""

    def __init__(self, max_connections: int = limits.HTTP_MAX_CONNECTIONS,
                 header_timeout_s: float = limits.HTTP_HEADER_TIMEOUT_S) -> None:
        self.limit = connection_cap(max_connections)
        self.header_timeout_s = header_timeout_s
        self.open = 0
        self.rejected = 0
        self.header_timeouts = 0
        self._guards: dict[RequestHandler, _Guarded] = {}

    def factory(self, server: Server) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for ``loop.create_server``, over aiohttp's ``server``."""
        loop = asyncio.get_running_loop()
        return lambda: _Guarded(self, server, loop)

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Marks a request in a handler (its head parsed: the header timer stops) until its
        handler returns; the outermost middleware, so every request of the app passes it."""
        guard = self._guards.get(request.protocol)
        if guard is None:
            return await handler(request)
        guard.request_started()
        try:
            return await handler(request)
        finally:
            guard.request_ended()


class _Guarded(asyncio.Protocol):
    """One accepted connection: counted, timed until a request's head is in, and handed to
    aiohttp's ``RequestHandler`` (made only for a connection under the cap)."""

    __slots__ = ("_connections", "_server", "_loop", "_handler", "_timer", "_requests")

    def __init__(self, connections: Connections, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        self._connections = connections
        self._server = server
        self._loop = loop
        self._handler: RequestHandler | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._requests = 0  # requests in a handler now (head parsed, handler not yet returned)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        conns = self._connections
        if conns.open >= conns.limit:
            # answered before any request is read: a client that already sent one may see the
            # reset of a close with unread data instead; either way the descriptor is freed now
            conns.rejected += 1
            transport.write(_OVER_CAP)  # type: ignore[attr-defined]
            transport.close()
            return
        conns.open += 1
        handler = self._server()  # aiohttp's Server.__call__: a RequestHandler
        self._handler = handler
        conns._guards[handler] = self
        self._arm()
        handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._handler is None:
            return  # rejected: closing
        if self._requests == 0 and self._timer is None:
            # the first bytes of the next request on a kept-alive connection (the wait before
            # them is aiohttp's keep-alive timer's)
            self._arm()
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self._handler is None else self._handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        handler, self._handler = self._handler, None
        if handler is None:
            return
        self._disarm()
        self._connections.open -= 1
        self._connections._guards.pop(handler, None)
        handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()

    def request_started(self) -> None:
        self._requests += 1
        self._disarm()

    def request_ended(self) -> None:
        self._requests -= 1

    def _arm(self) -> None:
        self._timer = self._loop.call_later(self._connections.header_timeout_s, self._on_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timeout(self) -> None:
        self._timer = None
        if self._handler is not None and self._requests == 0:
            self._connections.header_timeouts += 1
            log.debug("HTTP connection closed: no request head within %gs",
                      self._connections.header_timeout_s)
            self._handler.force_close()  # closes the transport; connection_lost follows


class GuardedSite(web.BaseSite):
    """``web.TCPSite`` with ``connections``'s protocol factory. Relies on aiohttp 3.x's
    ``BaseSite`` contract (as of 3.14): ``start`` registers the site with its runner, which
    finds the listening sockets (``runner.addresses``) and closes them (``stop``) through
    ``self._server``."""

    __slots__ = ("_connections", "_host", "_port")

    def __init__(self, runner: web.BaseRunner, connections: Connections, host: str, port: int) -> None:
        super().__init__(runner, backlog=limits.HTTP_BACKLOG)  # connection_cap counts it
        self._connections = connections
        self._host = host
        self._port = port

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # runner.setup() ran (BaseSite checks it)
        self._server = await asyncio.get_running_loop().create_server(
            self._connections.factory(server), self._host, self._port,
            backlog=self._backlog, reuse_address=True,
        )


class AcceptErrorLog:
    """A loop exception handler: ``ACCEPT_ERROR`` passes on at most once per ``interval_s``,
    with the count of those held back since the last; every other context passes on as is.
    (Out of descriptors, the loop reports it once a second per listening socket, and each
    report is a traceback.)"""

    def __init__(self, pass_on: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None],
                 interval_s: float = limits.HTTP_ACCEPT_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pass_on = pass_on
        self._interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")  # when the next one may pass
        self.suppressed = 0  # held back since the last that passed

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_ERROR:
            self._pass_on(loop, context)
            return
        now = self._clock()
        if now < self._next:
            self.suppressed += 1
            return
        self._next = now + self._interval_s
        if self.suppressed:
            context = dict(context, message=f"{ACCEPT_ERROR} ({self.suppressed} more not logged "
                                            f"in the last {self._interval_s:g}s)")
        self.suppressed = 0
        self._pass_on(loop, context)


def limit_accept_log(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Install an ``AcceptErrorLog`` on ``loop`` in front of its handler (the default one when
    none was set); returns what puts the previous one back."""
    previous = loop.get_exception_handler()

    def pass_on(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if previous is None:
            loop.default_exception_handler(context)
        else:
            previous(loop, context)

    handler = AcceptErrorLog(pass_on)
    loop.set_exception_handler(handler)

    def restore() -> None:
        if loop.get_exception_handler() is handler:  # nobody replaced it since
            loop.set_exception_handler(previous)

    return restore
