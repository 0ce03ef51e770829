"""A request's state: tokens known, tokens computed, pages held, where it is in its life."""

from __future__ import annotations

import enum
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qil_worker.engine.outputs import FinishReason, RequestMetrics, Result
from qil_worker.engine.prompt_logprobs import PromptLogprobs
from qil_worker.engine.sampling_params import SamplingParams
from qil_worker.kv.page_table import PageTable
from qil_worker.text.output import TextOutput

if TYPE_CHECKING:
    from qil_worker.engine.spec import Pooling
    from qil_worker.structured.matcher import ConstraintMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages (new, or preempted to recompute later)
    RUNNING = "running"  # admitted, holds pages for its computed tokens
    FINISHED = "finished"  # ended for good; holds no pages
    UNFORKED = "unforked"  # a later sample of an n-request, in no queue until sample 0 forks it


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler reads of a request's ``SamplingParams`` in every step, derived once."""

    greedy: bool
    divisor: float  # what the row's logits are divided by: the temperature, 1.0 when greedy
    truncated: bool  # top-k, top-p or min-p
    # temperature and truncation are all: no logit_bias, penalties, min_new_tokens or logprobs
    plain: bool
    # penalties or min_new_tokens: the next step's logits depend on the output read on the host
    reads_output: bool

    @classmethod
    def of(cls, p: SamplingParams) -> "SamplingRow":
        return cls(
            greedy=p.greedy,
            divisor=1.0 if p.greedy else p.temperature,
            truncated=p.truncated,
            plain=not (p.logit_bias or p.penalized or p.min_new_tokens or p.logprobs or p.top_logprobs),
            reads_output=bool(p.penalized or p.min_new_tokens),
        )


@dataclass(eq=False)
class Request:
    """Prompt plus generated tokens, of which the first ``num_computed_tokens`` are in the KV cache.

    There is no prefill or decode phase: the scheduler simply lets ``num_computed_tokens`` catch
    up with ``num_tokens``; whenever it does, the next token is sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]  # ids that end the request: its own, plus EOS unless ignored
    page_table: PageTable
    metrics: RequestMetrics
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0  # the sampling seed in force: the request's own, or one drawn at submit
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    page_hashes: list[int] = field(default_factory=list)  # chained hashes of full prompt pages
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    admitted_seq: int = -1  # admission order: the most recent one is preempted first
    times_bypassed: int = 0  # waiting: how often a later request was admitted first (shortest-first)
    text: TextOutput | None = None  # streamed text, when the engine has a tokenizer
    # structured output: where the output is in its grammar; every accepted token advances it
    grammar: "ConstraintMatcher | None" = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # collected while the prompt is computed, if asked
    sample_index: int = 0  # which of the request's samples this is (``engine.samples``)
    group: "SampleGroup | None" = None  # the request's samples when it has several
    # a prefill-only request (embedding, score): no token is sampled; its answer is ``pooled``
    pooling: "Pooling | None" = None
    pooled: list[float] | float | None = None
    # Overlapped steps (``engine.in_flight``): the row of this request's token in the step still
    # on the device, whose value the host does not know yet (-1: none). That token counts in
    # ``num_tokens`` (the scheduler gives it its decode row) but is not in ``output_token_ids``.
    in_flight_row: int = -1
    # ``sampling`` as the sampler reads it every step (``sampling`` is fixed from construction on)
    sampling_row: SamplingRow = field(init=False, repr=False)
    # the sampler's hash state of ``seed`` for its draws, with the seed it is of (``sampler.draws_for``)
    draw_hash: "tuple[int, Any] | None" = field(default=None, init=False, repr=False)

    # ``page_ids``' copy of the page table, and the list it copies
    _page_ids: array = field(default_factory=lambda: array("q"), init=False, repr=False)
    _page_list: list[int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.sampling_row = SamplingRow.of(self.sampling)
        # set here, not left to the class default: an attribute that only some instances carry
        # slows every attribute read of every request (CPython's shared instance layout)
        self.draw_hash = None

    def page_ids(self) -> array:
        """The page table's pages as an int64 ``array`` (for a step's tensors), kept from step to
        step: a page table's list only grows (``PageTable.grow``) until it is replaced by another
        (released, forked, matched in the prefix cache), so only the pages added since the last
        call are converted."""
        pages = self.page_table.pages
        ids = self._page_ids
        if pages is not self._page_list or len(ids) > len(pages):
            ids = self._page_ids = array("q", pages)
            self._page_list = pages
        elif len(ids) < len(pages):
            ids.extend(pages[len(ids) :])
        return ids

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt, output, and the one in flight (if any)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + (self.in_flight_row >= 0)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, the one in flight included: the index of the next draw."""
        return len(self.output_token_ids) + (self.in_flight_row >= 0)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output, without building the whole list."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : end - len(prompt)]
        return prompt[start:] + self.output_token_ids[: end - len(prompt)]

    def token_at(self, position: int) -> int:
        """Token ``position`` of prompt + output."""
        prompt = self.prompt_token_ids
        if position < len(prompt):
            return prompt[position]
        return self.output_token_ids[position - len(prompt)]

    def result(self) -> Result:
        return Result.of(
            self.request_id,
            self.prompt_token_ids,
            self.output_token_ids,
            self.finish_reason,
            self.error,
            self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            output_text=self.text.text if self.text is not None else None,
            stop_reason=self.stop_reason,
            **self._prompt_logprobs(),
            sample_index=self.sample_index,
            **self._pooled(),
        )

    def _pooled(self) -> dict[str, object]:
        if self.pooled is None:
            return {}
        return {"score": self.pooled} if isinstance(self.pooled, float) else {"embedding": self.pooled}

    def _prompt_logprobs(self) -> dict[str, object]:
        scored = self.prompt_logprobs
        if scored is None or not scored.complete:
            return {}
        return {"prompt_logprobs": scored.logprobs, "prompt_top_logprobs": scored.top}


@dataclass(eq=False)
class SampleGroup:
    """The samples of one request, sample ``i`` at ``members[i]``."""

    members: list["Request"]
    unforked: list["Request"] = field(default_factory=list)  # samples 1.. until sample 0 forks

    def running_after(self, request: "Request") -> int:
        """How many samples other than ``request`` are not finished."""
        return sum(1 for m in self.members if m is not request and not m.finished)


def members(request: "Request") -> list["Request"]:
    """Every sample of the request ``request`` belongs to (itself alone when ``n == 1``)."""
    return [request] if request.group is None else request.group.members


def unforked(request: "Request") -> list["Request"]:
    """The samples waiting for ``request`` (sample 0) to fork them; empty once forked."""
    return request.group.unforked if request.group is not None and request.sample_index == 0 else []
