"""An assistant's output text split as Qwen3 writes it: reasoning inside ``<think>...</think>``,
tool calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes
style), and the answer's content around them (torch-free: the front parses the text it holds).

``AssistantOutput`` is fed the text as it streams and gives typed parts at once: reasoning and
content deltas, a tool call's start (its name) as soon as the name is known, then its arguments'
text in fragments, then its end. A tag is never split across kinds: text that may still become a
tag is held back until the next delta says what it is, so no half-written ``<tool_call>`` leaks
into content. ``parse`` gives the same parts of a whole text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# a block's head as the constraint writes it, and as Qwen3 does: the name, then the arguments
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place among the output's calls (0, 1, ...)
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # a fragment of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int
    # the arguments' whole JSON text when the block parsed as a call (an object with a string
    # name and an object of arguments); None: it did not (cut off, or not JSON)
    arguments: str | None
    broken: str | None = None  # the block's text, when it did not


Part = Reasoning | Content | CallStart | CallArguments | CallEnd


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    index: int = 0  # its block's place among the output's blocks (its CallStart's index)


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    # text of blocks that opened but did not parse as a call (they are not in ``content``)
    broken_calls: list[str] = field(default_factory=list)


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _call_of(block: str) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a block that is a call, else None."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(value.get("arguments"), dict):
        return None
    return value["name"], json.dumps(value["arguments"], ensure_ascii=False)


class AssistantOutput:
    """The incremental splitter. ``thinking``: the prompt left a ``<think>`` block open (the
    model's output starts inside its reasoning); otherwise an output that starts with
    ``<think>`` opens one."""

    def __init__(self, thinking: bool = False, tools: bool = True) -> None:
        """``tools`` False: ``<tool_call>`` is plain content (a request that gave no tools)."""
        self._state = "reasoning" if thinking else "start"
        self._tools = tools
        self._buffer = ""  # text not yet given out
        self._block = ""  # the current call block's text so far
        self._calls = 0
        self._call_started = False  # the current block's CallStart went out
        self._arguments_sent = 0  # characters of the block's arguments given out

    def feed(self, text: str) -> list[Part]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Part]:
        """What is held back, at the end of the output (an open block ends unparsed)."""
        parts = self._drain(final=True)
        if self._state == "call":
            parts += self._end_call(parse=False)
        return parts

    def _drain(self, final: bool) -> list[Part]:
        parts: list[Part] = []
        while self._buffer:
            before = (self._state, len(self._buffer))
            getattr(self, f"_in_{self._state}")(parts, final)
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return parts

    def _in_start(self, parts: list[Part], final: bool) -> None:
        """At the output's start: a ``<think>`` there opens the reasoning."""
        stripped = self._buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buffer = stripped[len(THINK_OPEN):]
            self._state = "reasoning"
        elif final or not THINK_OPEN.startswith(stripped):
            self._state = "content"

    def _in_reasoning(self, parts: list[Part], final: bool) -> None:
        end = self._buffer.find(THINK_CLOSE)
        if end >= 0:
            if end:
                parts.append(Reasoning(self._buffer[:end]))
            self._buffer = self._buffer[end + len(THINK_CLOSE):]
            self._state = "after_reasoning"
            return
        keep = 0 if final else _held_prefix(self._buffer, THINK_CLOSE)
        if len(self._buffer) > keep:
            parts.append(Reasoning(self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]

    def _in_after_reasoning(self, parts: list[Part], final: bool) -> None:
        """The blank lines the template writes between the reasoning and the answer."""
        stripped = self._buffer.lstrip()
        if stripped or final:
            self._buffer = stripped
            self._state = "content"
        else:
            self._buffer = ""

    def _in_content(self, parts: list[Part], final: bool) -> None:
        if not self._tools:
            parts.append(Content(self._buffer))
            self._buffer = ""
            return
        start = self._buffer.find(CALL_OPEN)
        if start >= 0:
            if start:
                parts.append(Content(self._buffer[:start]))
            self._buffer = self._buffer[start + len(CALL_OPEN):]
            self._state, self._block = "call", ""
            self._call_started, self._arguments_sent = False, 0
            return
        keep = 0 if final else _held_prefix(self._buffer, CALL_OPEN)
        if len(self._buffer) > keep:
            parts.append(Content(self._buffer[: len(self._buffer) - keep]))
            self._buffer = self._buffer[len(self._buffer) - keep:]

    def _in_call(self, parts: list[Part], final: bool) -> None:
        end = self._buffer.find(CALL_CLOSE)
        if end >= 0:
            self._block += self._buffer[:end]
            self._buffer = self._buffer[end + len(CALL_CLOSE):]
            parts += self._end_call(parse=True)
            self._state = "content"
            return
        keep = 0 if final else _held_prefix(self._buffer, CALL_CLOSE)
        self._block += self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep:]
        parts += self._stream_call()

    def _stream_call(self) -> list[Part]:
        """The current block's start once its name is known, then its arguments' text, less
        what may still be the block's own closing brace (and the blank around it)."""
        head = _HEAD.match(self._block)
        if head is None:
            return []
        parts: list[Part] = []
        index = self._calls
        if not self._call_started:
            self._call_started = True
            parts.append(CallStart(index, json.loads(f'"{head.group(1)}"')))
        arguments = self._block[head.end():].rstrip()
        visible = len(arguments.removesuffix("}").rstrip()) if arguments.endswith("}") else len(arguments)
        if visible > self._arguments_sent:
            parts.append(CallArguments(index, self._block[head.end() + self._arguments_sent: head.end() + visible]))
            self._arguments_sent = visible
        return parts

    def _end_call(self, parse: bool) -> list[Part]:
        """The current block ends (``parse`` False: cut off): a call when it parses as one."""
        parts = self._stream_call() if parse else []
        index = self._calls
        self._calls += 1
        call = _call_of(self._block) if parse else None
        if call is None:
            return parts + [CallEnd(index, None, self._block)]
        name, arguments = call
        if not self._call_started:  # its head was not in the order streamed: it goes out whole
            return parts + [CallStart(index, name), CallArguments(index, arguments), CallEnd(index, arguments)]
        head = _HEAD.match(self._block)
        streamed = self._block[head.end(): head.end() + self._arguments_sent]
        # what went out is the arguments as written, unless the block held more than them
        return parts + [CallEnd(index, streamed if _same_json(streamed, arguments) else arguments)]


def _same_json(a: str, b: str) -> bool:
    try:
        return json.loads(a) == json.loads(b)
    except ValueError:
        return False


def parse(text: str, thinking: bool = False, tools: bool = True) -> ParsedOutput:
    """The parts of a whole output (``AssistantOutput``'s, joined)."""
    out = AssistantOutput(thinking, tools)
    return joined(out.feed(text) + out.finish())


def joined(parts: list[Part]) -> ParsedOutput:
    """A whole output's parts (every one ``AssistantOutput`` gave for it, in order) joined."""
    parsed = ParsedOutput()
    names: dict[int, str] = {}
    for part in parts:
        if isinstance(part, Reasoning):
            parsed.reasoning += part.text
        elif isinstance(part, Content):
            parsed.content += part.text
        elif isinstance(part, CallStart):
            names[part.index] = part.name
        elif isinstance(part, CallEnd):
            if part.arguments is not None:
                parsed.tool_calls.append(ToolCall(names[part.index], part.arguments, part.index))
            else:
                parsed.broken_calls.append(part.broken or "")
    return parsed
