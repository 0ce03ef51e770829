"""Pieces of the API's answers: ids, finish reasons, usage and the two logprobs shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any

from qil_worker.service.front_request import FrontRequest
from qil_worker.service.protocol import FinishReason

_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    # (ended by the server: a drain past its grace period; vLLM says the same)
    FinishReason.CANCELLED: "abort",
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created() -> int:
    return int(time.time())


def finish_reason(req: FrontRequest) -> str | None:
    final = req.final
    return None if final is None else _FINISH.get(final.reason, "error")


def output_text(req: FrontRequest, start: int, end: int) -> str:
    """The text that the tokens ``start:end`` released, with the end's own at the end; empty
    without a tokenizer (the worker sends no text then: ask for token ids)."""
    if req.texts is None:
        return ""
    text = "".join(req.texts[start:end])
    if req.final is not None and end == len(req.tokens):
        text += "".join(e.text for e in req.ends)  # (one request per sample: one end)
    return text


def usage(first_samples: list[FrontRequest], every: list[FrontRequest], output: bool = True) -> dict[str, Any]:
    """The prompt counted once per prompt (the first sample of each), the output of all
    (``output`` False: none was answered)."""
    prompt = sum(r.prompt_len for r in first_samples)
    completion = sum(len(r.tokens) for r in every) if output else 0
    cached = sum(r.final.num_cached_tokens if r.final is not None else r.cached_tokens for r in first_samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def prompt_part(prompt_ids: list[int], req: FrontRequest, strings: dict[int, str]) -> dict[str, list]:
    """The echoed prompt's part of completion logprobs: its first token unscored (null), each
    later one scored under the raw model (``prompt_logprobs``); offsets from the token strings."""
    scored = req.prompt_logprobs
    lps: list = [None] + (list(scored.logprobs) if scored is not None else [None] * (len(prompt_ids) - 1))
    tops: list = [None]
    for i, t in enumerate(prompt_ids[1:]):
        cands = scored.top[i] if scored is not None and scored.top else []
        tops.append({**{strings[c]: clp for c, clp in cands}, strings[t]: lps[i + 1]})
    offsets, offset = [], 0
    for t in prompt_ids:
        offsets.append(offset)
        offset += len(strings[t])
    return {"tokens": [strings[t] for t in prompt_ids], "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def completion_logprobs(req: FrontRequest, start: int, end: int, strings: dict[int, str],
                        offset: int, prompt: dict[str, list] | None = None) -> dict[str, Any]:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` of tokens ``start:end`` (after
    the echoed ``prompt``'s, when given); each top_logprobs entry includes the sampled token, as
    the API's does."""
    tokens = req.tokens[start:end]
    lps = req.logprobs[start:end] if req.logprobs is not None else [None] * len(tokens)
    tops = req.top[start:end] if req.top is not None else [[] for _ in tokens]
    texts = req.texts[start:end] if req.texts is not None else [""] * len(tokens)
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    out = {
        "tokens": [strings[t] for t in tokens],
        "token_logprobs": lps,
        "top_logprobs": [
            {**{strings[c]: clp for c, clp in top}, strings[t]: lp} for t, lp, top in zip(tokens, lps, tops)
        ],
        "text_offset": offsets,
    }
    if prompt is not None:
        out = {k: prompt[k] + out[k] for k in out}
    return out


def chat_logprobs(req: FrontRequest, start: int, end: int, strings: dict[int, str]) -> dict[str, Any]:
    """``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``; a
    token's bytes are those of its string (a token that ends inside a character has the
    replacement character's)."""
    tokens = req.tokens[start:end]
    lps = req.logprobs[start:end] if req.logprobs is not None else [0.0] * len(tokens)
    tops = req.top[start:end] if req.top is not None else [[] for _ in tokens]

    def entry(t: int, lp: float) -> dict[str, Any]:
        s = strings[t]
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(c, clp) for c, clp in top]}
            for t, lp, top in zip(tokens, lps, tops)
        ],
        "refusal": None,
    }


def ids_for_strings(req: FrontRequest, start: int, end: int) -> set[int]:
    """The token ids whose strings a logprobs answer of ``start:end`` needs."""
    ids = set(req.tokens[start:end])
    scored = req.prompt_logprobs
    if start == 0 and scored is not None and scored.top:
        for top in scored.top:
            ids.update(c for c, _ in top)
    if req.top is not None:
        for top in req.top[start:end]:
            ids.update(c for c, _ in top)
    return ids
