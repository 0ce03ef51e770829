"""The shapes CUDA graphs are captured for: bucket sizes and the padding that fills them.

Pure arithmetic, shared by the decode graphs (``decode_graphs``: batch x context, or x packed
keys) and the mixed-step graphs (``step_graphs``: tokens x requests, filled with pad requests).
"""

from __future__ import annotations

SMALL_BATCHES = (1, 2, 4, 8)
MIN_CONTEXT_BUCKET = 256
MIN_KEY_BUCKET = 1024
MIN_TOKEN_BUCKET = 16
# A gathering backend materialises [batch, context] keys and values per layer (packed: the
# bucket's keys); a graph keeps that workspace reserved, so shapes whose gather exceeds this
# run eagerly instead.
MAX_GATHER_BYTES = 4 << 30


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to ``max_batch`` (always included)."""
    sizes = [b for b in SMALL_BATCHES if b < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


def context_buckets(max_context: int, page_size: int) -> list[int]:
    """Powers of two from 256 tokens, page-aligned, the last covering ``max_context``."""
    def align(n: int) -> int:
        return -(-n // page_size) * page_size

    sizes, n = [], MIN_CONTEXT_BUCKET
    while n < max_context:
        sizes.append(align(n))
        n *= 2
    sizes.append(align(max_context))
    return sorted(set(sizes))


def key_buckets(max_keys: int) -> list[int]:
    """Powers of two from 1,024 keys, the last covering ``max_keys`` (graphs of backends that
    pack keys)."""
    sizes, n = [], MIN_KEY_BUCKET
    while n < max_keys:
        sizes.append(n)
        n *= 2
    return sizes + [max_keys]


def token_buckets(max_tokens: int, room: int) -> list[int]:
    """Powers of two from 16 below ``max_tokens`` (the token budget), ``max_tokens``, and
    ``max_tokens + room``: ``room`` (one more than the most requests) lets a step that fills the
    budget still take its pad requests."""
    sizes, n = [], MIN_TOKEN_BUCKET
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens, max_tokens + room]


def request_buckets(max_requests: int) -> list[int]:
    """Powers of two up to ``max_requests``, then ``max_requests + 1``: a step of every request
    still has room for a pad request."""
    sizes, n = [], 1
    while n <= max_requests:
        sizes.append(n)
        n *= 2
    return sizes + [max_requests + 1]


def bucket_max_q(token_bucket: int, max_chunk: int) -> int:
    """The kernels' ``max_q`` in a bucket: the longest chunk the scheduler gives, and at least
    half the bucket, so that one pad request can take the spare tokens of any step that did not
    fit the bucket below."""
    return min(token_bucket, max(max_chunk, token_bucket // 2))


def pad_requests(tokens: int, requests: int, token_bucket: int, request_bucket: int, max_q: int) -> list[int] | None:
    """How many tokens each pad request gets so that a step of ``tokens`` and ``requests`` fills
    (``token_bucket``, ``request_bucket``) — every pad request at least one and at most
    ``max_q`` — or None if the bucket cannot be filled so."""
    pads, spare = request_bucket - requests, token_bucket - tokens
    if pads < 0 or spare < 0:
        return None
    if pads == 0:
        return [] if spare == 0 else None
    if not pads <= spare <= pads * max_q:
        return None
    base, extra = divmod(spare, pads)
    return [base + 1] * extra + [base] * (pads - extra)
