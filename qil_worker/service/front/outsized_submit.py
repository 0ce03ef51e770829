"""A submit of megabytes, known by its prompt's size before its prompt is decoded (front side).

A prompt that cannot fit is refused from its size alone (``Front.refuse_unfit``); for a message
of megabytes, protobuf's parse of it, the ``str`` of its text or the list of its token ids would
cost the front's event loop more than that decision: tens of milliseconds with the GIL held, a
gap in every stream the front forwards meanwhile. So the deserializer of a large
``SubmitRequest`` (Submit, Generate, a StreamEvents submit frame) reads its top-level fields'
tags and lengths (``wire_scan``), parses the message without its prompt fields, and keeps the
prompt's size: its UTF-8 bytes and whether it is ASCII (text, each message's content), or the
number of token ids. Only when that size does not refuse it is the message parsed whole
(``OutsizedSubmit.whole``), and it then goes the way of any other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.freed_memory import OUTSIZED_CHARS
from qil_worker.service.front import wire_scan as W
from qil_worker.service.front.decoding import Undecodable, parse_leniently
from qil_worker.text.prompt import ROLES
from qil_worker.text.tokenizer import min_tokens_of_sizes

# SubmitRequest's prompt fields, ChatMessage's fields, StreamEventsRequest's submit frame
TOKEN_IDS, TEXT, MESSAGES = 2, 5, 6
ROLE, CONTENT = 1, 2
SUBMIT_FRAME = 1
_ROLES = frozenset(r.encode() for r in ROLES)


@dataclass(frozen=True)
class TextSize:
    """A text as its UTF-8 bytes show it, undecoded."""

    num_bytes: int
    ascii: bool


@dataclass(frozen=True)
class PromptSize:
    """The prompt fields of a ``SubmitRequest``, as much as their wire form tells."""

    num_token_ids: int = 0
    text: TextSize = TextSize(0, True)  # the last text field's (proto3: the last one wins)
    contents: tuple[TextSize, ...] | None = None  # one per message; None: no messages
    roles_known: bool = True  # every message has a role of ``prompt.ROLES``

    @property
    def given(self) -> list[str]:
        """The prompt forms given, as ``submit_spec.submit_spec`` tells them from the message."""
        return [name for name, present in (
            ("token_ids", self.num_token_ids > 0),
            ("text", self.text.num_bytes > 0),
            ("messages", self.contents is not None),
        ) if present]

    def min_tokens(self, max_token_bytes: int, normal_form: str | None) -> int:
        """``text.tokenizer.min_tokens`` of the text or chat prompt, from its bytes (0 when a
        message's role is not one the worker takes: it names that message first)."""
        if self.contents is not None and not self.roles_known:
            return 0
        texts = [self.text] if self.text.num_bytes else list(self.contents or ())
        return min_tokens_of_sizes([(t.num_bytes, t.ascii) for t in texts], max_token_bytes, normal_form)


@dataclass
class OutsizedSubmit:
    """A received ``SubmitRequest`` of megabytes: ``rest`` is the request without its prompt,
    ``prompt`` what its prompt's wire form tells; ``whole()`` parses all of it."""

    rest: pb.SubmitRequest
    prompt: PromptSize
    data: bytes | None  # the received message; dropped once parsed or refused
    frame: bool = False  # data is a StreamEventsRequest holding the submit
    parsed: Any = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        return self.rest.request_id

    def whole(self) -> pb.SubmitRequest | Undecodable:
        """The request parsed whole (or ``Undecodable``, as the plain deserializer says)."""
        if self.parsed is None:
            assert self.data is not None, "whole() after drop()"
            if self.frame:
                frame = parse_leniently(pb.StreamEventsRequest, self.data)
                self.parsed = frame if isinstance(frame, Undecodable) else frame.submit
            else:
                self.parsed = parse_leniently(pb.SubmitRequest, self.data)
            self.data = None
        return self.parsed

    def drop(self) -> None:
        """Let go of the message (a refusal's traceback outlives the call that held it)."""
        self.data = self.parsed = None


def submit_request(data: bytes) -> OutsizedSubmit | None:
    """An outsized ``SubmitRequest`` without its prompt decoded, or None: parse it whole (it is
    not that large, its prompt is not what makes it large, or it needs the parser's verdict)."""
    return _scan(data, 0, len(data), frame=False)


def stream_events_request(data: bytes) -> OutsizedSubmit | None:
    """The same for a ``StreamEventsRequest`` that is one outsized submit frame."""
    if len(data) < OUTSIZED_CHARS:
        return None
    frames = W.fields(data, max_fields=2)
    if not frames or len(frames) != 1 or frames[0].number != SUBMIT_FRAME or frames[0].wire_type != W.LENGTH_DELIMITED:
        return None
    return _scan(data, frames[0].value_start, frames[0].end, frame=True)


def _scan(data: bytes, start: int, end: int, frame: bool) -> OutsizedSubmit | None:
    if end - start < OUTSIZED_CHARS:
        return None
    found = W.fields(data, start, end, varint_runs=(TOKEN_IDS,))
    if found is None:
        return None
    prompt_fields = [f for f in found if f.number in (TOKEN_IDS, TEXT, MESSAGES)]
    if sum(f.end - f.start for f in prompt_fields) < OUTSIZED_CHARS:
        return None
    prompt = _prompt_size(data, prompt_fields, W.MAX_FIELDS - len(found))
    if prompt is None:
        return None
    try:
        rest = pb.SubmitRequest.FromString(W.without(data, prompt_fields, start, end))
    except Exception:  # noqa: BLE001 - the whole parse names what is wrong
        return None
    return OutsizedSubmit(rest, prompt, data, frame)


def _prompt_size(data: bytes, prompt_fields: list[W.Field], budget: int) -> PromptSize | None:
    num_ids, text, roles_known = 0, TextSize(0, True), True
    contents: list[TextSize] | None = None
    for f in prompt_fields:
        if f.number == TOKEN_IDS and f.wire_type == W.VARINT:
            num_ids += f.count
        elif f.number == TOKEN_IDS and f.wire_type == W.LENGTH_DELIMITED:
            packed = W.packed_varints(data, f)
            if packed is None:
                return None
            num_ids += packed
        elif f.number == TEXT and f.wire_type == W.LENGTH_DELIMITED:
            text = _text_size(data, f)
        elif f.number == MESSAGES and f.wire_type == W.LENGTH_DELIMITED:
            inner = W.fields(data, f.value_start, f.end, max_fields=budget)
            if inner is None:
                return None
            budget -= len(inner)
            role, content = b"", TextSize(0, True)
            for g in inner:
                if g.number in (ROLE, CONTENT) and g.wire_type != W.LENGTH_DELIMITED:
                    return None  # (the parser would keep it as an unknown field)
                if g.number == ROLE:
                    role = data[g.value_start:g.end] if g.size <= 16 else b"?"
                elif g.number == CONTENT:
                    content = _text_size(data, g)
            roles_known = roles_known and role in _ROLES
            contents = [] if contents is None else contents
            contents.append(content)
        else:
            return None  # a prompt field of another wire type: the parser keeps it as unknown
    return PromptSize(num_ids, text, None if contents is None else tuple(contents), roles_known)


def _text_size(data: bytes, f: W.Field) -> TextSize:
    return TextSize(f.size, W.is_ascii(data, f.value_start, f.end))
