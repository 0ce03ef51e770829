"""The worker's answers to the tokenizer calls (``Tokenize`` / ``Detokenize`` RPCs).

They run where the tokenizer lives (see ``startup._load_tokenizer``): short ones in the step loop,
long ones on the prompt-encoding thread (``prompt_encoder``). Each answer is total: a failure is
its ``rejection``, classified as a submit's (``errors.classify_engine_error``), so a Tokenize
and a Submit of the same prompt fail with the same status and field.
"""

from __future__ import annotations

from typing import Any

from qil_worker.errors import InvalidRequestError, TokenizerUnavailableError
from qil_worker.service import protocol as P
from qil_worker.service.errors import classify_engine_error
from qil_worker.text.prompt import PromptTooLong, encode_prompt, tokenize_refusal

INLINE_IDS = 4096  # detokenizing up to this many ids (a few ms) stays in the step loop


def tokenize(tokenizer: Any, call: P.Tokenize) -> P.Tokenized:
    """The ids a ``Submit`` of the same prompt would get (``encode_prompt``, the same code)."""
    try:
        if tokenizer is None:
            field = "messages" if call.messages is not None else "text"
            raise TokenizerUnavailableError("this server has no tokenizer", field=field)
        if call.text is None and call.messages is None:
            return P.Tokenized(call.call_id, [])  # the empty prompt (a Submit refuses it)
        try:
            ids = encode_prompt(tokenizer, call.text, call.messages, call.enable_thinking, call.max_tokens, call.tools)
        except PromptTooLong as too_long:
            assert call.max_tokens is not None
            field = "messages" if call.messages is not None else "text"
            message = tokenize_refusal(too_long.at_least, call.max_tokens, too_long.exact)
            raise InvalidRequestError(field, message) from None
        return P.Tokenized(call.call_id, ids)
    except Exception as exc:  # noqa: BLE001 - every failure is the caller's answer
        return P.Tokenized(call.call_id, None, P.Rejection(*classify_engine_error(exc)))


def detokenize(tokenizer: Any, vocab_size: int, call: P.Detokenize) -> P.Detokenized:
    """The text of ``call.token_ids`` as output text is decoded (no clean-up of spaces)."""
    try:
        if tokenizer is None:
            raise TokenizerUnavailableError("this server has no tokenizer", field="token_ids")
        ids = call.token_ids
        if ids and max(ids) >= vocab_size:  # uint32 on the wire: none is negative
            bad = next(i for i, t in enumerate(ids) if t >= vocab_size)
            raise InvalidRequestError(
                "token_ids", f"token_ids[{bad}] = {ids[bad]} is not in [0, {vocab_size})"
            )
        text = tokenizer.decode(
            ids, skip_special_tokens=call.skip_special_tokens, clean_up_tokenization_spaces=False
        )
        return P.Detokenized(call.call_id, text)
    except Exception as exc:  # noqa: BLE001 - every failure is the caller's answer
        return P.Detokenized(call.call_id, None, P.Rejection(*classify_engine_error(exc)))
