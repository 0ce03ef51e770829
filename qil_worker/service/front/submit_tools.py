"""A ``SubmitRequest``'s tools and its chat messages' tool parts → the spec's options, through
the same checks and the same constraint as the HTTP API's (``structured.tools``,
``http.tool_messages``), so both fronts name the same fields."""

from __future__ import annotations

import json
from typing import Any

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_worker.errors import InvalidRequestError
from qil_worker.text.tool_messages import tool_parts
from qil_worker.structured.tool_grammar import tool_options
from qil_worker.structured.tools import CHOICE_MODES, tool_request


def tools_options(request: pb.SubmitRequest) -> dict[str, Any]:
    """The options the request's ``tools`` add (none without them)."""
    if not request.HasField("tools"):
        return {}
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
    parsed = tool_request(tools, choice, not use.single_call)
    if parsed is None:
        return {}
    thinking = request.enable_thinking if request.HasField("enable_thinking") else None
    return tool_options(parsed, thinking)


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
