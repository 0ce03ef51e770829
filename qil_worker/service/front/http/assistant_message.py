"""A chat choice's output text as the API's assistant message: reasoning in
``reasoning_content``, tool-call blocks in ``tool_calls`` (finish reason ``tool_calls``), the
rest in ``content``; streamed as the deltas OpenAI sends (a call's index, id and name first,
then its arguments in fragments). The splitting is ``text.assistant_output``'s."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from qil_worker.text.assistant_output import (
    THINK_CLOSE,
    THINK_OPEN,
    AssistantOutput,
    CallArguments,
    CallEnd,
    CallStart,
    Content,
    Part,
    Reasoning,
    parse,
)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def message_of(text: str, tools: bool, reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The whole message of an output ``text`` and its finish reason (``reason``: the
    engine's; stop becomes tool_calls when the output made calls)."""
    parsed = parse(text, tools=tools)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
        if not parsed.content.strip():  # (the blank lines around and between blocks)
            message["content"] = None
    return message, _reason(reason, bool(parsed.tool_calls))


def _reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if reason == "stop" and called else reason


@dataclass
class StreamedMessage:
    """One choice's message as it streams: each ``delta`` of new text (and its end) → the
    delta's fields."""

    tools: bool
    parser: AssistantOutput = field(init=False)
    calls: int = 0  # calls that parsed whole
    ids: dict[int, str] = field(default_factory=dict)
    # content that is only whitespace so far: held until text follows it (a call or the end
    # after calls drops it, as the whole message does)
    blank: str = ""

    def __post_init__(self) -> None:
        self.parser = AssistantOutput(tools=self.tools)

    def delta(self, text: str, ended: bool) -> dict[str, Any]:
        parts = self.parser.feed(text) if text else []
        if ended:
            parts += self.parser.finish()
        out = self._fields(parts)
        if ended and self.blank and not self.calls:
            out["content"] = out.get("content", "") + self.blank
        return out

    def reason(self, reason: str | None) -> str | None:
        return _reason(reason, self.calls > 0)

    def _fields(self, parts: list[Part]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        calls: dict[int, dict[str, Any]] = {}
        for part in parts:
            if isinstance(part, Reasoning):
                out["reasoning_content"] = out.get("reasoning_content", "") + part.text
            elif isinstance(part, Content):
                self._content(part.text, out)
            elif isinstance(part, CallStart):
                self.blank = ""
                self.ids[part.index] = call_id()
                calls[part.index] = {"index": part.index, "id": self.ids[part.index], "type": "function",
                                     "function": {"name": part.name, "arguments": ""}}
            elif isinstance(part, CallArguments):
                entry = calls.setdefault(part.index, {"index": part.index, "function": {"arguments": ""}})
                entry["function"]["arguments"] += part.text
            elif isinstance(part, CallEnd) and part.arguments is not None:
                self.calls += 1
        if calls:
            out["tool_calls"] = list(calls.values())
        return out

    def _content(self, text: str, out: dict[str, Any]) -> None:
        if not self.tools:
            out["content"] = out.get("content", "") + text
            return
        text = self.blank + text
        self.blank = ""
        if text.strip():
            out["content"] = out.get("content", "") + text
        else:
            self.blank = text


def reasoning_tokens(texts: list[str]) -> int:
    """How many of an output's tokens (their texts, in order) are its reasoning: up to the one
    that closes a ``<think>`` block the output opened (0 without one)."""
    joined = ""
    for k, text in enumerate(texts):
        joined += text
        head = joined.lstrip()
        if not THINK_OPEN.startswith(head[: len(THINK_OPEN)]):
            return 0
        if THINK_CLOSE in joined[max(0, len(joined) - len(text) - len(THINK_CLOSE)):]:
            return k + 1
    return len(texts) if joined.lstrip().startswith(THINK_OPEN) else 0
