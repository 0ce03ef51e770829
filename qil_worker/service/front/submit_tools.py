"""A ``SubmitRequest``'s tools and its chat messages' tool parts → the spec's options, through
the same checks and the same constraint as the HTTP API's (``structured.tools``,
``http.tool_messages``), so both fronts name the same fields."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.errors import InvalidRequestError
from qil_worker.text.tool_messages import tool_parts
from qil_worker.structured.tool_grammar import tool_options
from qil_worker.structured.tools import CHOICE_MODES, ToolRequest, tool_request


def tools_options(request: pb.SubmitRequest) -> dict[str, Any]:
    """The options the request's ``tools`` add (none without them)."""
    parsed = _tool_request(request)
    if parsed is None:
        return {}
    return tool_options(parsed, constrained=request.WhichOneof("constraint") is not None)


def template_tools(request: pb.TokenizeRequest) -> list[dict[str, Any]] | None:
    """The tools a Tokenize renders, checked as a submit's (None: it gives none)."""
    parsed = _tool_request(request)
    return None if parsed is None else parsed.template_tools()


def _tool_request(request: pb.SubmitRequest | pb.TokenizeRequest) -> ToolRequest | None:
    if not request.HasField("tools"):
        return None
    use = request.tools
    tools = []
    for i, tool in enumerate(use.tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                function["parameters"] = json.loads(tool.parameters)
            except (ValueError, RecursionError):
                raise InvalidRequestError(f"tools[{i}].function.parameters", "is not valid JSON") from None
        if tool.strict:
            function["strict"] = True
        tools.append({"type": "function", "function": function})
    choice: Any = use.choice or None
    if choice is not None and choice not in CHOICE_MODES:
        choice = {"type": "function", "function": {"name": choice}}
    return tool_request(tools, choice, not use.single_call)


def chat_messages(messages: Iterable[pb.ChatMessage]) -> list[dict[str, Any]]:
    """A Submit's or Tokenize's messages for the template (the same for both, so their
    prompts are the same)."""
    return [{"role": m.role, "content": m.content} if _plain(m) else chat_message(i, m)
            for i, m in enumerate(messages)]


def _plain(message: pb.ChatMessage) -> bool:
    return not (message.tool_calls or message.tool_call_id or message.reasoning_content or message.role == "tool")


def chat_message(i: int, message: pb.ChatMessage) -> dict[str, Any]:
    """A chat message for the template: role, content and its tool parts."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    shaped: dict[str, Any] = {"role": message.role}
    if message.tool_calls:
        shaped["tool_calls"] = [{"id": c.id, "type": "function",
                                 "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                                for c in message.tool_calls]
    if message.tool_call_id or message.role == "tool":
        shaped["tool_call_id"] = message.tool_call_id or None
    if message.reasoning_content:
        shaped["reasoning_content"] = message.reasoning_content
    out.update(tool_parts(i, shaped))
    return out
