"""Compiling a ``ConstraintSpec`` into an llguidance matcher: bounded, cached, thread-safe.

The worker compiles beside its step loop (the library releases the GIL while it builds), so
everything here may be called from several threads. llguidance is imported on first use only.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Collection, Sequence
from typing import Any

from qil_worker.errors import FeatureUnavailableError, InvalidRequestError
from qil_worker.structured.matcher import CompiledConstraint
from qil_worker.structured.spec import TOOL_CALLS, ConstraintSpec
from qil_worker.structured.thinking import ANSWER_PROBE, after_thinking
from qil_worker.structured.tool_grammar import TAGS, tool_grammar

INSTALL_HINT = "pip install 'qil[structured]'"
GBNF_HINT = "grammar takes llguidance's Lark dialect; GBNF converts with llguidance.gbnf_to_lark"
CACHE_SIZE = 256  # compiled constraints kept (least recently used dropped first)
COMPILE_TIMEOUT_S = 2.0  # a compile taking longer is refused (the limits below bound its work)
# JSON without free whitespace: a model cannot loop in spaces, and outputs are compact.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# llguidance's work limits (LLParserLimits): what a hostile grammar can cost before it is an error
# at compile time or, for the lazily built lexer, mid-generation (that request fails).
PARSER_LIMITS = dict(
    max_grammar_size=50_000,  # symbols in the grammar's productions
    initial_lexer_fuel=1_000_000,  # building the lexer's regexes (about 20 ms of work)
    step_lexer_fuel=200_000,  # one mask (about 15 ms)
    step_max_items=50_000,  # Earley items per mask
    max_lexer_states=50_000,  # lazily built lexer states (1-2 kB each)
    max_items_in_row=2_000,
    verbose_errors=False,  # messages go back to callers: no parser state dumps
)


# The library builds a grammar recursively: a few thousand mutually recursive Lark rules (legal
# within MAX_CONSTRAINT_CHARS) overflow a default thread stack (8 MiB) and kill the process.
# The compile thread gets this much instead; untouched stack costs only address space.
COMPILE_STACK_BYTES = 256 << 20
_stack_size_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


def _start_with_big_stack(target: Any) -> threading.Thread:
    with _stack_size_lock:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=target, name="qil-grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    return thread


# The matcher's stop reasons, which it gives as the whole error when a grammar is refused before
# its first token (with the parser's state, here not verbose: "<non-verbose/>") → what they mean.
STOP_REASONS = {
    "NoExtensionBias": "no output can match it (a schema that only refers to itself, say)",
    "NoExtension": "no output can match it",
    "LexerTooComplex": "it is too complex: building its lexer exceeds the server's limits",
    "ParserTooComplex": "it is too complex: parsing it exceeds the server's limits",
    "InternalError": "the grammar library failed on it",
}


def plain_message(message: str) -> str:
    """The grammar library's refusal in words a caller can act on: its stop reasons named,
    its parser-state placeholder dropped."""
    head, _, rest = message.partition("\n")
    rest = rest.replace("<non-verbose/>", "").strip()
    meaning = STOP_REASONS.get(head.strip())
    if meaning is None:
        return message.replace("<non-verbose/>", "").strip()
    return f"{meaning}{f' ({rest})' if rest else ''}"


class CompileTimeout(InvalidRequestError):
    """A constraint took longer than the compile time limit."""


def load_llguidance() -> Any:
    """The llguidance module, or FeatureUnavailableError saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise FeatureUnavailableError(
            f"structured output needs llguidance, which is not installed ({INSTALL_HINT})"
        ) from None
    return llguidance


def grammar_text(llguidance: Any, spec: ConstraintSpec, token_tags: Collection[str] = ()) -> str:
    """The llguidance grammar of a spec, after a reasoning block when the spec lets one come
    first; InvalidRequestError when the text is not one. ``token_tags``: the tool-call and
    reasoning tags the tokenizer has as tokens."""
    grammar = _own_grammar(llguidance, spec, token_tags)
    return after_thinking(grammar, token_tags) if spec.after_thinking else grammar


def _own_grammar(llguidance: Any, spec: ConstraintSpec, token_tags: Collection[str]) -> str:
    ll = llguidance.LLMatcher
    try:
        if spec.kind == "json_schema":
            return ll.grammar_from_json_schema(spec.value, overrides=JSON_OPTIONS)
        if spec.kind == "json_object":
            return ll.grammar_from_json_schema('{"type":"object"}', overrides=JSON_OPTIONS)
        if spec.kind == "regex":
            return ll.grammar_from_regex(spec.value)
        if spec.kind == "grammar":  # llguidance's Lark dialect (GBNF: llguidance.gbnf_to_lark)
            return ll.grammar_from_lark(spec.value)
        if spec.kind == TOOL_CALLS:
            return tool_grammar(spec.value, token_tags)
        if spec.kind == "choice":  # JSON string syntax is Lark's literal syntax
            return ll.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.value))
    except (ValueError, RecursionError, KeyError, TypeError) as exc:
        raise InvalidRequestError(spec.kind, str(exc)) from None
    raise InvalidRequestError("constraint", f"unknown constraint kind {spec.kind!r}")


class GrammarCompiler:
    """Compiles constraints for one model and tokenizer; one per engine.

    ``vocab_size`` is the model's (the mask width; ids beyond the tokenizer are never allowed),
    ``eos_token_ids`` the ids that may end a complete output. llguidance's view of the tokenizer
    is built on the first compile (or ``warm()``): a second or two and some 100 MB at a
    150k vocabulary, once per engine.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = CACHE_SIZE,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        self._ll = load_llguidance()
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._cache_size = cache_size
        self._timeout = compile_timeout_s
        self._limits = self._ll.LLParserLimits(**PARSER_LIMITS)
        self._ll_tokenizer: Any = None
        self._token_tags: frozenset[str] = frozenset()  # TAGS that are tokens (set with the above)
        self._tokenizer_lock = threading.Lock()
        self._cache_lock = threading.Lock()
        # spec -> CompiledConstraint, or the InvalidRequestError it raised (a bad spec sent again
        # costs nothing)
        self._cache: collections.OrderedDict[ConstraintSpec, CompiledConstraint | InvalidRequestError] = (
            collections.OrderedDict()
        )

    @property
    def warmed(self) -> bool:
        """Whether llguidance's tokenizer info is built (the first compile does not pay it)."""
        return self._ll_tokenizer is not None

    def warm(self) -> None:
        """Build llguidance's tokenizer info now: at start, before the step loop serves. Part of
        it (serialising the HF tokenizer to JSON) holds the GIL for a good part of the build, so
        on a thread beside a running loop it would stall the loop about as long."""
        self._tokenizer_info()

    def compile(self, spec: ConstraintSpec) -> CompiledConstraint:
        """The compiled constraint of ``spec`` (cached); InvalidRequestError naming ``spec.kind``
        with the library's message when it does not compile."""
        with self._cache_lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is None:
            hit = self._build(spec)
            if isinstance(hit, CompileTimeout):  # maybe only a busy machine: not remembered
                raise hit
            with self._cache_lock:
                self._cache[spec] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, InvalidRequestError):
            raise InvalidRequestError(hit.field, str(hit)[len(hit.field) + 2 :])
        return hit

    def _build(self, spec: ConstraintSpec) -> CompiledConstraint | InvalidRequestError:
        tokenizer = self._tokenizer_info()
        try:
            grammar = grammar_text(self._ll, spec, self._token_tags)
        except InvalidRequestError as exc:
            return exc
        outcome: dict[str, Any] = {}

        def construct() -> None:  # llguidance drops the GIL while it builds
            try:
                matcher = self._ll.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
                if not matcher.is_error():
                    # the first mask builds the lexer's first states: errors that show only
                    # then are found now, and every copy starts warm
                    matcher.compute_bitmask()
                if spec.after_thinking and not matcher.is_error():
                    outcome["error"] = self._answer_fault(matcher)
                outcome["matcher"] = matcher
            except Exception as exc:  # noqa: BLE001 - API misuse would surface as the message
                outcome["error"] = f"{type(exc).__name__}: {exc}"

        worker = _start_with_big_stack(construct)
        worker.join(self._timeout)
        if worker.is_alive():  # it runs to its limits in the background; the caller is answered
            return CompileTimeout(spec.kind, f"the constraint did not compile within {self._timeout:g} s")
        matcher = outcome.get("matcher")
        if matcher is None or matcher.is_error() or outcome.get("error"):
            message = plain_message((outcome.get("error") or matcher.get_error()).strip())
            if spec.kind == "grammar" and "::=" in spec.value:
                message += f" ({GBNF_HINT})"
            return InvalidRequestError(spec.kind, message)
        return CompiledConstraint(spec, matcher, self.vocab_size)

    def _answer_fault(self, matcher: Any) -> str | None:
        """What the first mask of the answer after a reasoning block refuses (None: nothing),
        found on a copy fed ``ANSWER_PROBE``."""
        probe = matcher.deep_copy()
        for token in self._tokenizer.encode(ANSWER_PROBE, add_special_tokens=False):
            if not probe.consume_token(token):
                return None  # a tokenizer that spells the probe otherwise: nothing to learn
        probe.compute_bitmask()
        return probe.get_error() if probe.is_error() else None

    def _tokenizer_info(self) -> Any:
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                info = self._build_tokenizer_info()
                self._token_tags = frozenset(tags_as_tokens(self._tokenizer, info))
                self._ll_tokenizer = info
            return self._ll_tokenizer

    def _build_tokenizer_info(self) -> Any:
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise FeatureUnavailableError(
                "structured output needs a fast (tokenizer.json) Hugging Face tokenizer; "
                f"this engine's is a {type(self._tokenizer).__name__}"
            )
        import llguidance.hf  # transformers is loaded already: the tokenizer is one of its

        eos = self._eos_token_ids or [self._tokenizer.eos_token_id]
        try:
            return llguidance.hf.from_tokenizer(self._tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        except Exception as exc:  # noqa: BLE001 - a tokenizer llguidance cannot read
            raise FeatureUnavailableError(
                f"structured output cannot use this tokenizer: {type(exc).__name__}: {exc}"
            ) from None


def tags_as_tokens(tokenizer: Any, info: Any) -> list[str]:
    """The tags (``tool_grammar.TAGS``) that are one token each, which llguidance sees as
    special tokens (every added token is one to it) and a grammar must name as such."""
    out = []
    for tag in TAGS:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1 and ids[0] < info.vocab_size and info.is_special_token(ids[0]):
            out.append(tag)
    return out
