"""The HTTP site of the front: the aiohttp application (routes, the error and auth
middleware), and its start and stop beside the gRPC server."""

from __future__ import annotations

import asyncio
import functools
import logging

from aiohttp import web

from qil_worker.service.front import limits
from qil_worker.service.front.auth import bearer_token_matches
from qil_worker.service.errors import HttpError, ServiceError, internal, unauthenticated, unknown_model
from qil_worker.service.front.http.call import error_response, handle
from qil_worker.service.front.http.chat import Chat
from qil_worker.service.front.http import retrieval, tokens
from qil_worker.service.front.http.completions import Completions
from qil_worker.service.front.http.connections import Connections, GuardedSite, limit_accept_log
from qil_worker.service.front.http.context import HttpContext

log = logging.getLogger("qil.http")

# paths that answer without the bearer token (as gRPC health does; Prometheus scrapes
# without one, as on the --metrics-port endpoint)
OPEN_PATHS = frozenset({"/health", "/metrics"})
# on shutdown, after the drain: how long a handler still running may take to end
SHUTDOWN_TIMEOUT_S = 1.0


def make_app(ctx: HttpContext) -> web.Application:
    app = web.Application(
        middlewares=[_errors, _auth(ctx)],
        client_max_size=limits.MAX_MESSAGE_BYTES,  # as gRPC's message limit
    )
    completions, chat = Completions(), Chat()

    async def completions_handler(request: web.Request) -> web.StreamResponse:
        return await handle(ctx, request, completions)

    async def chat_handler(request: web.Request) -> web.StreamResponse:
        return await handle(ctx, request, chat)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [_model(ctx)]})

    async def model(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name != ctx.model_name:
            raise unknown_model(name, ctx.model_name)
        return web.json_response(_model(ctx))

    async def health(request: web.Request) -> web.Response:
        if ctx.health.serving:
            return web.Response(text="ok\n")
        return web.Response(status=503, text="not serving\n")

    app.router.add_post("/v1/completions", completions_handler)
    app.router.add_post("/v1/chat/completions", chat_handler)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/embeddings", functools.partial(retrieval.embeddings, ctx))
    app.router.add_post("/v1/rerank", functools.partial(retrieval.rerank, ctx))
    app.router.add_post("/rerank", functools.partial(retrieval.rerank, ctx))  # vLLM serves both
    app.router.add_post("/v1/score", functools.partial(retrieval.score, ctx))
    # vLLM's tokenizer routes, at the root as vLLM serves them
    app.router.add_post("/tokenize", functools.partial(tokens.tokenize, ctx))
    app.router.add_post("/detokenize", functools.partial(tokens.detokenize, ctx))
    app.router.add_get("/tokenizer_info", functools.partial(tokens.tokenizer_info, ctx))
    if ctx.metrics is not None:
        app.router.add_get("/metrics", _metrics_handler(ctx.metrics))
    return app


def _model(ctx: HttpContext) -> dict:
    info = ctx.front.info
    entry = {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "qil"}
    if info is not None:
        entry["max_model_len"] = info.max_position_embeddings
    return entry


def _metrics_handler(metrics):
    async def handler(request: web.Request) -> web.Response:
        body, content_type = metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    return handler


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure in the API's error shape, with its status (errors.http_status)."""
    try:
        return await handler(request)
    except ServiceError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "internal_error"
        return error_response(HttpError(exc.status, kind, exc.reason, None, None))
    except ConnectionResetError:
        raise  # the client is gone: nobody to answer
    except Exception:  # noqa: BLE001 - an answer, not a dropped connection
        log.exception("HTTP handler failed")
        return error_response(internal("the server failed on this request; see its log"))


def _auth(ctx: HttpContext):
    expected = ctx.auth_token

    @web.middleware
    async def auth(request: web.Request, handler) -> web.StreamResponse:
        if expected is not None and request.path not in OPEN_PATHS:
            if not bearer_token_matches(request.headers.getall("Authorization", []), expected):
                raise unauthenticated()
        return await handler(request)

    return auth


class HttpSite:
    """The HTTP API on ``host:port``, on the running loop."""

    def __init__(self, ctx: HttpContext, host: str, port: int, *,
                 max_connections: int = limits.HTTP_MAX_CONNECTIONS,
                 header_timeout_s: float = limits.HTTP_HEADER_TIMEOUT_S,
                 keepalive_timeout_s: float = limits.HTTP_KEEPALIVE_TIMEOUT_S) -> None:
        self.ctx = ctx
        self.host = host
        self.port = port
        self.keepalive_timeout_s = keepalive_timeout_s
        self.connections = Connections(max_connections, header_timeout_s)
        self._restore_exception_handler = None
        app = make_app(ctx)
        app.middlewares.insert(0, self.connections.middleware)  # outermost: sees every request
        # handler_cancellation: a client that disconnects cancels its handler (which cancels
        # its requests) even while the handler waits for tokens and writes nothing
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True,
                                     shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                                     keepalive_timeout=keepalive_timeout_s)

    async def start(self) -> int:
        await self._runner.setup()
        site = GuardedSite(self._runner, self.connections, self.host, self.port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(f"cannot bind HTTP {self.host}:{self.port}: {exc}") from None
        self.port = self._runner.addresses[0][1]  # the port picked for 0
        self._restore_exception_handler = limit_accept_log(asyncio.get_running_loop())
        return self.port

    async def stop(self) -> None:
        await self._runner.cleanup()
        if self._restore_exception_handler is not None:
            self._restore_exception_handler()
            self._restore_exception_handler = None
