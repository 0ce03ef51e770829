"""Wire limits and channel options of the server (the client mirrors them); the limits of one
request's contents are ``qil_worker.request_limits``."""

from __future__ import annotations

# A prompt of 1M token ids is ~5 MB on the wire; anything larger is refused by gRPC itself.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_NEW_TOKENS = 16
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
# The HTTP API's connections (http/connections.py). A client sending its request's line and
# headers a byte at a time holds a descriptor for as long as the server waits: each connection
# has this long to send them (from its connect, or from the first byte of the next request on
# a kept-alive one)...
HTTP_HEADER_TIMEOUT_S = 10.0
# ...an idle kept-alive connection is closed after this long (aiohttp's keepalive_timeout;
# its own default, an hour, lets idle clients pile up)...
HTTP_KEEPALIVE_TIMEOUT_S = 15.0
# ...and at most this many are held at once (one more is answered 503 and closed), at most half
# the process's descriptor limit, so that gRPC, the worker's pipes and the logs keep theirs...
HTTP_MAX_CONNECTIONS = 1000
# ...less this listen backlog: asyncio accepts up to that many connections in one go before any
# is handled (an over-cap one is closed only then), so they take descriptors on top of the held.
HTTP_BACKLOG = 128
# The loop's "out of system resource" accept error, logged at most once per this long.
HTTP_ACCEPT_LOG_INTERVAL_S = 10.0

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
