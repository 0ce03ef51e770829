"""Choosing the next token of every sampled request: one batched tensor pipeline per step.

Order: grammar bitmask (structured output) → logit_bias → penalties → min_new_tokens mask →
temperature → [logprobs are read here] → top-k → top-p → min-p → draw (the stages after the
grammar as transformers' processors). Requests with different settings share the batch; each
stage runs only when some request in the step uses it.

``sample_on_device`` leaves the tokens on the device (``DeviceSample``); reading them is the
step's one host synchronisation, which an overlapped engine does only after launching the next
step.

Draws use inverse-CDF sampling with one uniform number per request, derived by hashing the
request's seed with the index of the token being drawn. That makes a seeded request's tokens
independent of what else is in the batch and of preemption (a recompute draws the same number
for the same index), and costs no per-request generator on the device.
"""

from __future__ import annotations

import copy
import hashlib
import sys
from array import array
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


def draws_for(requests: list[Request], greedy_rows: list[bool]) -> list[float]:
    """Each row's ``uniform_for(seed, num_output_tokens)`` (a row's draw index counts a token
    still in flight), 0.5 for a greedy row, whose draw is never read. Each request keeps the
    hash state of its seed's part of the hashed text (``Request.draw_hash``): copying it costs
    less than a new hash, and the digests convert to numbers in one ``array``."""
    blake2b = hashlib.blake2b
    digests = []
    drawn = []
    for row, (r, greedy) in enumerate(zip(requests, greedy_rows)):
        if greedy:
            continue
        kept = r.draw_hash
        if kept is None or kept[0] != r.seed:  # first draw, or a sample given its own seed since
            kept = r.draw_hash = (r.seed, blake2b(b"%d:" % r.seed, digest_size=8))
        h = kept[1].copy()
        h.update(b"%d" % r.num_output_tokens)
        digests.append(h.digest())
        drawn.append(row)
    values = array("Q")
    values.frombytes(b"".join(digests))
    if sys.byteorder != "little":
        values.byteswap()
    out = [0.5] * len(requests)
    for row, value in zip(drawn, values):
        out[row] = (value + 0.5) / 2.0**64
    return out


class Sampler:
    def __init__(self) -> None:
        self.grammar_masks = GrammarMasks()
        self._ring: BatchRows | None = None  # of the last batch's requests, twice over (``BatchRows``)

    def prepare(self, requests: list[Request], vocab: int) -> None:
        """Before the forward: start what needs only the tokens already accepted (the grammar
        masks of constrained rows, filled beside the forward)."""
        if any(r.grammar is not None for r in requests):
            self.grammar_masks.prepare([r.grammar for r in requests], vocab)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> SampleOutput:
        """``logits`` [S, vocab] (row i belongs to ``requests[i]``) → one token per request, read
        on the host (``sample_on_device`` then ``DeviceSample.read``)."""
        return self.sample_on_device(logits, requests).read()

    def sample_on_device(self, logits: torch.Tensor, requests: list[Request]) -> "DeviceSample":
        """The tokens of ``logits``' rows (and their log-probabilities where asked), left on the
        device: nothing here waits for the device, so a step can be launched and read later.

        What the batch's requests ask (``BatchRows``) is derived once and kept while the steps
        sample the same requests in the same cyclic order; a batch of ``plain`` rows skips the
        logit-bias, penalty, min-tokens and logprob checks altogether.
        """
        device = logits.device
        batch = self._ring.window_for(requests, device) if self._ring is not None else None
        if batch is None:
            self._ring = BatchRows(requests + requests, device, logits.shape[1])
            batch = self._ring.window(0, len(requests))
        logits = logits.float()
        if batch.constrained:
            logits = apply_grammar_masks(logits, requests, self.grammar_masks)
        params = batch.params
        if not batch.plain:
            if batch.biased:
                logits = apply_logit_bias(logits, params)
            if batch.penalized:
                logits = apply_penalties(logits, requests)
            logits = mask_stops_before_min_tokens(logits, requests)
        if batch.temperatures is not None:
            logits = logits / batch.temperatures[:, None]
        logprobs = torch.log_softmax(logits, dim=-1) if batch.asked is not None else None

        if batch.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            argmax = logits.argmax(dim=-1) if batch.greedy_mask is not None else None  # before truncation
            if batch.limits is not None:
                logits = truncate(logits, params, batch.limits)
            cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
            # greedy rows take the argmax below: their draw is never read, so none is derived;
            # a row's draw index counts a token still in flight (overlapped steps)
            u = to_device(draws_for(requests, batch.greedy_rows), device, torch.float32)
            drawn = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1)).squeeze(1)
            drawn = drawn.clamp_max(logits.shape[1] - 1)
            if batch.greedy_mask is not None:
                tokens = torch.where(batch.greedy_mask, argmax, drawn)
            else:
                tokens = drawn

        if logprobs is None:
            return DeviceSample(tokens)
        n_top = min(max(p.top_logprobs for p in params), logits.shape[1])
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        top_values, top_ids = logprobs.topk(n_top, dim=-1) if n_top else (None, None)
        return DeviceSample(tokens, chosen, top_values, top_ids, batch.asked)


class BatchRows:
    """What the sampler reads of a batch's requests that stays the same from step to step (each
    request's ``SamplingParams`` and ``SamplingRow``, whether it is constrained: all fixed at
    submit), with the device tensors made of it.

    The sampler makes one over a batch's requests twice over (a ring) and keeps it while the
    steps sample the same requests in the same cyclic order — the scheduler starts the running
    requests one further every step — each step reading the window of the ring that starts at
    its first request (``window_for``: list slices and tensor views, no device op)."""

    def __init__(self, requests: list[Request], device: torch.device, vocab: int) -> None:
        self.requests = requests
        self.device = device
        rows = [r.sampling_row for r in requests]
        self.params = params = [r.sampling for r in requests]
        self.constrained = any(r.grammar is not None for r in requests)
        self.plain = all(row.plain for row in rows)
        self.biased = not self.plain and any(p.logit_bias for p in params)
        self.penalized = not self.plain and any(p.penalized for p in params)
        self.greedy_rows = [row.greedy for row in rows]
        self.greedy = all(self.greedy_rows)
        # per row (logprobs, top_logprobs), when some row asked for log-probabilities
        self.asked = (
            [(p.logprobs, p.top_logprobs) for p in params]
            if not self.plain and any(p.logprobs or p.top_logprobs for p in params)
            else None
        )
        self.temperatures = None if self.greedy else to_device([row.divisor for row in rows], device, torch.float32)
        self.greedy_mask = (
            to_device(self.greedy_rows, device, torch.bool) if not self.greedy and any(self.greedy_rows) else None
        )
        truncated = not self.greedy and any(row.truncated for row in rows)
        self.limits = TruncationLimits.of(params, vocab, device) if truncated else None

    def window_for(self, requests: list[Request], device: torch.device) -> "BatchRows | None":
        """This ring's rows for ``requests`` when they are its requests in its cyclic order
        (the same objects), else None."""
        ring = self.requests
        n = len(requests)
        if not n or device != self.device or len(ring) != 2 * n:
            return None
        try:
            start = ring.index(requests[0])
        except ValueError:
            return None
        if ring[start : start + n] != requests:
            return None
        return self.window(start, n)

    def window(self, start: int, n: int) -> "BatchRows":
        """Rows ``[start, start + n)`` (the flags, being of the same requests, are the ring's)."""
        rows = slice(start, start + n)
        view = copy.copy(self)
        view.requests = self.requests[rows]
        view.params = self.params[rows]
        view.greedy_rows = self.greedy_rows[rows]
        view.asked = None if self.asked is None else self.asked[rows]
        view.temperatures = None if self.temperatures is None else self.temperatures[rows]
        view.greedy_mask = None if self.greedy_mask is None else self.greedy_mask[rows]
        if self.limits is not None:
            view.limits = TruncationLimits(
                *(None if t is None else t[rows] for t in (self.limits.top_k, self.limits.top_p, self.limits.min_p))
            )
        return view


class DeviceSample:
    """A step's sampled tokens [S] (and log-probabilities where asked) on the device, and their
    way to the host: ``read()`` is the step's one host synchronisation.

    On CUDA the copy to pinned host memory is queued at once, behind the sampling, with an event
    after it: ``read()`` then waits for this step's work only, not for a later step launched
    meanwhile (overlapped scheduling). Elsewhere ``read()`` is a plain ``tolist``."""

    def __init__(
        self,
        tokens: torch.Tensor,
        chosen: torch.Tensor | None = None,
        top_values: torch.Tensor | None = None,
        top_ids: torch.Tensor | None = None,
        asked: list[tuple[bool, int]] | None = None,
    ) -> None:
        """``asked``: per row, (logprobs, top_logprobs) of its request, when any row asked."""
        self.tokens = tokens  # stays on the device: the next step's inputs may be taken from it
        self._asked = asked
        host = [tokens, chosen, top_values, top_ids]
        self._event = None
        if tokens.device.type == "cuda":
            host = [None if t is None else _pinned_copy(t) for t in host]
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens.device))
        self._host = host

    def read(self) -> SampleOutput:
        """The tokens on the host (waits for this step's sampling to end)."""
        if self._event is not None:
            self._event.synchronize()
        tokens, chosen, top_values, top_ids = self._host
        tokens_l = tokens.tolist()
        n = len(tokens_l)
        if self._asked is None:
            return SampleOutput(tokens_l, [None] * n, [None] * n)
        chosen_l = chosen.tolist()
        top_v = top_values.tolist() if top_values is not None else None
        top_i = top_ids.tolist() if top_ids is not None else None
        out_lp: list[float | None] = []
        out_top: list[list[tuple[int, float]] | None] = []
        for i, (logprobs, top) in enumerate(self._asked):
            out_lp.append(chosen_l[i] if (logprobs or top) else None)
            out_top.append(list(zip(top_i[i][:top], top_v[i][:top])) if top else None)
        return SampleOutput(tokens_l, out_lp, out_top)


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied into pinned host memory without waiting (done once the stream gets there)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


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


@dataclass(frozen=True)
class TruncationLimits:
    """Per-row top-k, top-p and min-p limits as device tensors (None: no row uses it)."""

    top_k: torch.Tensor | None  # [S] k, the vocabulary where a row has none
    top_p: torch.Tensor | None  # [S, 1]
    min_p: torch.Tensor | None  # [S, 1]

    @classmethod
    def of(cls, params: list, vocab: int, device: torch.device) -> "TruncationLimits":
        return cls(
            to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device)
            if any(p.top_k > 0 for p in params) else None,
            to_device([p.top_p for p in params], device)[:, None] if any(p.top_p < 1.0 for p in params) else None,
            to_device([p.min_p for p in params], device)[:, None] if any(p.min_p > 0.0 for p in params) else None,
        )


def truncate(logits: torch.Tensor, params: list, limits: TruncationLimits | None = None) -> torch.Tensor:
    """top-k, then top-p, then min-p, each with transformers' semantics, per row (``limits``:
    those of ``params``, made already)."""
    if limits is None:
        limits = TruncationLimits.of(params, logits.shape[1], logits.device)
    neg_inf = float("-inf")
    if limits.top_k is not None:
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (limits.top_k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, neg_inf)
    if limits.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1 - limits.top_p
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(1, order, remove_sorted)
        logits = logits.masked_fill(remove, neg_inf)
    if limits.min_p is not None:
        probs = logits.softmax(dim=-1)
        remove = probs < limits.min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(remove, neg_inf)
    return logits
