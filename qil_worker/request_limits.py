"""The size limits of one request, listed once (torch-free).

Each bounds something a request makes the server allocate or repeat: both fronts (gRPC and
HTTP) and the engine check against these same numbers, and the fronts check them before they
build anything from a request, so a huge count is refused before it costs memory or time.
``docs/requests.md`` lists them for callers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from qil_worker.errors import InvalidRequestError

MAX_REQUEST_ID_LENGTH = 128
# Samples of one prompt (``n``): they all run at once after the fork, so they take as many of
# ``max_active``'s slots (64 by default), and a request's events and results grow with it.
MAX_SAMPLES = 64
# Candidates per position of the returned log-probabilities (``top_logprobs``, ``prompt_logprobs``).
MAX_TOP_LOGPROBS = 20
# logit_bias: OpenAI's count. The count bounds what the sampler gathers on the host for every
# biased row in every step (a grammar is the tool for larger token sets).
MAX_LOGIT_BIAS = 300
# Stop strings of one request: the worker matches them against the text after every token, so
# their number and length bound that per-token cost.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LENGTH = 256
# A constraint's text (schema, regex or grammar; also all choices together), checked before
# anything is compiled; the grammar library's own limits bound the compile's work.
MAX_CONSTRAINT_CHARS = 100_000
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024  # one choice
# Tools of one request (function definitions): each is rendered into the prompt and, when a
# call is constrained, its parameters' schema into one grammar, whose text (all schemas
# together) MAX_CONSTRAINT_CHARS bounds.
MAX_TOOLS = 128
MAX_TOOL_NAME_CHARS = 64  # OpenAI's: a-z, A-Z, 0-9, _ and -
MAX_TOOL_DESCRIPTION_CHARS = 8192
MAX_TOOL_GRAMMAR_CHARS = MAX_CONSTRAINT_CHARS + MAX_TOOLS * 512  # the schemas and the grammar around them
# Requests of one HTTP call (prompts x n): each is a request in the engine.
MAX_CALL_CHOICES = 256
# Inputs of one embedding or rerank call: each is a prefill-only request in the engine.
MAX_POOLED_INPUTS = 2048
# Nesting of a JSON body or schema: far beyond any real schema, far below Python's recursion
# limit (which a deeper document would hit in json's encoder and decoder).
MAX_JSON_DEPTH = 128


def check_count(field: str, count: int, limit: int, what: str) -> None:
    """``InvalidRequestError`` naming ``field`` when ``count`` exceeds ``limit``."""
    if count > limit:
        raise InvalidRequestError(field, f"at most {limit} {what}, got {count}")


def check_stop_strings(stops: Sequence[object], field: str = "stop_strings") -> list[str]:
    """``stops`` as a list of 1 to ``MAX_STOP_STRING_LENGTH``-character strings, at most
    ``MAX_STOP_STRINGS`` of them; ``InvalidRequestError`` naming ``field`` otherwise."""
    if isinstance(stops, (str, bytes)) or not isinstance(stops, Sequence):
        raise InvalidRequestError(field, "must be a list of strings")
    check_count(field, len(stops), MAX_STOP_STRINGS, "stop strings")
    for s in stops:
        if not isinstance(s, str):
            raise InvalidRequestError(field, f"must be strings, got {type(s).__name__}")
        if not s or len(s) > MAX_STOP_STRING_LENGTH:
            raise InvalidRequestError(
                field, f"each must have 1 to {MAX_STOP_STRING_LENGTH} characters, got {len(s)}"
            )
    return list(stops)


_SURROGATE = re.compile("[\ud800-\udfff]")
_LONE_SURROGATE = "holds a lone UTF-16 surrogate (not valid Unicode text)"
MAX_PATH_CHARS = 60  # of a fault's path in its message
_WALKED = frozenset({str, dict, list})  # the types json.loads makes that may hold a fault


def json_fault(value: object, max_depth: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """The first thing in a parsed JSON document that the server cannot take, as (path, what):
    nesting deeper than ``max_depth`` (Python's own recursion limit would fail later, in
    whatever walks it) or a string holding a lone surrogate (JSON's ``\\ud800`` escapes decode
    to one; it is not Unicode text, so no tokenizer or encoder takes it). None when neither.

    The path starts with the top-level key (``messages[3].content``), cut at
    ``MAX_PATH_CHARS``. Iterative, and numbers are skipped where they lie: a document nested as
    deep as the parser allows, or a prompt of a million ids, is walked without recursion."""
    stack: list[tuple[object, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if _lone_surrogate(item):
                return _short(path), _LONE_SURROGATE
            continue
        if depth >= max_depth:
            return _short(path), f"nested deeper than {max_depth} levels"
        if isinstance(item, dict):
            for key, child in reversed(item.items()):
                if _lone_surrogate(key):
                    return _short(path or "body"), "a key " + _LONE_SURROGATE
                if type(child) in _WALKED:
                    stack.append((child, f"{path}.{key}" if path else key, depth + 1))
        else:  # a list (what json.loads makes besides dicts and scalars)
            inner = [i for i, child in enumerate(item) if type(child) in _WALKED]  # type: ignore[arg-type]
            stack.extend((item[i], f"{path}[{i}]", depth + 1) for i in reversed(inner))  # type: ignore[index]
    return None


def _lone_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _short(path: str) -> str:
    return path if len(path) <= MAX_PATH_CHARS else path[:MAX_PATH_CHARS] + "..."
