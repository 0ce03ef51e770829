"""Request bytes that are not a valid message become INVALID_ARGUMENT, not UNKNOWN.

With the generated registration, a request that fails to parse raises inside grpc's
deserializer: the client gets UNKNOWN and the server logs a traceback per call (a cheap way to
flood the log), and a bad frame in a bidirectional stream ends the request iterator as if the
client had half-closed. Registering the same methods with deserializers that never raise —
they hand the servicer an ``Undecodable`` marker instead — lets each method answer with a
status that names the problem.

A servicer may also name, in ``outsized_requests``, a parser for outsized messages of a type
(``freed_memory.OUTSIZED_CHARS`` bytes or more; see ``outsized_submit``): what it returns stands
in for the message, and when it returns None the message is parsed as any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import grpc
from google.protobuf.message import DecodeError

from qil_worker.freed_memory import OUTSIZED_CHARS


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request message whose bytes did not parse."""

    type_name: str
    reason: str

    def describe(self) -> str:
        return f"undecodable {self.type_name}: {self.reason}"


def parse_leniently(message_cls: Any, data: bytes) -> Any:
    """``data`` parsed as a ``message_cls``, or ``Undecodable``."""
    try:
        return message_cls.FromString(data)
    except (DecodeError, UnicodeDecodeError, ValueError) as exc:
        return Undecodable(message_cls.DESCRIPTOR.full_name, str(exc) or type(exc).__name__)


def lenient(message_cls: Any, outsized: Callable[[bytes], Any] | None = None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        if outsized is not None and len(data) >= OUTSIZED_CHARS:
            stand_in = outsized(data)
            if stand_in is not None:
                return stand_in
        return parse_leniently(message_cls, data)

    return parse


def add_servicer(servicer: Any, server: Any, file_module: Any, service_name: str) -> None:
    """Register every method of ``service_name`` (from the proto descriptor) on ``server``."""
    service = file_module.DESCRIPTOR.services_by_name[service_name]
    outsized: Mapping[str, Callable[[bytes], Any]] = getattr(servicer, "outsized_requests", {})
    handlers = {}
    for method in service.methods:
        request_cls = getattr(file_module, method.input_type.name)
        response_cls = getattr(file_module, method.output_type.name)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=lenient(request_cls, outsized.get(method.input_type.full_name)),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(service.full_name, handlers)
