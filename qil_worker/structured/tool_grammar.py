"""The constraint that holds a request's tool calls to its tools' schemas, in Qwen3's format:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks, each call's JSON an
object naming one allowed function with arguments that match its parameters.

The front writes what is asked (``tool_constraint``: the calls' schemas, the mode, parallel
calls) as the text of a ``tool_calls`` constraint; the worker's compiler
turns it into llguidance's grammar (``tool_grammar``) for its tokenizer, whose tags may be
tokens of their own (Qwen3's are; llguidance then knows them only as special tokens, which a
grammar names as ``<tool_call>``, not as text). Torch- and llguidance-free.

* ``required``: the answer is calls only (one, unless parallel calls); a named function: one
  call of it.
* ``auto``: free text, in which ``<tool_call>`` triggers the constraint until the block
  closes; text after it is free again. Free text is one lexeme, so it costs the matcher a
  regex state per token, not a parse of the calls.
* ``none``: free text that never opens a block: the ``<tool_call>`` token is masked (as text,
  the tag is excluded), so no call, nor a call's text in the content, can come out. The tools
  are still rendered into the prompt, as OpenAI and vLLM (unless its
  ``--exclude-tools-when-tool-choice-none``) do.

A reasoning block (``<think>...</think>``) before the answer is every constraint's
(``ConstraintSpec.after_thinking``, ``structured.thinking``), not this grammar's.
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


def tool_constraint(request: ToolRequest) -> str:
    """The ``tool_calls`` constraint's text for ``request`` (compact JSON: equal requests give
    equal text, which the compiler's cache is keyed by)."""
    if not request.calls_parsed:
        return json.dumps({"none": True}, separators=(",", ":"))
    return json.dumps({
        "calls": [call_schema(t) for t in request.allowed],
        "auto": request.choice == "auto",
        "parallel": request.parallel and request.named is None,  # a named function: one call
    }, ensure_ascii=False, separators=(",", ":"))


def tool_options(request: ToolRequest, constrained: bool = False) -> dict[str, Any]:
    """What a request with tools adds to ``RequestSpec.of``'s options: the tools for the chat
    template and the ``tool_calls`` constraint. ``constrained``: the request gives a constraint
    of its own, which only ``tool_choice`` none allows (the caller refuses the others); it then
    stands instead of the no-calls one (its lexemes never write the ``<tool_call>`` token)."""
    options: dict[str, Any] = {"tools": request.template_tools()}
    if request.calls_parsed or not constrained:
        options["tool_calls"] = tool_constraint(request)
    return options


def parses_calls(constraint: str) -> bool:
    """Whether a ``tool_constraint``'s output holds calls to parse (not ``none``'s)."""
    return not json.loads(constraint).get("none", False)


def tool_grammar(constraint: str, token_tags: Collection[str]) -> str:
    """llguidance's top-level grammar (JSON text) of a ``tool_constraint``: a Lark grammar of
    the answer whose calls are a JSON-schema subgrammar. ``token_tags``: those of ``TAGS`` the
    tokenizer has as tokens of their own."""
    value = json.loads(constraint)
    if value.get("none"):
        return json.dumps({"grammars": [{"lark_grammar": _no_calls_lark()}]})
    schemas = value["calls"]
    body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    grammars = [{"lark_grammar": _lark(value, set(token_tags))},
                {"name": "call", "json_schema": {**body, "x-guidance": JSON_STYLE}}]
    return json.dumps({"grammars": grammars}, ensure_ascii=False)


# free text that holds no tag written out in characters; a tag that is a token of its own
# is a special token to llguidance, which no regex matches
_TEXT = 'TEXT: /(.|\\n)*/ & ~/(?s:.*)<tool_call>(?s:.*)/'


def _no_calls_lark() -> str:
    return "\n".join(["%llguidance {}", "start: TEXT", _TEXT]) + "\n"


def _tag(tag: str, tokens: set[str]) -> str:
    return tag if tag in tokens else json.dumps(tag)


def _lark(value: dict[str, Any], tokens: set[str]) -> str:
    call_open, call_close = _tag("<tool_call>", tokens), _tag("</tool_call>", tokens)
    lines = ["%llguidance {}", f'call: {call_open} "\\n" @call "\\n" {call_close}']
    if value["auto"]:
        # free text holds no tag written out in characters, so every block is a constrained one
        lines.append('start: (TEXT call)* TEXT')
        lines.append(_TEXT)
        if "<tool_call>" not in tokens:
            # the tag is text: the text before a block is lazy, ending at the tag
            lines[-2:] = ["start: (pre call_body)* TEXT",
                          'pre[lazy]: /(.|\\n)*<tool_call>/',
                          f'call_body: "\\n" @call "\\n" {call_close}',
                          lines[-1]]
    else:
        calls = 'call ("\\n" call)*' if value["parallel"] else "call"
        lines.append(f"start: {calls}")
    return "\n".join(lines) + "\n"
