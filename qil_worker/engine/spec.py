"""One request, typed and validated: what both fronts build from their wire forms, what crosses
the pipe whole, and what ``Engine.submit`` takes (torch-free: the front imports it).

A ``RequestSpec`` is checked when it is made: every field that needs no model (counts, ranges,
forms) raises ``InvalidRequestError`` naming the field then, before anything is built from it.
What needs the model — token ids against its vocabulary, lengths against its positions and
pages, a tokenizer for text — is the engine's to check (``engine.validation``), and so are
the ids' values (integers in the vocabulary). The keyword
form (``RequestSpec.of``) takes the option table's names (``qil_client.options``), the names
``Engine.submit`` has always taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qil_worker.engine.sampling_params import SamplingParams
from qil_worker.errors import InvalidRequestError
from qil_worker.request_limits import MAX_REQUEST_ID_LENGTH, check_stop_strings
from qil_worker.structured.spec import CONSTRAINT_KINDS, ConstraintSpec

DEFAULT_MAX_NEW_TOKENS = 16
PROMPT_FIELDS = ("token_ids", "text", "messages")


@dataclass(frozen=True)
class Prompt:
    """Exactly one of ``token_ids``, ``text`` (encoded as it is) or chat ``messages`` (through
    the model's chat template; ``enable_thinking``: Qwen3's switch, None the template's default).
    ``encoded_from``: the form the ids were encoded from in the worker ("text" or "messages"),
    the field an error about their length names."""

    token_ids: Sequence[int] | None = None
    text: str | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    enable_thinking: bool | None = None
    encoded_from: str | None = None
    # the tools the chat template renders into the prompt (messages only; the template's
    # ``tools`` argument, as transformers' ``apply_chat_template`` takes them)
    tools: Sequence[Mapping[str, Any]] | None = None

    def __post_init__(self) -> None:
        given = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise InvalidRequestError("prompt", f"give token ids, text or messages, not {' and '.join(given)}")
        if not given:
            raise InvalidRequestError("token_ids", "the prompt is empty: give token_ids, text or messages")
        if self.tools is not None and self.text is not None:
            raise InvalidRequestError("tools", "need a chat prompt (messages)")
        if self.enable_thinking is not None and not isinstance(self.enable_thinking, bool):
            raise InvalidRequestError("enable_thinking", f"must be a boolean, got {self.enable_thinking!r}")

    @property
    def field(self) -> str:
        """The request field the prompt came in (for errors about it)."""
        if self.encoded_from is not None:
            return self.encoded_from
        return "messages" if self.messages is not None else "text" if self.text is not None else "token_ids"

    @property
    def is_text(self) -> bool:
        """Whether it still needs the tokenizer (text or messages)."""
        return self.token_ids is None

    def forget_text(self) -> None:
        """Drop an outsized text or chat prompt that has been sent or refused, so that what still
        holds this spec (a refusal's traceback, gRPC's last call) does not hold megabytes with
        it. (The one change a spec sees after it is made; the spec is not used again.)"""
        object.__setattr__(self, "text", None)
        object.__setattr__(self, "messages", None)
        object.__setattr__(self, "tools", None)

    def encoded(self, token_ids: list[int]) -> "Prompt":
        """This text or chat prompt as the ids it was encoded to."""
        return Prompt(token_ids=token_ids, encoded_from=self.field)


@dataclass(frozen=True)
class TextOptions:
    """How the output text is made (with a tokenizer): ``stop_strings`` end the request when the
    text contains one (kept in the text with ``include_stop_string``); special tokens are left
    out of it unless ``skip_special_tokens`` is False."""

    stop_strings: tuple[str, ...] = ()
    include_stop_string: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_strings", tuple(check_stop_strings(self.stop_strings)))
        for name in ("include_stop_string", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be a boolean, got {getattr(self, name)!r}")


POOLING_KINDS = ("embed", "score")


@dataclass(frozen=True)
class Pooling:
    """A prefill-only request: nothing is generated; the answer is read off the final (normed)
    hidden state of the prompt's last token. ``embed``: that state, its first ``dimensions``
    components (all when None: Matryoshka truncation), L2-normalised unless ``normalize`` is
    False. ``score``: P(yes) of a yes/no judge (a reranker) — the softmax of the logits of
    ``yes_token_id`` against ``no_token_id`` there (both None: the tokenizer's tokens "yes"
    and "no", as Qwen3-Reranker reads them)."""

    kind: str
    dimensions: int | None = None
    normalize: bool = True
    yes_token_id: int | None = None
    no_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise InvalidRequestError("pooling", f"expected one of {POOLING_KINDS}, got {self.kind!r}")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d <= 0):
            raise InvalidRequestError("dimensions", f"must be a positive integer, got {d!r}")
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize", f"must be a boolean, got {self.normalize!r}")
        pair = (self.yes_token_id, self.no_token_id)
        if self.kind == "score":
            for name, token in zip(("yes_token_id", "no_token_id"), pair):
                if pair != (None, None) and (not isinstance(token, int) or isinstance(token, bool) or token < 0):
                    raise InvalidRequestError(name, f"give both answers' token ids or neither, got {token!r}")
            if d is not None:
                raise InvalidRequestError("dimensions", "applies to embeddings, not to scores")
        elif pair != (None, None):
            raise InvalidRequestError("yes_token_id", "applies to scores, not to embeddings")

    def check_model(self, hidden_size: int, vocab_size: int) -> None:
        """What needs the model: ``dimensions`` within the hidden size, answer ids in the vocabulary."""
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise InvalidRequestError(
                "dimensions", f"{self.dimensions} exceeds the model's hidden size {hidden_size}"
            )
        for name in ("yes_token_id", "no_token_id"):
            token = getattr(self, name)
            if token is not None and token >= vocab_size:
                raise InvalidRequestError(name, f"token id {token} is outside [0, {vocab_size})")


@dataclass(frozen=True)
class RequestSpec:
    """One request: its prompt, how long it may run, how each token is chosen (``sampling``:
    also ``n`` samples and log-probabilities), how its text is made, what its output must match
    (``constraint``), and its id (None: the engine names it). Validated when made. With
    ``pooling`` the request generates nothing (``Pooling``): its sampling and length options
    must stay at their defaults."""

    prompt: Prompt
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: Sequence[int] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    text: TextOptions = field(default_factory=TextOptions)
    constraint: ConstraintSpec | None = None
    request_id: str | None = None
    pooling: Pooling | None = None

    def __post_init__(self) -> None:
        rid = self.request_id
        if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID_LENGTH):
            raise InvalidRequestError(
                "request_id", f"must be a non-empty string of at most {MAX_REQUEST_ID_LENGTH} characters"
            )
        n = self.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise InvalidRequestError("max_new_tokens", f"must be a positive integer, got {n!r}")
        for name, ids in (("token_ids", self.prompt.token_ids), ("stop_token_ids", self.stop_token_ids)):
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (Sequence, type(None))):
                raise InvalidRequestError(name, f"expected a sequence of token ids, got {type(ids).__name__}")
        self.sampling.validate(n)
        if self.pooling is not None:
            self._check_pooled()

    def _check_pooled(self) -> None:
        """A pooled request has no output for generation options to shape: refuse them by name."""
        if not isinstance(self.pooling, Pooling):
            raise InvalidRequestError("pooling", f"expected a Pooling, got {type(self.pooling).__name__}")
        s = self.sampling
        given = [
            name for name, value in (
                ("n", s.n != 1), ("logprobs", s.logprobs), ("top_logprobs", bool(s.top_logprobs)),
                ("prompt_logprobs", s.prompt_logprobs is not None), ("stop_strings", bool(self.text.stop_strings)),
                ("constraint", self.constraint is not None),
            ) if value
        ]
        if given:
            raise InvalidRequestError(given[0], f"does not apply to a {self.pooling.kind} request (nothing is generated)")

    @classmethod
    def of(
        cls,
        token_ids: Sequence[int] | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        stop_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        sampling: SamplingParams | None = None,
        *,
        text: str | None = None,
        messages: Sequence[Mapping[str, str]] | None = None,
        enable_thinking: bool | None = None,
        stop_strings: Sequence[str] | None = None,
        include_stop_string: bool = False,
        skip_special_tokens: bool = True,
        json_schema: str | dict | None = None,
        json_object: bool | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        choice: Sequence[str] | None = None,
        tool_calls: str | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **sampling_fields: Any,
    ) -> "RequestSpec":
        """The spec of ``Engine.submit``'s keyword form (the option table's names; sampling as
        ``sampling=SamplingParams(...)`` or as its fields)."""
        if sampling is None:
            sampling = SamplingParams.from_kwargs(**sampling_fields)
        elif sampling_fields:
            raise TypeError("pass either sampling= or sampling fields, not both")
        return cls(
            prompt=Prompt(token_ids, text, messages, enable_thinking, tools=tools),
            max_new_tokens=max_new_tokens,
            stop_token_ids=() if stop_token_ids is None else stop_token_ids,
            sampling=sampling,
            text=TextOptions(() if stop_strings is None else stop_strings, include_stop_string, skip_special_tokens),
            # a chat prompt may think first unless it turned thinking off: the constraint is
            # the answer's
            constraint=ConstraintSpec.from_kwargs(
                json_schema, json_object, regex, grammar, choice, tool_calls,
                after_thinking=messages is not None and enable_thinking is not False,
            ),
            request_id=request_id,
        )

    def with_prompt(self, prompt: Prompt) -> "RequestSpec":
        """The same request with another prompt (its text encoded, say): checked again."""
        return dataclasses.replace(self, prompt=prompt)

    @classmethod
    def pooled(
        cls, pooling: Pooling, token_ids: Sequence[int] | None = None, text: str | None = None,
        request_id: str | None = None,
    ) -> "RequestSpec":
        """An embedding or scoring request of one prompt (ids, or text encoded as the tokenizer
        encodes a document: with its own special tokens)."""
        return cls(prompt=Prompt(token_ids, text), max_new_tokens=1, request_id=request_id, pooling=pooling)

    @property
    def embeds(self) -> bool:
        """Whether it asks for an embedding (its text is then encoded as a document)."""
        return self.pooling is not None and self.pooling.kind == "embed"

    def with_id(self, request_id: str) -> "RequestSpec":
        return dataclasses.replace(self, request_id=request_id)


# The keyword names of ``RequestSpec.of`` that are not sampling fields: with SamplingParams'
# fields, every option a request can give (``tests/service/test_request_options.py`` pins them to the
# option table and the proto).
SPEC_KEYWORDS = (
    "token_ids", "max_new_tokens", "stop_token_ids", "request_id", "text", "messages", "enable_thinking",
    "stop_strings", "include_stop_string", "skip_special_tokens", *CONSTRAINT_KINDS,
)
