"""The tool parts of chat messages, from the API's shapes to the chat template's: an assistant
message's ``tool_calls`` (arguments as an object, as transformers' templates render them) and
its ``reasoning_content``, a ``tool`` message's ``tool_call_id``."""

from __future__ import annotations

from typing import Any

from qil_worker.errors import InvalidRequestError
from qil_worker.structured.tools import arguments_object


def tool_parts(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """What message ``i`` adds to its role and content for the template; ``InvalidRequestError``
    naming the field (``messages[3].tool_calls[0].function.arguments``)."""
    role = message.get("role")
    out: dict[str, Any] = {}
    where = f"messages[{i}]"
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise InvalidRequestError(f"{where}.tool_calls", "only assistant messages make tool calls")
        if not isinstance(calls, list):
            raise InvalidRequestError(f"{where}.tool_calls", "must be an array of calls")
        out["tool_calls"] = [_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    reasoning = message.get("reasoning_content")
    if reasoning is not None and role == "assistant":
        if not isinstance(reasoning, str):
            raise InvalidRequestError(f"{where}.reasoning_content", "must be a string")
        out["reasoning_content"] = reasoning
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise InvalidRequestError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers")
        out["tool_call_id"] = call_id
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def _call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        raise InvalidRequestError(where, 'must be {"id": ..., "type": "function", "function": {...}}')
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}.function", "must be an object with a string name")
    out: dict[str, Any] = {"type": "function", "function": {
        "name": function["name"],
        "arguments": arguments_object(function.get("arguments", "{}"), f"{where}.function.arguments"),
    }}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
