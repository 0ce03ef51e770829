"""Wire limits and channel options of the server (the client mirrors them)."""

from __future__ import annotations

MAX_REQUEST_ID_LENGTH = 128
# A prompt of 1M token ids is ~5 MB on the wire; anything larger is refused by gRPC itself.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_NEW_TOKENS = 16
# Stop strings of one request: the worker matches them against the text after every token, so
# their number and length bound that per-token cost.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256
# Finished requests kept for late subscribers: at most this many, for at most this long, and at
# most this many token-equivalents in all (tokens, plus their top-logprob candidates), so that
# long requests with logprobs cannot grow the front without bound (~2M ≈ a few hundred MB).
RETAIN_FINISHED = 4096
RETAIN_SECONDS = 600.0
RETAIN_TOKENS = 2_000_000
# Frames of one StreamEvents session being answered at once (bounds that session's memory; the
# session stops reading frames until its answers are written).
MAX_PENDING_FRAMES = 256
# Produced-but-unwritten tokens a streaming call may fall behind before it is ended with
# RESOURCE_EXHAUSTED (and its requests cancelled): a client that stops reading holds its pages.
MAX_STREAM_BACKLOG = 4096
# ...counted only once one write to that client has been pending this long (a reader that is
# merely slow for a moment on a busy host is not cut off).
STREAM_STALL_S = 1.0

MAX_CONNECTION_AGE_MS = 10 * 60 * 1000

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive: ping idle connections every 30 s, drop them if no answer within 10 s; let
    # clients ping every 10 s or more, even without calls in flight.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.so_reuseport", 0),
    # A client re-resolves a dns:/// name only when a connection ends: ending each connection
    # after a while (gRPC adds jitter) lets long-lived clients find replicas added since. Calls
    # in flight, long streams included, finish on the old connection (no grace limit).
    ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
    ("grpc.max_connection_age_grace_ms", 2**31 - 1),
]
