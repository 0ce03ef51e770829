"""Tools for a chat request (``submit_request(tools=..., tool_choice=...)``) and the calls a
result carries (``Result.tool_calls``)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from qil_client._proto.qil.v1 import inference_pb2 as pb


@dataclass(frozen=True)
class ToolCall:
    """A call the output made; its arguments match the function's parameters (the server
    holds the output to them)."""

    id: str
    name: str
    arguments: str  # JSON text of an object

    @property
    def args(self) -> dict[str, Any]:
        return json.loads(self.arguments)

    @classmethod
    def from_proto(cls, call: pb.ToolCall) -> "ToolCall":
        return cls(call.id, call.name, call.arguments)


def tool_use(tools: Iterable[Mapping[str, Any] | pb.Tool], choice: str | Mapping[str, Any] | None,
             parallel: bool | None) -> pb.ToolUse:
    """``tools`` as the OpenAI API gives them (``{"type": "function", "function": {...}}``, or
    the function alone) or as ``pb.Tool``; ``choice``: "auto", "required", "none", a function's
    name or the API's ``{"type": "function", "function": {"name": ...}}``."""
    use = pb.ToolUse(single_call=parallel is False)
    for tool in tools:
        if isinstance(tool, pb.Tool):
            use.tools.append(tool)
            continue
        function = tool.get("function", tool)
        parameters = function.get("parameters")
        use.tools.add(name=function.get("name", ""), description=function.get("description") or "",
                      parameters="" if parameters is None else json.dumps(parameters),
                      strict=bool(function.get("strict")))
    if isinstance(choice, Mapping):
        choice = choice.get("function", {}).get("name", "")
    use.choice = choice or ""
    return use


class StreamedCalls:
    """The calls of a stream's events joined from their ``tool_call_deltas`` (a call's id and
    name come first, then its arguments in fragments), per sample: ``add`` each event as it
    comes (``Client.stream``, ``AsyncClient.stream``, a session's), ``calls()`` the calls so far.
    A call cut off by max_new_tokens is here with its partial arguments; the final event's
    ``tool_calls`` holds only the calls that parsed whole."""

    def __init__(self) -> None:
        self._calls: dict[int, dict[int, list[str]]] = {}  # sample -> index -> [id, name, arguments]

    def add(self, ev: pb.Event) -> None:
        calls = self._calls.setdefault(ev.sample_index, {})
        for delta in ev.tool_call_deltas:
            call = calls.setdefault(delta.index, ["", "", ""])
            call[0] = call[0] or delta.id
            call[1] = call[1] or delta.name
            call[2] += delta.arguments

    def calls(self, sample_index: int = 0) -> list[ToolCall]:
        calls = self._calls.get(sample_index, {})
        return [ToolCall(*calls[i]) for i in sorted(calls)]
