"""The checks of a request that need the model and the pool (the rest are ``RequestSpec``'s),
each failing with the field it concerns."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from qil_worker.config import Qwen3Config
from qil_worker.errors import CapacityError, InvalidRequestError
from qil_worker.kv.page_table import pages_for


def token_list(field: str, values: Sequence[int], vocab_size: int) -> list[int]:
    """Integers in ``[0, vocab_size)`` as a plain list."""
    if isinstance(values, (str, bytes)):
        raise InvalidRequestError(field, "expected a sequence of token ids, got a string")
    try:
        ids = [operator.index(v) for v in values]
    except TypeError:
        raise InvalidRequestError(field, "token ids must be integers") from None
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if t < 0 or t >= vocab_size)
        raise InvalidRequestError(field, f"token id {bad} is outside [0, {vocab_size})")
    return ids


def validate_submit(
    token_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    config: Qwen3Config,
    num_pages: int,
    page_size: int,
    prompt_field: str = "token_ids",
) -> tuple[list[int], list[int]]:
    """The prompt and stop ids of a ``RequestSpec`` (already valid in itself) as lists, checked
    against the model and the pool: ``InvalidRequestError``/``CapacityError``, naming
    ``prompt_field`` (the prompt's form) when the prompt alone cannot fit."""
    prompt = token_list("token_ids", token_ids, config.vocab_size)
    if not prompt:
        raise InvalidRequestError("token_ids", "the prompt is empty")
    stops = token_list("stop_token_ids", stop_token_ids, config.vocab_size)
    total = len(prompt) + max_new_tokens
    if total > config.max_position_embeddings:
        raise CapacityError.positions(len(prompt), max_new_tokens, config.max_position_embeddings, prompt_field)
    # The last generated token is never fed back, so it needs no KV slot.
    needed = pages_for(total - 1, page_size)
    if needed > num_pages:
        raise CapacityError(
            prompt_field if pages_for(len(prompt), page_size) > num_pages else "max_new_tokens",
            f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) needs {needed} KV pages "
            f"but the whole pool has {num_pages} (page size {page_size})",
        )
    return prompt, stops
