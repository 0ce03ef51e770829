"""gRPC calls made of raw request bytes: what a client that builds its own frames sends."""

from __future__ import annotations

import grpc

from qil_client import pb

SERVICE = "/qil.v1.Inference/"


def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def raw_call(channel: grpc.Channel, method: str, data: bytes) -> tuple[grpc.StatusCode, str, list]:
    """(status, details, responses) of one call of ``method`` with the request bytes ``data``."""
    if method == "Submit":
        call = channel.unary_unary(SERVICE + method, request_serializer=bytes, response_deserializer=pb.SubmitResponse.FromString)
        try:
            return grpc.StatusCode.OK, "", [call(data, timeout=60)]
        except grpc.RpcError as err:
            return err.code(), err.details(), []
    if method == "Generate":
        call = channel.unary_stream(SERVICE + method, request_serializer=bytes, response_deserializer=pb.Event.FromString)
        events: list = []
        try:
            events.extend(call(data, timeout=60))
            return grpc.StatusCode.OK, "", events
        except grpc.RpcError as err:
            return err.code(), err.details(), events
    # StreamEvents: the submit frame, then half-close; its answers are in-band
    call = channel.stream_stream(SERVICE + method, request_serializer=bytes,
                                 response_deserializer=pb.StreamEventsResponse.FromString)
    frame = b"\x0a" + varint(len(data)) + data
    answers: list = []
    try:
        answers.extend(call(iter([frame]), timeout=60))
        return grpc.StatusCode.OK, "", answers
    except grpc.RpcError as err:
        return err.code(), err.details(), answers
