"""A request's structured-output constraint on the client side: the keyword arguments of
``submit_request`` and the flags of both command lines (``python -m qil_client`` and ``python -m
qil_worker generate``, which imports this module: the client package must not import the worker).

At most one of ``json_schema`` (a JSON Schema as text or as a dict), ``json_object`` (True: any
JSON object), ``regex``, ``grammar`` (llguidance's Lark dialect) or ``choice`` (a list of
strings). The server checks and compiles them (INVALID_ARGUMENT naming the field with the grammar
library's message); here only what the wire cannot carry is refused.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qil_client._proto.qil.v1 import inference_pb2 as pb

# The members of SubmitRequest's ``constraint`` oneof, which are also Engine.submit's keywords.
NAMES = tuple(f.name for f in pb.SubmitRequest.DESCRIPTOR.oneofs_by_name["constraint"].fields)


def given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The constraint keyword arguments that ask for something (None and ``json_object=False``
    ask for nothing); ValueError naming the second when several do."""
    chosen = {n: values[n] for n in NAMES if values.get(n) is not None and values.get(n) is not False}
    if len(chosen) > 1:
        names = list(chosen)
        raise ValueError(
            f"{names[1]}: give at most one of {', '.join(NAMES)}, not {' and '.join(names)}"
        )
    return chosen


def set_constraint(req: pb.SubmitRequest, name: str, value: Any) -> None:
    """Put one constraint on ``req``; TypeError naming the field for a value of the wrong type."""
    if name == "json_schema":
        if isinstance(value, Mapping):
            try:
                value = json.dumps(value, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"json_schema: not serialisable as JSON: {exc}") from None
        if not isinstance(value, str):
            raise TypeError(f"json_schema: expected a str or a dict, got {type(value).__name__}")
        req.json_schema = value
    elif name == "json_object":
        if value is not True:
            raise TypeError(f"json_object: expected True (or False / None for none), got {value!r}")
        req.json_object = True
    elif name == "choice":
        if isinstance(value, (str, bytes)):
            raise TypeError("choice: expected a list of strings, not a string")
        choices = _iterable(value)
        if not all(isinstance(c, str) for c in choices):
            raise TypeError("choice: expected a list of strings")
        req.choice.SetInParent()  # sent even when empty: the server then names the empty list
        req.choice.choices.extend(choices)
    else:  # regex, grammar
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
        setattr(req, name, value)


def _iterable(value: Any) -> list:
    try:
        return list(value)
    except TypeError:
        raise TypeError("choice: expected a list of strings") from None


# ---------------------------------------------------------------- command lines


def _schema(text: str) -> str:
    """``--json-schema``: a file's content, or the text itself; either must be JSON."""
    path = Path(text)
    source = "inline JSON"
    if not text.lstrip().startswith(("{", "[")) and path.is_file():
        text, source = path.read_text(encoding="utf-8"), str(path)
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"expected a JSON schema file or inline JSON; {source} is not JSON: {exc}"
        ) from None
    return text


def _grammar_file(text: str) -> str:
    """``--grammar``: the content of a file."""
    try:
        return Path(text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the grammar file {text!r}: {exc}") from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--json-schema``, ``--json-object``, ``--regex``, ``--grammar``, ``--choice``: mutually
    exclusive, each unset by default (no constraint)."""
    group = parser.add_argument_group(
        "structured output", "constrain the output (at most one of these; default: none)"
    ).add_mutually_exclusive_group()
    group.add_argument("--json-schema", type=_schema, default=None, metavar="FILE_OR_JSON",
                       help="the output is compact JSON valid under this JSON Schema (a file, or inline JSON)")
    group.add_argument("--json-object", action="store_true", default=None,
                       help="the output is a compact JSON object")
    group.add_argument("--regex", default=None, help="the output full-matches this regular expression")
    group.add_argument("--grammar", type=_grammar_file, default=None, metavar="FILE",
                       help="the output follows this grammar file (llguidance's Lark dialect)")
    group.add_argument("--choice", action="append", default=None,
                       help="the output is exactly one of these strings (repeatable)")


def from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The constraint the command line gave, as keyword arguments (empty: none)."""
    return given({name: getattr(args, name) for name in NAMES})
