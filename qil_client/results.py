"""Plain results of the client (the streaming calls yield the generated ``Event`` messages), and
the one place that turns keyword arguments into a ``SubmitRequest``."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator, Mapping, Sequence

from qil_client import constraints
from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client.options import NAMES as OPTION_NAMES
from qil_client.tools import ToolCall, tool_use

FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass(frozen=True)
class Metrics:
    """Measured in the worker, seconds since the request arrived there."""

    queue_time_s: float = 0.0
    ttft_s: float = 0.0
    mean_itl_s: float = 0.0
    max_itl_s: float = 0.0
    e2e_s: float = 0.0
    num_preemptions: int = 0

    @classmethod
    def from_proto(cls, m: pb.RequestMetrics) -> "Metrics":
        return cls(m.queue_time_s, m.ttft_s, m.mean_itl_s, m.max_itl_s, m.e2e_s, m.num_preemptions)


@dataclass(frozen=True)
class Result:
    """A request's outcome. With several samples (``n=``) it is sample 0's, and ``samples``
    holds every sample's own Result in sample order (``samples[0]`` is this one's twin)."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    metrics: Metrics = field(default_factory=Metrics)
    # The output text (the events' text deltas joined); None when the server has no tokenizer.
    text: str | None = None
    # Per output token when asked for: its log-probability, and the most likely (id, logprob).
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # What ended a "stop" request: the token id (int) or the stop string (str).
    stop_reason: int | str | None = None
    # Prompt tokens whose KV came from the server's prefix cache.
    num_cached_tokens: int = 0
    # When asked for (prompt_logprobs=N): entry i is prompt token i + 1's log-probability, and
    # the N most likely (id, logprob) at that position (None for N = 0).
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    sample_index: int = 0
    samples: list["Result"] = field(default_factory=list)  # empty unless the request had n > 1
    # A chat prompt's output split (None otherwise): the reasoning (<think>...</think>), the
    # answer's content without it and without the tool calls, and the calls parsed.
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def usage(self) -> "Usage":
        """The final event's token counts (zeros while the request has not ended)."""
        return Usage(self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens)


@dataclass(frozen=True)
class Usage:
    """What a request used, as its final event counts it (however it ended)."""

    prompt_tokens: int
    cached_prompt_tokens: int  # of prompt_tokens, those served from the prefix cache
    completion_tokens: int  # all output tokens, also those before a replay's from_seq

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenizeResult:
    """A prompt as the server's tokenizer encodes it for a submit (``Client.tokenize``)."""

    token_ids: list[int]
    # The model's context: a submit of this prompt may ask for at most
    # max_position_embeddings - num_tokens new tokens.
    max_position_embeddings: int = 0

    @property
    def num_tokens(self) -> int:
        """What a submit of this prompt reports as its num_prompt_tokens."""
        return len(self.token_ids)

    @classmethod
    def from_proto(cls, resp: pb.TokenizeResponse) -> "TokenizeResult":
        return cls(list(resp.token_ids), resp.max_position_embeddings)


def stop_reason_of(ev: pb.Event) -> int | str | None:
    kind = ev.WhichOneof("stop_reason")
    return None if kind is None else getattr(ev, kind)


class _SampleParts:
    """The events of one sample, accumulated."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.texts: list[str] | None = None
        self.logprobs: list[float] | None = None
        self.top_logprobs: list[list[tuple[int, float]]] | None = None
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
        self.final: pb.Event | None = None

    def add(self, ev: pb.Event) -> None:
        if ev.HasField("text"):
            if self.texts is None:
                self.texts = []
            self.texts.append(ev.text)
        if ev.logprobs:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(ev.logprobs)
        if ev.top_logprobs:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.extend(
                [(c.token_id, c.logprob) for c in top.candidates] for top in ev.top_logprobs
            )
        if ev.prompt_logprobs:
            self.prompt_logprobs = list(ev.prompt_logprobs)
        if ev.prompt_top_logprobs:
            self.prompt_top_logprobs = [
                [(c.token_id, c.logprob) for c in top.candidates] for top in ev.prompt_top_logprobs
            ]
        self.token_ids.extend(ev.token_ids)
        if ev.finished or ev.sample_finished:
            self.final = ev

    def result(self, request_id: str, sample_index: int) -> Result:
        ev = self.final
        common = dict(
            text=None if self.texts is None else "".join(self.texts),
            logprobs=None if self.logprobs is None else list(self.logprobs),
            top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
            prompt_logprobs=self.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs,
            sample_index=sample_index,
        )
        if ev is None:
            return Result(request_id, list(self.token_ids), None, **common)
        return Result(
            request_id=request_id,
            token_ids=list(self.token_ids),
            finish_reason=FINISH_REASONS.get(ev.finish_reason),
            error=ev.error or None,
            num_prompt_tokens=ev.num_prompt_tokens,
            num_output_tokens=ev.num_output_tokens,
            metrics=Metrics.from_proto(ev.metrics),
            stop_reason=stop_reason_of(ev),
            num_cached_tokens=ev.num_cached_tokens,
            reasoning=ev.reasoning if ev.HasField("reasoning") else None,
            content=ev.content if ev.HasField("content") else None,
            tool_calls=[ToolCall.from_proto(c) for c in ev.tool_calls],
            **common,
        )


class ResultBuilder:
    """Accumulates the events of one request into a Result, checking they are gap-free.

    ``start_seq``: the first seq expected, for events replayed from a later ``from_seq``; the
    Result then holds the tokens (text, logprobs) from there on. Events of several samples
    (``n=``) go to each sample's own Result; their seq counts the tokens of all samples.
    """

    def __init__(self, request_id: str = "", *, start_seq: int = 0) -> None:
        self.request_id = request_id
        self.start_seq = start_seq
        self.num_tokens = 0  # of every sample
        self.parts: dict[int, _SampleParts] = {}
        self.final: pb.Event | None = None  # the request's last event

    def add(self, ev: pb.Event) -> None:
        expected = self.start_seq + self.num_tokens
        if ev.seq != expected:
            raise RuntimeError(f"event gap for {ev.request_id}: seq {ev.seq}, expected {expected}")
        self.request_id = ev.request_id
        self.parts.setdefault(ev.sample_index, _SampleParts()).add(ev)
        self.num_tokens += len(ev.token_ids)
        if ev.finished:
            self.final = ev

    @property
    def token_ids(self) -> list[int]:
        """Sample 0's tokens so far."""
        return self.parts[0].token_ids if 0 in self.parts else []

    @property
    def text(self) -> str | None:
        """Sample 0's text so far (None without a tokenizer)."""
        texts = self.parts[0].texts if 0 in self.parts else None
        return None if texts is None else "".join(texts)

    def result(self) -> Result:
        count = max(self.parts, default=0) + 1
        samples = [self.parts.get(i, _SampleParts()).result(self.request_id, i) for i in range(count)]
        if count == 1:
            return samples[0]
        return replace(samples[0], samples=samples)


def _messages(messages: Iterable[Any]) -> list[pb.ChatMessage]:
    """Each message as a ChatMessage; a ValueError names one without a string role and content
    (protobuf would send ``None`` as "" or fail with a message that names nothing)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, pb.ChatMessage):
            out.append(m)
            continue
        if isinstance(m, Mapping):
            role, content = m.get("role"), m.get("content")
        elif isinstance(m, (tuple, list)) and len(m) == 2:
            role, content = m
        else:
            role = content = None
        if not isinstance(role, str) or not isinstance(content, str):
            raise ValueError(f"messages[{i}]: needs a string role and a string content, got {m!r}")
        out.append(pb.ChatMessage(role=role, content=content))
    return out


def submit_request(
    token_ids: Sequence[int] | None = None,
    max_new_tokens: int | None = None,
    stop_token_ids: Sequence[int] | None = (),
    request_id: str = "",
    *,
    text: str | None = None,
    messages: Iterable[Mapping[str, str] | tuple[str, str] | pb.ChatMessage] | None = None,
    enable_thinking: bool | None = None,
    stop_strings: Sequence[str] | None = None,
    include_stop_string: bool | None = None,
    skip_special_tokens: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    min_new_tokens: int | None = None,
    ignore_eos: bool | None = None,
    n: int | None = None,
    logprobs: bool | None = None,
    top_logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    logit_bias: Mapping[int, float] | None = None,
    json_schema: str | Mapping[str, Any] | None = None,
    json_object: bool | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    choice: Sequence[str] | None = None,
    tools: Iterable[Mapping[str, Any] | pb.Tool] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> pb.SubmitRequest:
    """The prompt is exactly one of ``token_ids``, ``text`` or chat ``messages`` (dicts with
    role and content, or (role, content) pairs); text and messages need a server with a
    tokenizer. ``logit_bias``: {token id: bias}. Every other option left at None is not sent:
    the server's default applies (greedy decoding, no logprobs, special tokens skipped). These
    are the keyword options of submit / stream / generate (sync and asyncio, and the sessions'
    submit); the optional fields
    among them are the table ``qil_client.options.OPTIONS``, which a test keeps equal to this
    typed signature (the one editors and type checkers read).

    Structured output: at most one of ``json_schema`` (a JSON Schema as text, or a dict sent as
    compact JSON), ``json_object=True``, ``regex``, ``grammar`` (llguidance's Lark dialect) or
    ``choice`` (a list of strings: the output is exactly one); see ``qil_client.constraints``.

    Tools (chat messages only): ``tools`` as the OpenAI API gives them, ``tool_choice``
    ("auto", "required", "none" or a function's name) and ``parallel_tool_calls``; the calls
    come back parsed (``Result.tool_calls``), each matching its function's parameters.

    Values the wire cannot carry raise here (TypeError, ValueError); values out of range are
    the server's to reject (InvalidArgument naming the field).
    """
    arguments = locals()  # first, before any other local: the options by name
    if isinstance(stop_strings, str):
        raise TypeError("stop_strings must be a list of strings, not a string")
    constraint = constraints.given(arguments)
    # proto3 sends "" as no text at all: the server would find no prompt and blame token_ids
    if text is not None and not text:
        raise ValueError("text: the prompt is empty")
    req = pb.SubmitRequest()
    with naming("request_id"):
        req.request_id = request_id or ""
    with naming("token_ids"):
        req.token_ids.extend(token_ids or ())
    with naming("stop_token_ids"):
        req.stop_token_ids.extend(stop_token_ids or ())
    with naming("stop_strings"):
        req.stop_strings.extend(stop_strings or ())
    if text is not None:
        with naming("text"):
            req.text = text
    if messages is not None:
        chat = _messages(messages)
        if not chat:  # proto3 sends no messages as no prompt: the server would blame token_ids
            raise ValueError("messages: must hold at least one message")
        req.messages.extend(chat)
    if logit_bias:
        with naming("logit_bias"):
            if not isinstance(logit_bias, Mapping):
                raise TypeError(f"must map token ids to biases, got a {type(logit_bias).__name__}")
            req.logit_bias.update(logit_bias)
    if max_new_tokens is not None:
        with naming("max_new_tokens"):
            req.max_new_tokens = max_new_tokens
    for name in OPTION_NAMES:
        value = arguments[name]
        if value is not None:
            with naming(name):
                setattr(req, name, value)
    for name, value in constraint.items():
        constraints.set_constraint(req, name, value)
    if tools is not None or tool_choice is not None:
        with naming("tools"):
            req.tools.CopyFrom(tool_use(tools or (), tool_choice, parallel_tool_calls))
    return req


def tokenize_request(
    text: str | None = None,
    messages: Iterable[Mapping[str, str] | tuple[str, str] | pb.ChatMessage] | None = None,
    enable_thinking: bool | None = None,
    tools: Iterable[Mapping[str, Any] | pb.Tool] | None = None,
) -> pb.TokenizeRequest:
    """A TokenizeRequest: ``text`` or chat ``messages`` (and their ``tools``) as
    ``submit_request`` takes them (neither: the empty prompt, zero tokens)."""
    req = pb.TokenizeRequest()
    if text is not None:
        with naming("text"):
            req.text = text
    if messages is not None:
        req.messages.extend(_messages(messages))
    if enable_thinking is not None:
        with naming("enable_thinking"):
            req.enable_thinking = enable_thinking
    if tools is not None:
        with naming("tools"):
            req.tools.CopyFrom(tool_use(tools, None, None))
    return req


def detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool | None = None) -> pb.DetokenizeRequest:
    """A DetokenizeRequest; ``skip_special_tokens`` None: the server's default (True)."""
    if isinstance(token_ids, (str, bytes)):
        raise TypeError("token_ids must be a sequence of integers")
    req = pb.DetokenizeRequest()
    with naming("token_ids"):
        req.token_ids.extend(token_ids)
    if skip_special_tokens is not None:
        with naming("skip_special_tokens"):
            req.skip_special_tokens = skip_special_tokens
    return req


@contextmanager
def naming(field_name: str) -> Iterator[None]:
    """Re-raise protobuf's TypeError / ValueError (``Value out of range: -1``) with the field's
    name in front, as the server's errors have it."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{field_name}: {exc}") from None
