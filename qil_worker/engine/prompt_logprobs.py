"""Prompt log-probabilities: what a request that asks for them collects while its prompt is computed.

The logit at prompt position p scores prompt token p + 1, so every chunk of a prompt scores all
of its positions but the prompt's very last, whose logit is the one the first output token is
sampled from (the last position of a chunk scores the first token of the next chunk: that token
is known, it is the prompt). The step batch asks the model for logits at those positions in the
same LM-head call as the sampled rows (``batch.build_step_inputs``: sampled rows first, then
these), and only for requests that asked: a step without them computes nothing more.

Exactly once per position: positions already scored are not scored again when a preempted
request recomputes them, and the scheduler lets a request take cached prefix pages only up to
the positions it has scored (``Scheduler._shareable_pages``), so a prompt served from the prefix
cache is recomputed, never refused. The request still publishes its own pages to the cache.

The values are ``log_softmax`` of the raw logits in float32: no logit_bias, penalties or
temperature — the model's own distribution, as an evaluation harness scores text with. They are
delivered on the request's first token event (and kept in its ``Result``).

A decode-only step never has such positions (a one-token chunk that samples starts at or after
the prompt's last position), so the CUDA-graph decode path has nothing to do with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import torch

from qil_worker.engine.outputs import Event
from qil_worker.engine.transfer import to_device
from qil_worker.errors import InvalidRequestError


# Scored positions × (1 + N) of one request at most: its event then stays a few MB (about 17
# bytes a top candidate, 8 a position), well under the wire's message limit and the front's
# retention budget, while N = 0 covers any prompt a Qwen3 context holds (N = 20: 12k tokens).
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18
# Rows whose float32 log_softmax is computed at once: bounds the temporary to this × vocab.
SCORE_ROWS = 128


@dataclass
class PromptLogprobs:
    """One request's prompt log-probabilities so far: entry i scores prompt token i + 1."""

    prompt_len: int
    top_n: int  # alternatives per position (0: only the prompt tokens' own)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] | None = None  # the top_n (id, logprob), most likely first
    delivered: bool = False  # handed out with the first token event

    @classmethod
    def asked(cls, top_n: int | None, prompt_len: int) -> "PromptLogprobs | None":
        """The collector of a request with ``prompt_logprobs=top_n`` (None: not asked for), after
        the size check (``top_n`` itself is validated with the other sampling parameters)."""
        if top_n is None:
            return None
        entries = (prompt_len - 1) * (top_n + 1)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise InvalidRequestError(
                "prompt_logprobs",
                f"{prompt_len - 1} scored prompt tokens x (1 + {top_n}) = {entries} log-probabilities, "
                f"more than the {MAX_PROMPT_LOGPROB_ENTRIES} one request may ask for",
            )
        return cls(prompt_len, top_n, top=[] if top_n else None)

    @property
    def num_scored(self) -> int:
        """Positions ``[0, num_scored)`` are scored."""
        return len(self.logprobs)

    @property
    def complete(self) -> bool:
        return len(self.logprobs) == self.prompt_len - 1

    def positions(self, start: int, end: int) -> range:
        """The positions of a chunk ``[start, end)`` still to score."""
        return range(max(start, len(self.logprobs)), min(end, self.prompt_len - 1))

    def attach(self, event: Event) -> Event:
        """``event`` with the prompt's log-probabilities if it is the request's first token event."""
        if self.delivered or event.token_id is None:
            return event
        self.delivered = True
        return dataclasses.replace(event, prompt_logprobs=self.logprobs, prompt_top_logprobs=self.top)


@dataclass(frozen=True)
class PromptRows:
    """``count`` logit rows of one step scoring a request's ``prompt`` (its token ids) from
    position ``start``, into the request's ``collector``."""

    prompt: list[int]
    collector: PromptLogprobs
    start: int
    count: int


def score(logits: torch.Tensor, spans: list[PromptRows]) -> None:
    """Append the log-probabilities that ``logits`` [sum of counts, vocab] (rows in span order)
    give each span's prompt tokens, and the top-N alternatives, to its request's collector."""
    if not spans:
        return
    device = logits.device
    targets = to_device(
        [t for s in spans for t in s.prompt[s.start + 1 : s.start + 1 + s.count]],
        device, torch.long,
    )
    n_top = min(max(s.collector.top_n for s in spans), logits.shape[1])
    chosen_parts, value_parts, id_parts = [], [], []
    for first in range(0, logits.shape[0], SCORE_ROWS):
        logprobs = torch.log_softmax(logits[first : first + SCORE_ROWS].float(), dim=-1)
        chosen_parts.append(logprobs.gather(1, targets[first : first + SCORE_ROWS, None]).squeeze(1))
        if n_top:
            values, ids = logprobs.topk(n_top, dim=-1)
            value_parts.append(values)
            id_parts.append(ids)
    chosen = torch.cat(chosen_parts).tolist()
    top_values = torch.cat(value_parts).tolist() if n_top else []
    top_ids = torch.cat(id_parts).tolist() if n_top else []
    row = 0
    for s in spans:
        collector = s.collector
        collector.logprobs.extend(chosen[row : row + s.count])
        n = collector.top_n
        if n:
            collector.top.extend(
                list(zip(top_ids[r][:n], top_values[r][:n])) for r in range(row, row + s.count)
            )
        row += s.count
