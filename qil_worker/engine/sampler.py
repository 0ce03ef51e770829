"""Choosing the next token of every sampled request: one batched tensor pipeline per step.

Order: grammar bitmask (structured output) → logit_bias → penalties → min_new_tokens mask →
temperature → [logprobs are read here] → top-k → top-p → min-p → draw (the stages after the
grammar as transformers' processors). Requests with different settings share the batch; each
stage runs only when some request in the step uses it.

Draws use inverse-CDF sampling with one uniform number per request, derived by hashing the
request's seed with the index of the token being drawn. That makes a seeded request's tokens
independent of what else is in the batch and of preemption (a recompute draws the same number
for the same index), and costs no per-request generator on the device.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from qil_worker.engine.request import Request
from qil_worker.engine.transfer import to_device
from qil_worker.structured.bitmask import GrammarMasks


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float | None]  # chosen token's log-probability, per request (None if not asked)
    top_logprobs: list[list[tuple[int, float]] | None]


def uniform_for(seed: int, index: int) -> float:
    """A number in (0, 1) fixed by (seed, index): the request's draw for output token ``index``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") + 0.5) / 2.0**64


class Sampler:
    def __init__(self) -> None:
        self.grammar_masks = GrammarMasks()

    def prepare(self, requests: list[Request], vocab: int) -> None:
        """Before the forward: start what needs only the tokens already accepted (the grammar
        masks of constrained rows, filled beside the forward)."""
        if any(r.grammar is not None for r in requests):
            self.grammar_masks.prepare([r.grammar for r in requests], vocab)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleOutput:
        """``logits`` [S, vocab] (row i belongs to ``requests[i]``) → one token per request.

        The step's only host synchronisation is the final ``tolist``. Each request's
        ``sampling_row`` (derived once) gives what every step needs of it; a batch of ``plain``
        rows skips the logit-bias, penalty, min-tokens and logprob checks altogether.
        """
        rows = [r.sampling_row for r in requests]
        device = logits.device
        logits = logits.float()
        if any(r.grammar is not None for r in requests):
            logits = apply_grammar_masks(logits, requests, self.grammar_masks)
        plain = all(row.plain for row in rows)
        params = [r.sampling for r in requests]
        if not plain:
            if any(p.logit_bias for p in params):
                logits = apply_logit_bias(logits, params)
            if any(p.penalized for p in params):
                logits = apply_penalties(logits, requests)
            logits = mask_stops_before_min_tokens(logits, requests)
        greedy_rows = [row.greedy for row in rows]
        greedy = all(greedy_rows)
        if not greedy:
            temps = to_device([row.divisor for row in rows], device, torch.float32)
            logits = logits / temps[:, None]
        want_logprobs = not plain and any(p.logprobs or p.top_logprobs for p in params)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        if greedy:
            tokens = logits.argmax(dim=-1)
        else:
            some_greedy = any(greedy_rows)
            argmax = logits.argmax(dim=-1) if some_greedy else None  # before truncation, as before the draw
            if any(row.truncated for row in rows):
                logits = truncate(logits, params)
            cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
            # greedy rows take the argmax below: their draw is never read, so none is derived
            u = to_device(
                [0.5 if row.greedy else uniform_for(r.seed, len(r.output_token_ids)) for r, row in zip(requests, rows)],
                device, torch.float32,
            )
            drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
            drawn = drawn.clamp_max(logits.shape[1] - 1)
            if some_greedy:
                tokens = torch.where(to_device(greedy_rows, device, torch.bool), argmax, drawn)
            else:
                tokens = drawn

        if logprobs is None:
            return SampleOutput(tokens.tolist(), [None] * len(requests), [None] * len(requests))
        n_top = min(max(p.top_logprobs for p in params), logits.shape[1])
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        top_values, top_ids = logprobs.topk(n_top, dim=-1) if n_top else (None, None)
        tokens_l, chosen_l = tokens.tolist(), chosen.tolist()
        top_v = top_values.tolist() if n_top else None
        top_i = top_ids.tolist() if n_top else None
        out_lp: list[float | None] = []
        out_top: list[list[tuple[int, float]] | None] = []
        for i, p in enumerate(params):
            out_lp.append(chosen_l[i] if (p.logprobs or p.top_logprobs) else None)
            out_top.append(
                list(zip(top_i[i][: p.top_logprobs], top_v[i][: p.top_logprobs])) if p.top_logprobs else None
            )
        return SampleOutput(tokens_l, out_lp, out_top)


def apply_logit_bias(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Add each row's (token id, bias) pairs to its logits, all rows in one ``index_put``.

    Out of place: the step's logits may be an inference tensor of the forward."""
    rows: list[int] = []
    ids: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            token_ids, values = zip(*p.logit_bias)
            rows.extend([row] * len(token_ids))
            ids.extend(token_ids)
            biases.extend(values)
    device = logits.device
    return logits.index_put(
        (to_device(rows, device, torch.long), to_device(ids, device, torch.long)),
        to_device(biases, device, logits.dtype),
        accumulate=True,
    )


def apply_grammar_masks(logits: torch.Tensor, requests: list[Request], masks: GrammarMasks) -> torch.Tensor:
    """Forbid, in the constrained rows only, every token their grammar does not allow now: first,
    so every later stage (and the logprobs) sees the masked distribution."""
    return masks.apply(logits, [r.grammar for r in requests])


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (prompt + output, transformers' rule) and presence/frequency (output only)."""
    out_rows: list[int] = []
    out_ids: list[int] = []
    prompt_rows: list[int] = []
    prompt_ids: list[int] = []
    for row, r in enumerate(requests):
        if not r.sampling.penalized:
            continue
        out_rows.extend([row] * len(r.output_token_ids))
        out_ids.extend(r.output_token_ids)
        if r.sampling.repetition_penalty != 1.0:
            prompt_rows.extend([row] * len(r.prompt_token_ids))
            prompt_ids.extend(r.prompt_token_ids)
    device = logits.device
    counts = torch.zeros_like(logits)
    if out_ids:
        counts.index_put_(
            (to_device(out_rows, device), to_device(out_ids, device)),
            torch.ones(len(out_ids), device=device),
            accumulate=True,
        )
    seen = counts > 0
    if prompt_ids:
        seen[to_device(prompt_rows, device), to_device(prompt_ids, device)] = True
    params = [r.sampling for r in requests]
    rep = to_device([p.repetition_penalty for p in params], device)[:, None]
    presence = to_device([p.presence_penalty for p in params], device)[:, None]
    frequency = to_device([p.frequency_penalty for p in params], device)[:, None]
    penalized = torch.where(logits < 0, logits * rep, logits / rep)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency * counts - presence * (counts > 0)


def mask_stops_before_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    rows: list[int] = []
    ids: list[int] = []
    for row, r in enumerate(requests):
        if len(r.output_token_ids) < r.sampling.min_new_tokens and r.stop_token_ids:
            rows.extend([row] * len(r.stop_token_ids))
            ids.extend(r.stop_token_ids)
    if not rows:
        return logits
    logits = logits.clone()
    logits[to_device(rows, logits.device), to_device(ids, logits.device)] = float("-inf")
    return logits


def truncate(logits: torch.Tensor, params: list) -> torch.Tensor:
    """top-k, then top-p, then min-p, each with transformers' semantics, per row."""
    vocab = logits.shape[1]
    device = logits.device
    neg_inf = float("-inf")
    if any(p.top_k > 0 for p in params):
        k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device)
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, neg_inf)
    if any(p.top_p < 1.0 for p in params):
        top_p = to_device([p.top_p for p in params], device)[:, None]
        sorted_logits, order = logits.sort(dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1 - top_p
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        logits = logits.masked_fill(remove, neg_inf)
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], device)[:, None]
        probs = logits.softmax(dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(remove, neg_inf)
    return logits
