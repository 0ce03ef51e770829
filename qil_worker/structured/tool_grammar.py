"""The constraint that holds a request's tool calls to its tools' schemas, in Qwen3's format:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, each call's JSON an
object naming one allowed function with arguments that match its parameters.

The front writes what is asked (``tool_constraint``: the calls' schemas, the mode, parallel
calls, the thinking switch) as the text of a ``tool_calls`` constraint; the worker's compiler
turns it into llguidance's grammar (``tool_grammar``) for its tokenizer, whose tags may be
tokens of their own (Qwen3's are; llguidance then knows them only as special tokens, which a
grammar names as ``<tool_call>``, not as text). Torch- and llguidance-free.

* ``required``: the answer is calls only (one, unless parallel calls); a named function: one
  call of it.
* ``auto``: free text, in which ``<tool_call>`` triggers the constraint until the block
  closes; text after it is free again. Free text is one lexeme, so it costs the matcher a
  regex state per token, not a parse of the calls.

A reasoning block (``<think>...</think>``) may come first unless the prompt turned thinking
off: the constraint is the answer's, not the thinking's.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from qil_worker.structured.tools import ToolRequest, ToolSpec

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
# the calls' JSON in Qwen3's ``json.dumps`` style, whitespace fixed so a model cannot loop in it
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON Schema of one call of ``tool``: its name, then its arguments (in that order, as
    Qwen3 writes them and ``AssistantOutput`` streams them)."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": json.loads(tool.parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_constraint(request: ToolRequest, thinking: bool | None) -> str:
    """The ``tool_calls`` constraint's text for ``request`` (compact JSON: equal requests give
    equal text, which the compiler's cache is keyed by); ``thinking``: the prompt's switch."""
    return json.dumps({
        "calls": [call_schema(t) for t in request.allowed],
        "auto": request.choice == "auto",
        "parallel": request.parallel and request.named is None,  # a named function: one call
        "thinking": thinking,
    }, ensure_ascii=False, separators=(",", ":"))


def tool_options(request: ToolRequest, thinking: bool | None) -> dict[str, Any]:
    """What a request with tools adds to ``RequestSpec.of``'s options: the tools for the chat
    template and, unless ``tool_choice`` is none, the constraint of the calls."""
    options: dict[str, Any] = {"tools": request.template_tools()}
    if request.calls_parsed:
        options["tool_calls"] = tool_constraint(request, thinking)
    return options


def tool_grammar(constraint: str, token_tags: Collection[str]) -> str:
    """llguidance's top-level grammar (JSON text) of a ``tool_constraint``: a Lark grammar of
    the answer whose calls are a JSON-schema subgrammar. ``token_tags``: those of ``TAGS`` the
    tokenizer has as tokens of their own."""
    value = json.loads(constraint)
    schemas = value["calls"]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    grammars = [{"lark_grammar": _lark(value, set(token_tags))},
                {"name": "call", "json_schema": {**body, "x-guidance": JSON_STYLE}}]
    return json.dumps({"grammars": grammars}, ensure_ascii=False)


def _tag(tag: str, tokens: set[str]) -> str:
    return tag if tag in tokens else json.dumps(tag)


def _lark(value: dict[str, Any], tokens: set[str]) -> str:
    call_open, call_close = _tag("<tool_call>", tokens), _tag("</tool_call>", tokens)
    lines = ["%llguidance {}", f'call: {call_open} "\\n" @call "\\n" {call_close}']
    thinking = value["thinking"] is not False
    head = "(think GAP)? " if thinking else ""
    if value["auto"]:
        # free text holds no tag written out in characters, so every block is a constrained one
        lines.append(f'start: {head}(TEXT call)* TEXT')
        lines.append('TEXT: /(.|\\n)*/ & ~/(?s:.*)<tool_call>(?s:.*)/')
        if "<tool_call>" not in tokens:
            # the tag is text: the text before a block is lazy, ending at the tag
            lines[-2:] = [f"start: {head}(pre call_body)* TEXT",
                          'pre[lazy]: /(.|\\n)*<tool_call>/',
                          f'call_body: "\\n" @call "\\n" {call_close}',
                          lines[-1]]
    else:
        calls = 'call ("\\n" call)*' if value["parallel"] else "call"
        lines.append(f"start: {head}{calls}")
    if thinking:
        if "<think>" in tokens and "</think>" in tokens:
            lines.append("think: <think> /(.|\\n)*/ </think>")
        else:
            lines.append("think[lazy]: /<think>(.|\\n)*<\\/think>/")
        lines.append("GAP: /\\n{0,2}/")  # Qwen3's blank between reasoning and answer, bounded
    return "\n".join(lines) + "\n"
