"""Typed exceptions for the status codes of qil.v1.Inference (see protos/qil/v1/inference.proto)."""

from __future__ import annotations

import grpc

FIELD_METADATA_KEY = "qil-field"


class QilError(Exception):
    """An RPC failed; ``code`` is the grpc.StatusCode, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str, field: str | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.field = field


class InvalidArgument(QilError):
    """A malformed request; ``field`` names the offending field."""


class AlreadyExists(QilError):
    """A live request already has this request_id."""


class NotFound(QilError):
    """The server does not know (or no longer keeps) this request."""


class ResourceExhausted(QilError):
    """The server's queue is full (--max-queued); retry later."""


class Unauthenticated(QilError):
    """Missing or wrong bearer token."""


class FailedPrecondition(QilError):
    """The server lacks what the request needs, e.g. a tokenizer for text, messages or stop strings."""


class PermissionDenied(QilError):
    pass


class Unavailable(QilError):
    """The worker died or restarts, the server shuts down, or it cannot be reached. Retryable."""


class DeadlineExceeded(QilError):
    pass


class Cancelled(QilError):
    pass


class Internal(QilError):
    pass


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
}

_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def error_for(code: grpc.StatusCode | int, details: str, field: str | None = None) -> QilError:
    if isinstance(code, int):
        code = _CODE_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(code, QilError)(code, details, field or None)


def from_rpc_error(err: grpc.RpcError) -> QilError:
    """The typed exception for a failed call (sync or asyncio)."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    field = None
    try:
        trailing = err.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - not every RpcError carries metadata
        trailing = ()
    for key, value in trailing:
        if key == FIELD_METADATA_KEY:
            field = value
    return error_for(code, details or "", field)
