"""What a request asks its output to match, validated and normalised; torch- and llguidance-free
(the torch-free front may import it to check a request before it reaches the worker)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from qil_worker.errors import InvalidRequestError
from qil_worker.request_limits import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_CONSTRAINT_CHARS, MAX_TOOL_GRAMMAR_CHARS, json_fault

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# the constraint of a request's tool calls: a grammar the front writes from the tools
# (``tool_grammar``), not an option of its own
TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class ConstraintSpec:
    """One constraint of a request: ``kind`` is one of ``CONSTRAINT_KINDS``; ``value`` is the
    schema as JSON text (``json_schema``), ``True`` (``json_object``), the regex or Lark grammar
    text, or the tuple of choices. ``after_thinking``: the output may open with a reasoning
    block (``<think>...</think>``, free) before the constraint applies (a chat prompt that
    leaves thinking on; ``structured.thinking``). Hashable: the compiler caches compiled
    grammars by it."""

    kind: str
    value: str | tuple[str, ...] | bool
    after_thinking: bool = False

    @classmethod
    def from_kwargs(
        cls,
        json_schema: str | dict | None = None,
        json_object: bool | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        choice: list[str] | tuple[str, ...] | None = None,
        tool_calls: str | None = None,
        after_thinking: bool = False,
    ) -> "ConstraintSpec | None":
        """The request's constraint, or None without one; ``InvalidRequestError`` naming the
        field for a bad value or for a second constraint (a request has at most one).

        ``json_object`` False is the same as not given; ``choice`` is given once it is not None
        (an empty list is refused, not ignored).
        """
        given = {
            "json_schema": json_schema,
            "json_object": json_object if json_object is not False else None,
            "regex": regex,
            "grammar": grammar,
            "choice": choice,
            TOOL_CALLS: tool_calls,
        }
        present = [kind for kind, value in given.items() if value is not None]
        if not present:
            return None
        if len(present) > 1:
            raise InvalidRequestError(
                present[1], f"a request takes one constraint; {present[0]} is given too"
            )
        kind = present[0]
        return cls(kind, _normalised(kind, given[kind]), after_thinking)


def _normalised(kind: str, value: object) -> str | tuple[str, ...] | bool:
    if kind == "json_schema":
        return _schema_text(value)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(kind, f"must be a boolean, got {value!r}")
        return True
    if kind in ("regex", "grammar", TOOL_CALLS):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(kind, "must be a non-empty string")
        _check_size(kind, value)
        return value
    return _choices(value)


def _schema_text(value: object) -> str:
    if isinstance(value, dict):
        _check_json(value)
        try:
            # in its own key order, not sorted: properties are generated in the schema's order
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError("json_schema", f"not serialisable as JSON: {exc}") from None
    elif isinstance(value, str):
        text = value
    else:
        raise InvalidRequestError(
            "json_schema", f"must be a JSON object as a string or a dict, got {type(value).__name__}"
        )
    _check_size("json_schema", text)
    if isinstance(value, str):
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError("json_schema", f"not valid JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidRequestError("json_schema", f"must be a JSON object, got {type(parsed).__name__}")
        _check_json(parsed)
    return text


def _check_json(schema: dict) -> None:
    """Nesting the compiler's recursion could not take, or text that is not Unicode."""
    fault = json_fault(schema)
    if fault is not None:
        path, what = fault
        raise InvalidRequestError("json_schema", f"{path}: {what}" if path else what)


def _choices(value: object) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise InvalidRequestError("choice", "must be a list of strings")
    if not value:
        raise InvalidRequestError("choice", "the list of choices is empty")
    if len(value) > MAX_CHOICES:
        raise InvalidRequestError("choice", f"at most {MAX_CHOICES} choices, got {len(value)}")
    for item in value:
        if not isinstance(item, str) or not item:
            raise InvalidRequestError("choice", f"every choice must be a non-empty string, got {item!r}")
        if len(item) > MAX_CHOICE_CHARS:
            raise InvalidRequestError(
                "choice", f"a choice has {len(item)} characters; at most {MAX_CHOICE_CHARS}"
            )
    if len(set(value)) != len(value):
        duplicate = next(item for i, item in enumerate(value) if item in value[:i])
        raise InvalidRequestError("choice", f"choices must be distinct; {duplicate!r} is given twice")
    total = sum(len(item) for item in value)
    if total > MAX_CONSTRAINT_CHARS:
        raise InvalidRequestError(
            "choice", f"the choices have {total} characters together; at most {MAX_CONSTRAINT_CHARS}"
        )
    return tuple(value)


def _check_size(kind: str, text: str) -> None:
    limit = MAX_TOOL_GRAMMAR_CHARS if kind == TOOL_CALLS else MAX_CONSTRAINT_CHARS
    if len(text) > limit:
        raise InvalidRequestError(kind, f"{len(text)} characters; at most {limit}")
