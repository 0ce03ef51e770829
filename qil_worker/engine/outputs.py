"""What the engine hands back: per-token events and per-request results."""

from __future__ import annotations

import enum
from dataclasses import MISSING, dataclass, field, fields


class FinishReason(str, enum.Enum):
    """Why a request ended. ``str`` values keep them readable in logs and JSON."""

    # an EOS id of the model or a stop id of the request was produced, a stop string appeared,
    # or a constrained output became complete (its grammar allows nothing more)
    STOP = "stop"
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def label(self) -> str:
        """The name used in logs and metric labels (``"stop"``...)."""
        return self.value

    @property
    def number(self) -> int:
        """Its number in ``qil.v1.FinishReason`` (the wire's)."""
        return _NUMBERS[self]

    @classmethod
    def of_number(cls, number: int) -> "FinishReason":
        return _REASONS[number]


_NUMBERS = {FinishReason.STOP: 1, FinishReason.LENGTH: 2, FinishReason.CANCELLED: 3, FinishReason.ERROR: 4}
_REASONS = {number: reason for reason, number in _NUMBERS.items()}


@dataclass(frozen=True)
class Event:
    """One step's news about one request.

    A token event has ``token_id`` and its ``index`` in the output. The final event of a request
    has ``finished=True``, a ``finish_reason`` and the request's ``result``; it carries the
    last token when the request ended by producing one, and ``token_id=None`` when it was
    cancelled or failed.
    Log-probabilities are those of the distribution the token was drawn from: after a
    constraint's mask (forbidden tokens have probability 0, so the allowed ones sum to 1),
    logit_bias, penalties and temperature, before top-k/top-p/min-p truncation. The request's
    first token event carries ``prompt_logprobs`` when it asked for them (raw model, see
    ``prompt_logprobs``).
    """

    request_id: str
    token_id: int | None
    index: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprob: float | None = None  # of ``token_id``, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # the N most likely (id, logprob)
    text: str | None = None  # new text (whole characters) when the engine has a tokenizer
    # on a STOP final event: the token id or stop string; None when a constrained output ended
    # because its structure was complete
    stop_reason: int | str | None = None
    result: "Result | None" = None  # on a final event: the request as it ended
    # On the first token event of a request that asked: entry i scores prompt token i + 1
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None  # the N best there (N > 0)
    # With several samples (``n``) each event is of one sample, and a final event ends that
    # sample only: the request ends with the final event after which no other sample runs.
    sample_index: int = 0
    samples_running: int = 0  # other samples of the request not finished after this event

    @property
    def request_finished(self) -> bool:
        """Whether the request as a whole ended with this event (its last sample's end)."""
        return self.finished and self.samples_running == 0

    @classmethod
    def of_token(
        cls,
        request_id: str,
        token_id: int,
        index: int,
        finish_reason: "FinishReason | None",
        logprob: float | None,
        top_logprobs: list[tuple[int, float]] | None,
        text: str | None,
        stop_reason: int | str | None,
        result: "Result | None",
    ) -> "Event":
        """``Event(request_id, token_id, index, finish_reason is not None, finish_reason, None,
        logprob, top_logprobs, text, stop_reason, result)``, the engine's token event, made by
        giving the instance a filled dict at once: a frozen dataclass's ``__init__`` sets each
        of its fields through ``object.__setattr__``, and the engine makes one event per request
        per step."""
        values = _EVENT_DEFAULTS.copy()
        values["request_id"] = request_id
        values["token_id"] = token_id
        values["index"] = index
        if finish_reason is not None:
            values["finished"] = True
            values["finish_reason"] = finish_reason
        if logprob is not None:
            values["logprob"] = logprob
        if top_logprobs is not None:
            values["top_logprobs"] = top_logprobs
        values["text"] = text
        if stop_reason is not None:
            values["stop_reason"] = stop_reason
        if result is not None:
            values["result"] = result
        event = _new(cls)
        _set_attribute(event, "__dict__", values)
        return event


_new = object.__new__
_set_attribute = object.__setattr__  # past the frozen dataclass's refusal

# every field of ``Event`` at its default (None for the three without), in field order
_EVENT_DEFAULTS = {f.name: None if f.default is MISSING else f.default for f in fields(Event)}


@dataclass
class RequestMetrics:
    """Timings measured in the engine (seconds, ``time.perf_counter`` clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    max_inter_token_latency: float = 0.0
    num_preemptions: int = 0

    def record_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None and now - self.last_token_time > self.max_inter_token_latency:
            self.max_inter_token_latency = now - self.last_token_time
        self.last_token_time = now


@dataclass(frozen=True)
class Result:
    """A request as it stands: its tokens, why it ended and how fast it went."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: FinishReason | None
    error: str | None
    queue_time: float | None
    ttft: float | None
    completion_time: float | None
    mean_inter_token_latency: float | None
    max_inter_token_latency: float | None
    num_preemptions: int = 0
    finished: bool = field(default=False)
    num_cached_tokens: int = 0
    output_text: str | None = None
    stop_reason: int | str | None = None
    # When asked for and the prompt was scored (see ``Event``): entry i scores prompt token i + 1
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    sample_index: int = 0  # which sample of an n-request this is
    # a pooled request's answer (``spec.Pooling``): its embedding, or its score
    embedding: list[float] | None = None
    score: float | None = None

    @classmethod
    def of(
        cls,
        request_id: str,
        prompt: list[int],
        output: list[int],
        finish_reason: FinishReason | None,
        error: str | None,
        m: RequestMetrics,
        num_cached_tokens: int = 0,
        output_text: str | None = None,
        stop_reason: int | str | None = None,
        prompt_logprobs: list[float] | None = None,
        prompt_top_logprobs: list[list[tuple[int, float]]] | None = None,
        sample_index: int = 0,
        embedding: list[float] | None = None,
        score: float | None = None,
    ) -> "Result":
        def since_arrival(t: float | None) -> float | None:
            return None if t is None else t - m.arrival_time

        mean_itl = None
        if m.first_token_time is not None and m.last_token_time is not None and len(output) > 1:
            mean_itl = (m.last_token_time - m.first_token_time) / (len(output) - 1)
        return cls(
            request_id=request_id,
            prompt_token_ids=list(prompt),
            output_token_ids=list(output),
            finish_reason=finish_reason,
            error=error,
            queue_time=since_arrival(m.first_scheduled_time),
            ttft=since_arrival(m.first_token_time),
            completion_time=since_arrival(m.finished_time),
            mean_inter_token_latency=mean_itl,
            max_inter_token_latency=m.max_inter_token_latency if len(output) > 1 else None,
            num_preemptions=m.num_preemptions,
            finished=finish_reason is not None,
            num_cached_tokens=num_cached_tokens,
            output_text=output_text,
            stop_reason=stop_reason,
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_top_logprobs,
            sample_index=sample_index,
            embedding=embedding,
            score=score,
        )
