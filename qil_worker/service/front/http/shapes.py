"""Pieces of the API's answers: ids, finish reasons, usage and the two logprobs shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any

from qil_worker.service.front.request_log import FrontRequest, SampleEnd
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


def finish_reason(end: SampleEnd | None) -> str | None:
    """The API's finish reason of a sample that ended with ``end`` (None: not yet)."""
    return None if end is None else _FINISH.get(end.record.reason, "error")


def by_sample(req: FrontRequest, start: int, end: int) -> dict[int, list[int]]:
    """The log positions ``start:end`` of each sample (a request of ``n`` samples interleaves
    their tokens in one log)."""
    if req.samples is None:
        return {0: list(range(start, end))} if end > start else {}
    out: dict[int, list[int]] = {}
    for i in range(start, end):
        out.setdefault(req.samples[i], []).append(i)
    return out


def sample_end(req: FrontRequest, sample: int) -> SampleEnd | None:
    return next((e for e in req.ends if e.sample == sample), None)


def output_text(req: FrontRequest, positions: list[int], end: SampleEnd | None) -> str:
    """The text that the tokens at ``positions`` released, and ``end``'s own after them; empty
    without a tokenizer (the worker sends no text then: ask for token ids)."""
    if req.texts is None:
        return ""
    texts = req.texts
    return "".join([texts[i] for i in positions]) + (end.text if end is not None else "")


def usage(reqs: list[FrontRequest], output: bool = True) -> dict[str, Any]:
    """The prompt of each request once (its samples share it), the output of every sample
    (``output`` False: none was answered)."""
    prompt = sum(r.prompt_len for r in reqs)
    completion = sum(len(r.tokens) for r in reqs) if output else 0
    cached = sum(r.final.num_cached_tokens if r.final is not None else r.cached_tokens for r in reqs)
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


def completion_logprobs(req: FrontRequest, positions: list[int], strings: dict[int, str],
                        offset: int, prompt: dict[str, list] | None = None) -> dict[str, Any]:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` of the tokens at ``positions``
    (after the echoed ``prompt``'s, when given); each top_logprobs entry includes the sampled
    token, as the API's does."""
    tokens = [req.tokens[i] for i in positions]
    lps = [req.logprobs[i] for i in positions] if req.logprobs is not None else [None] * len(tokens)
    tops = [req.top[i] for i in positions] if req.top is not None else [[] for _ in tokens]
    texts = [req.texts[i] for i in positions] if req.texts is not None else [""] * len(tokens)
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


def chat_logprobs(req: FrontRequest, positions: list[int], strings: dict[int, str]) -> dict[str, Any]:
    """``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``; a
    token's bytes are those of its string (a token that ends inside a character has the
    replacement character's)."""
    tokens = [req.tokens[i] for i in positions]
    lps = [req.logprobs[i] for i in positions] if req.logprobs is not None else [0.0] * len(tokens)
    tops = [req.top[i] for i in positions] if req.top is not None else [[] for _ in tokens]

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
    """The token ids whose strings a logprobs answer of log positions ``start:end`` needs (the
    prompt's candidates too, with position 0)."""
    ids = set(req.tokens[start:end])
    scored = req.prompt_logprobs
    # (with samples, a sample's first chunk can start later in the log and carry the prompt's)
    if (start == 0 or req.samples is not None) and scored is not None and scored.top:
        for top in scored.top:
            ids.update(c for c, _ in top)
    if req.top is not None:
        for top in req.top[start:end]:
            ids.update(c for c, _ in top)
    return ids
