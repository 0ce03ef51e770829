"""A request's tools (function definitions), its ``tool_choice`` and ``parallel_tool_calls``,
validated from the OpenAI API's shapes (torch- and llguidance-free: both fronts build them).

Every error names its field as the API spells it (``tools[2].function.parameters: ...``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from qil_worker.errors import InvalidRequestError
from qil_worker.request_limits import (
    MAX_CONSTRAINT_CHARS,
    MAX_TOOL_DESCRIPTION_CHARS,
    MAX_TOOL_NAME_CHARS,
    MAX_TOOLS,
    json_fault,
)

_NAME = re.compile(r"[A-Za-z0-9_-]+")
CHOICE_MODES = ("none", "auto", "required")
EMPTY_PARAMETERS = '{"type":"object","properties":{}}'  # a function that takes no arguments


@dataclass(frozen=True)
class ToolSpec:
    """One function: its name, description, parameters' JSON Schema (as JSON text, in its own
    key order) and whether it is strict (OpenAI's strict mode: the schema is checked to be one
    whose every object lists all its properties as required and allows no others)."""

    name: str
    description: str = ""
    parameters: str = EMPTY_PARAMETERS
    strict: bool = False
    given: str = "{}"  # the tool as the request gave it (JSON text): what the template renders

    def template_form(self) -> dict[str, Any]:
        """The tool as chat templates take it (transformers' ``apply_chat_template(tools=...)``):
        as the request gave it, so the prompt is what the caller's own rendering would be."""
        return json.loads(self.given)


@dataclass(frozen=True)
class ToolRequest:
    """The tools of one request and what it asks of them: ``choice`` is ``none``, ``auto``,
    ``required`` or the name of one of the tools (that function must be called)."""

    tools: tuple[ToolSpec, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def named(self) -> str | None:
        """The function a named ``tool_choice`` forces (None: a mode)."""
        return None if self.choice in CHOICE_MODES else self.choice

    @property
    def calls_parsed(self) -> bool:
        """Whether the output's ``<tool_call>`` blocks are calls (``none``: they are text)."""
        return self.choice != "none"

    @property
    def allowed(self) -> tuple[ToolSpec, ...]:
        """The tools a call may name."""
        named = self.named
        return tuple(t for t in self.tools if t.name == named) if named else self.tools

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.template_form() for t in self.tools]


def tool_request(tools: Any, choice: Any = None, parallel: Any = None) -> ToolRequest | None:
    """The request's tools from the API's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
    (None: no tools, and a choice that needs none); ``InvalidRequestError`` naming the field."""
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be a boolean, got {type(parallel).__name__}")
    if tools is None or (isinstance(tools, list) and not tools):
        if choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice", "needs tools: the request gives none")
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", f"must be an array of tools, got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    specs = tuple(_tool(i, t) for i, t in enumerate(tools))
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{spec.name!r} is given twice")
        seen.add(spec.name)
    total = sum(len(s.parameters) for s in specs)
    if total > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(
            "tools", f"the parameters' schemas have {total} characters together; at most {MAX_CONSTRAINT_CHARS}"
        )
    return ToolRequest(specs, _choice(choice, seen), True if parallel is None else parallel)


def _choice(choice: Any, names: set[str]) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in CHOICE_MODES:
            raise InvalidRequestError("tool_choice", f"must be one of {', '.join(CHOICE_MODES)} or a function, got {choice!r}")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(function, dict):
        raise InvalidRequestError("tool_choice", 'must be a mode or {"type": "function", "function": {"name": ...}}')
    name = function.get("name")
    if not isinstance(name, str) or name not in names:
        raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not one of the tools")
    return name


def _tool(i: int, tool: Any) -> ToolSpec:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequestError(where, 'must be {"type": "function", "function": {...}}')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function", "must be an object with a name")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > MAX_TOOL_NAME_CHARS:
        raise InvalidRequestError(
            f"{where}.function.name",
            f"must be 1 to {MAX_TOOL_NAME_CHARS} characters of a-z, A-Z, 0-9, _ and -, got {name!r}",
        )
    description = function.get("description")
    if description is None:
        description = ""
    if not isinstance(description, str) or len(description) > MAX_TOOL_DESCRIPTION_CHARS:
        raise InvalidRequestError(f"{where}.function.description", f"must be a string of at most {MAX_TOOL_DESCRIPTION_CHARS} characters")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(f"{where}.function.strict", "must be a boolean")
    parameters = function.get("parameters")
    field = f"{where}.function.parameters"
    if parameters is None:
        text = EMPTY_PARAMETERS
    elif not isinstance(parameters, dict):
        raise InvalidRequestError(field, f"must be a JSON Schema object, got {type(parameters).__name__}")
    else:
        fault = json_fault(parameters)
        if fault is not None:
            raise InvalidRequestError(f"{field}.{fault[0]}" if fault[0] else field, fault[1])
        if parameters.get("type", "object") != "object":
            raise InvalidRequestError(f"{field}.type", "must be object (a function's arguments are an object)")
        try:
            text = json.dumps(parameters, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(field, f"not serialisable as JSON: {exc}") from None
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(field, f"{len(text)} characters; at most {MAX_CONSTRAINT_CHARS}")
        if strict:
            _check_strict(parameters, field)
    return ToolSpec(name, description, text, bool(strict), json.dumps(tool, ensure_ascii=False))


def _check_strict(schema: dict, field: str) -> None:
    """OpenAI's strict mode: every object schema sets ``additionalProperties: false`` and lists
    all its properties in ``required``."""
    stack: list[tuple[Any, str]] = [(schema, field)]
    while stack:
        node, path = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") == "object" or "properties" in node:
            properties = node.get("properties", {})
            if node.get("additionalProperties") is not False:
                raise InvalidRequestError(path, "strict mode needs additionalProperties: false on every object")
            required = node.get("required", [])
            if isinstance(properties, dict) and (not isinstance(required, list) or set(required) != set(properties)):
                raise InvalidRequestError(path, "strict mode needs every property listed in required")
        for key in ("properties", "$defs", "definitions"):
            sub = node.get(key)
            if isinstance(sub, dict):
                stack.extend((v, f"{path}.{key}.{k}") for k, v in sub.items())
        for key in ("items", "anyOf", "prefixItems"):
            if key in node:
                stack.append((node[key], f"{path}.{key}"))


def arguments_object(text: Any, field: str) -> dict[str, Any]:
    """An assistant message's call arguments (the API's JSON text, or an object) as the object
    a chat template renders."""
    if isinstance(text, dict):
        return text
    if not isinstance(text, str):
        raise InvalidRequestError(field, "must be the arguments' JSON text")
    try:
        value = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError):
        raise InvalidRequestError(field, "is not valid JSON") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(field, "must be a JSON object")
    return value
