"""Every mapping from a failure to a gRPC status code lives here."""

from __future__ import annotations

import grpc

from qil_worker.service.protocol import RejectKind

FIELD_METADATA_KEY = "qil-field"


class ServiceError(Exception):
    """A failure the front reports to a caller as a status (or as an in-band RequestError)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    @property
    def details(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((FIELD_METADATA_KEY, self.field),) if self.field else ()

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(self.code, self.details, trailing_metadata=self.trailing_metadata())


# Kinds of submit rejection the worker reports → status code.
_WORKER_KIND_TO_CODE = {
    RejectKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    RejectKind.CAPACITY: grpc.StatusCode.INVALID_ARGUMENT,
    RejectKind.DUPLICATE: grpc.StatusCode.ALREADY_EXISTS,
    RejectKind.PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    RejectKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def classify_engine_error(exc: BaseException) -> tuple[RejectKind, str | None, str]:
    """Worker side: an exception from ``Engine.submit`` → ``(kind, field, message)``.

    Matched by class name so this module stays importable without the engine (and torch).
    """
    names = {cls.__name__ for cls in type(exc).__mro__}
    field = getattr(exc, "field", None)
    message = str(exc)
    if field and message.startswith(f"{field}: "):
        message = message[len(field) + 2 :]
    if "TokenizerUnavailableError" in names or "FeatureUnavailableError" in names:
        return RejectKind.PRECONDITION, field, message
    if "DuplicateRequestError" in names:
        return RejectKind.DUPLICATE, field or "request_id", message
    if "CapacityError" in names:
        return RejectKind.CAPACITY, field, message
    if "InvalidRequestError" in names or isinstance(exc, ValueError):
        return RejectKind.INVALID, field, message
    return RejectKind.INTERNAL, None, f"{type(exc).__name__}: {exc}"


def from_worker_rejection(kind: str, field: str | None, message: str) -> ServiceError:
    return ServiceError(_WORKER_KIND_TO_CODE.get(kind, grpc.StatusCode.INTERNAL), message, field)


def invalid(field: str, message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message, field)


def invalid_from(exc: Exception, field: str | None = None) -> ServiceError:
    """An ``InvalidRequestError`` (message "field: what") as INVALID_ARGUMENT naming its field,
    or ``field`` in its place."""
    own = getattr(exc, "field", None)
    return invalid(field or own, str(exc).removeprefix(f"{own}: "))


def already_exists(request_id: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is still live", "request_id"
    )


def not_found(request_id: str) -> ServiceError:
    return ServiceError(
        grpc.StatusCode.NOT_FOUND, f"no request {request_id!r} (unknown or expired)", "request_id"
    )


def unavailable(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAVAILABLE, message)


def resource_exhausted(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unauthenticated() -> ServiceError:
    return ServiceError(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")


# ---------------------------------------------------------------- the HTTP (OpenAI) front

# status code → (HTTP status, the OpenAI error ``type``)
_CODE_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class HttpError(ServiceError):
    """A failure that only the HTTP front has (a body too large, a route without that method):
    its own HTTP status, the closest gRPC code for the rest."""

    def __init__(self, status: int, error_type: str, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, param)
        self.status = status
        self.error_type = error_type
        self.error_code = code


def http_status(err: ServiceError) -> int:
    if isinstance(err, HttpError):
        return err.status
    return _CODE_TO_HTTP.get(err.code, (500, "internal_error"))[0]


def openai_error(err: ServiceError) -> dict:
    """The body of an error answer in the OpenAI API's shape: ``{"error": {"message", "type",
    "param", "code"}}``; ``param`` names the request's parameter at fault, and the message
    starts with it too (SDKs show callers the message alone); ``code`` is the gRPC status name
    (or the API's own code: ``model_not_found``)."""
    if isinstance(err, HttpError):
        kind, code = err.error_type, err.error_code
    else:
        kind = _CODE_TO_HTTP.get(err.code, (500, "internal_error"))[1]
        code = err.code.name.lower()
    return {"error": {"message": err.details, "type": kind, "param": err.field, "code": code}}


def unknown_model(name: str, served: str) -> HttpError:
    return HttpError(404, "invalid_request_error", f"the model {name!r} does not exist; this server "
                     f"serves {served!r}", "model", "model_not_found")


def internal(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INTERNAL, message)
