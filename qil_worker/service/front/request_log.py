"""The front's view of one request (``FrontRequest``; the engine's ``Request`` is the worker's),
and how long finished ones stay for late subscribers (``Retention``).

A request's log is its list of output tokens plus, once over, its final record (with several
samples, ``n``: the tokens of all samples in the order they came, each marked with its sample,
and one end per sample, placed where it happened in that order). Whoever follows
it registers a ``Listener`` and keeps only a cursor into the log (``streams.Subscription``), so a
slow reader costs no memory beyond the log itself (bounded by max_new_tokens). The request
notifies its listeners whenever it changes; nothing else changes it.
"""

from __future__ import annotations

import collections
import time
from typing import TYPE_CHECKING, NamedTuple, Protocol

from qil_worker.service.protocol import FinalRecord, FinishReason, ScoredPrompt
from qil_worker.structured.spec import TOOL_CALLS
from qil_worker.structured.tool_grammar import parses_calls
from qil_worker.text.assistant_output import AssistantOutput, Part

if TYPE_CHECKING:
    from qil_worker.engine.spec import RequestSpec


class Listener(Protocol):
    def request_changed(self, req: "FrontRequest") -> None:
        """New output, or the end."""

    def request_lost(self, req: "FrontRequest") -> None:
        """It ended because the worker died."""


class SampleEnd(NamedTuple):
    """How one sample ended, and where in its request's log."""

    position: int  # the request's token count when it ended: the sample's tokens all precede it
    sample: int
    record: FinalRecord
    text: str  # text released by the end itself (no token of its own)
    parts: tuple[Part, ...] = ()  # the assistant parts the end released (``FrontRequest.parts``)


class FrontRequest:
    """One request as the front sees it: its output so far and, once over, its final record.

    Per output token i: ``tokens[i]``, and when the worker sends them ``texts[i]`` (the text
    delta that token released), ``logprobs[i]`` and ``top[i]``. Parallel lists, so a reader
    starting at any cursor gets aligned slices. ``prompt_logprobs`` arrive with token 0 and go
    out with whichever event starts at seq 0. With ``n`` samples, ``samples[i]`` is the sample
    of token i (None while every token is sample 0), ``ends`` each sample's end, and ``final``
    (the request's end) is the record of the sample that ended last. For a chat prompt
    (``assistant`` set) with texts, ``parts[i]`` is what token i's text added to its sample's
    split into reasoning, content and calls (``text.assistant_output``), computed once here so
    every reader streams the same deltas from any cursor.
    """

    __slots__ = (
        "rid", "prompt_len", "n", "tokens", "samples", "texts", "logprobs", "top", "ends", "final",
        "lost", "cached_tokens", "prompt_logprobs", "assistant", "parts", "_splitters", "_listeners",
    )

    def __init__(self, rid: str, prompt_len: int, n: int = 1) -> None:
        self.rid = rid
        self.prompt_len = prompt_len  # the worker's count once it accepted the prompt
        self.n = max(1, n)
        self.tokens: list[int] = []
        self.samples: list[int] | None = None
        self.texts: list[str] | None = None  # None: the worker has no tokenizer
        self.logprobs: list[float] | None = None  # None: not asked for
        self.top: list[list[tuple[int, float]]] | None = None
        self.ends: list[SampleEnd] = []  # in the order the samples ended
        self.final: FinalRecord | None = None  # how it ended, once it has
        self.lost = False  # ended because the worker died
        self.cached_tokens = 0  # prompt tokens from the prefix cache, once its first token came
        self.prompt_logprobs: ScoredPrompt | None = None  # asked for, and the prompt is scored
        # a chat prompt's: whether its output's tool-call blocks are calls (None: not a chat
        # prompt, its output is not split; ``assistant_split``)
        self.assistant: bool | None = None
        self.parts: list[tuple[Part, ...]] | None = None  # per token, with texts, when assistant is set
        self._splitters: dict[int, AssistantOutput] = {}  # per sample, while it runs
        self._listeners: set[Listener] = set()

    def listen(self, listener: Listener) -> None:
        self._listeners.add(listener)

    def unlisten(self, listener: Listener) -> None:
        self._listeners.discard(listener)

    def accepted(self, num_prompt_tokens: int) -> None:
        """The worker took it: the prompt's length is known once the worker encoded it (text
        and chat prompts are tokenized there)."""
        self.prompt_len = num_prompt_tokens

    def append(
        self, token: int, text: str | None, logprob: float | None, top: list | None,
        final: FinalRecord | None = None, sample: int = 0,
    ) -> None:
        """One event of the worker for one ``sample``: a token (``token >= 0``) or the end's own
        text, and the final record when the sample ended with it."""
        if text is not None and self.texts is None:
            self.texts = [""] * len(self.tokens)
            if self.assistant is not None:
                self.parts = [()] * len(self.tokens)
        if token >= 0:
            self.tokens.append(token)
            if sample or self.samples is not None:
                if self.samples is None:
                    self.samples = [0] * (len(self.tokens) - 1)
                self.samples.append(sample)
            if self.texts is not None:
                self.texts.append(text or "")
            if self.parts is not None:
                self.parts.append(self._split(sample, text or "", ended=False))
            if logprob is not None:
                if self.logprobs is None:
                    self.logprobs = [0.0] * (len(self.tokens) - 1)
                self.logprobs.append(logprob)
            if top is not None:
                if self.top is None:
                    self.top = [[] for _ in range(len(self.tokens) - 1)]
                self.top.append(top)
        if final is not None:
            own = (text or "") if token < 0 else ""
            parts = self._split(sample, own, ended=True) if self.parts is not None else ()
            self.ends.append(SampleEnd(len(self.tokens), sample, final, own, parts))
            if len(self.ends) >= self.n:
                self.final = final
        for listener in list(self._listeners):
            listener.request_changed(self)

    def fail(self, error: str) -> None:
        """End it here, in the front, with an error (the worker refused it)."""
        self._end_all(error)
        for listener in list(self._listeners):
            listener.request_changed(self)

    def lose(self, error: str) -> None:
        """End it because the worker died."""
        self.lost = True
        self._end_all(error)
        for listener in list(self._listeners):
            listener.request_lost(self)

    def _end_all(self, error: str) -> None:
        """End every sample not ended yet with an error, and so the request."""
        ended = {end.sample for end in self.ends}
        for sample in range(self.n):
            if sample not in ended:
                parts = self._split(sample, "", ended=True) if self.parts is not None else ()
                self.ends.append(SampleEnd(len(self.tokens), sample, self._error_record(error, sample), "", parts))
        self.final = self.ends[-1].record

    def _split(self, sample: int, text: str, ended: bool) -> tuple[Part, ...]:
        """What ``text`` adds to ``sample``'s split (and, ``ended``, what the split held back)."""
        splitter = self._splitters.get(sample)
        if splitter is None:
            splitter = self._splitters[sample] = AssistantOutput(tools=bool(self.assistant))
        parts = splitter.feed(text) if text else []
        if ended:
            parts += splitter.finish()
            del self._splitters[sample]
        return tuple(parts)

    def _error_record(self, error: str, sample: int = 0) -> FinalRecord:
        if self.samples is None:
            produced = len(self.tokens) if sample == 0 else 0
        else:
            produced = self.samples.count(sample)
        return FinalRecord(
            reason=FinishReason.ERROR, error=error, num_prompt_tokens=self.prompt_len,
            num_output_tokens=produced, num_cached_tokens=self.cached_tokens, stop_reason=None,
            metrics=None,
        )


def retained_size(req: FrontRequest) -> int:
    """What keeping a finished request costs, in token-equivalents: each output token, plus one
    per top-logprob candidate it carries (those dominate: ~100 bytes each in Python objects);
    the same for each scored prompt token."""
    width = len(req.top[0]) if req.top else 0
    size = len(req.tokens) * (1 + width)
    scored = req.prompt_logprobs
    if scored is not None:
        size += len(scored.logprobs) * (1 + (len(scored.top[0]) if scored.top else 0))
    return max(1, size)


class Retention:
    """Which finished requests stay for late subscribers: the newest ones, within a count, a
    token-equivalent size (``retained_size``) and an age. Oldest first out."""

    def __init__(self, max_count: int, max_size: int, max_age_s: float) -> None:
        self.max_count = max_count
        self.max_size = max_size
        self.max_age_s = max_age_s
        self._kept: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()
        self.size = 0  # the sum of the kept requests' sizes

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, req: FrontRequest) -> list[str]:
        """Keep ``req`` (finished now); returns the ids that no longer fit, oldest first."""
        self.forget(req.rid)
        size = retained_size(req)
        self._kept[req.rid] = (time.monotonic(), size)
        self.size += size
        return self.expired()

    def forget(self, rid: str) -> None:
        entry = self._kept.pop(rid, None)
        if entry is not None:
            self.size -= entry[1]

    def expired(self) -> list[str]:
        """Drop and return the oldest kept ids beyond the count, size or age bounds."""
        cutoff = time.monotonic() - self.max_age_s
        dropped = []
        while self._kept and (
            len(self._kept) > self.max_count
            or self.size > self.max_size
            or next(iter(self._kept.values()))[0] < cutoff
        ):
            rid = next(iter(self._kept))
            self.forget(rid)
            dropped.append(rid)
        return dropped


def assistant_split(spec: RequestSpec) -> bool | None:
    """How a request's output is split into reasoning, content and calls (``FrontRequest
    .assistant``): not at all for a prompt that is not chat messages; calls parsed when its
    tool calls are constrained (tools given, their choice not none)."""
    if spec.prompt.messages is None:
        return None
    constraint = spec.constraint
    return constraint is not None and constraint.kind == TOOL_CALLS and parses_calls(str(constraint.value))
