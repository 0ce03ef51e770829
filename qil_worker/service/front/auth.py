"""Optional bearer-token authentication (``--auth-token`` or ``QIL_AUTH_TOKEN``).

Every RPC except the ``grpc.health.v1`` service (and reflection, with ``--open-reflection``) must
carry one ``authorization: Bearer <token>`` header (the scheme in any case); anything else is
UNAUTHENTICATED. Tokens are compared with ``hmac.compare_digest``.
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import grpc

from qil_worker.service.errors import unauthenticated
from qil_worker.service.front.reflection import SERVICE_NAMES as REFLECTION_SERVICES

HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = tuple(f"/{name}/" for name in REFLECTION_SERVICES)


def bearer_token_matches(values: list[str | bytes], expected: bytes) -> bool:
    """The check of both fronts (gRPC metadata, HTTP headers) on the ``authorization`` values
    of one call: exactly one, as two would leave the choice to whichever the server reads
    first. The scheme is case-insensitive (RFC 7235), the token compared exactly, in constant
    time."""
    if len(values) != 1:
        return False
    value = values[0].encode() if isinstance(values[0], str) else bytes(values[0])
    scheme, _, credentials = value.partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(credentials.lstrip(b" "), expected)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """``open_reflection``: reflection answers without the token too (it describes the public
    protocol only), so that grpcurl can list the services and call health without it."""

    def __init__(self, token: str, open_reflection: bool = False) -> None:
        if not token:
            raise ValueError("auth token must not be empty")
        self._expected = token.encode()
        self._open = (HEALTH_PREFIX, *REFLECTION_PREFIXES) if open_reflection else (HEALTH_PREFIX,)

    def _authorized(self, metadata) -> bool:
        values = [value for key, value in metadata or () if key == "authorization"]
        return bearer_token_matches(values, self._expected)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if details.method.startswith(self._open) or self._authorized(details.invocation_metadata):
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
