"""Optional bearer-token authentication (``--auth-token`` or ``QIL_AUTH_TOKEN``).

Every RPC except the ``grpc.health.v1`` service must carry ``authorization: Bearer <token>``;
anything else is UNAUTHENTICATED. Tokens are compared with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import grpc

from qil_worker.service.errors import unauthenticated

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if details.method.startswith(HEALTH_PREFIX) or self._authorized(details.invocation_metadata):
            return handler
        if handler is None:
            return handler
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that aborts with UNAUTHENTICATED."""
    err = unauthenticated()

    async def unary(request, context):
        await err.abort(context)

    async def streaming(request, context):
        await err.abort(context)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)
