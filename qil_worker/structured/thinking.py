"""A constraint that applies after the model's reasoning: a ``<think>...</think>`` block may come
first, free, then the constraint's own grammar starts (a chat prompt that leaves thinking on).

One wrapper for every kind (a JSON schema, a regex, a Lark grammar, the tool calls): a Lark
grammar whose start is the optional block, a bounded blank, then the constraint as a named
subgrammar. Torch- and llguidance-free: it writes llguidance's grammar text.
"""

from __future__ import annotations

import json
from collections.abc import Collection

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER = "answer"  # the name of the constraint's grammar when it has none
# an empty reasoning block and the longest blank after it: where the answer's grammar starts.
# A grammar no output can match is refused at its first mask; behind the optional block that
# mask is the block's, so the compiler probes the answer's start with this text too.
ANSWER_PROBE = "<think></think>\n\n"


def after_thinking(grammar: str, token_tags: Collection[str]) -> str:
    """llguidance's top-level grammar (JSON text) that lets a reasoning block precede
    ``grammar`` (a top-level grammar's JSON text, or Lark text). ``token_tags``: the tags the
    tokenizer has as tokens of their own (then named as special tokens, not as text)."""
    grammars = _grammars(grammar)
    first = grammars[0]
    name = first.get("name") or ANSWER
    first["name"] = name
    head = {"lark_grammar": _lark(name, set(token_tags))}
    return json.dumps({"grammars": [head, *grammars]}, ensure_ascii=False)


def _grammars(grammar: str) -> list[dict]:
    """The grammars of a top-level grammar: llguidance gives JSON for schemas and regexes and
    the text itself for Lark."""
    try:
        value = json.loads(grammar)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("grammars"), list) and value["grammars"]:
        return [dict(g) for g in value["grammars"]]
    return [{"lark_grammar": grammar}]


def _lark(name: str, tokens: set[str]) -> str:
    if THINK_OPEN in tokens and THINK_CLOSE in tokens:
        think = f"think: {THINK_OPEN} /(.|\\n)*/ {THINK_CLOSE}"
    else:
        think = "think[lazy]: /<think>(.|\\n)*<\\/think>/"
    return "\n".join([
        "%llguidance {}",
        f"start: (think GAP)? @{name}",
        think,
        "GAP: /\\n{0,2}/",  # Qwen3's blank between reasoning and answer, bounded
    ]) + "\n"
