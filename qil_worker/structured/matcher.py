"""A compiled constraint and the per-request matcher state drawn from it (no llguidance import
here: the objects wrap matchers the compiler built)."""

from __future__ import annotations

import threading
from typing import Any

from qil_worker.structured.spec import ConstraintSpec


class ConstraintMatcher:
    """One request's place in its grammar, advanced by every token the request accepts.

    It lives with the request, not with its KV pages: a preempted request keeps its output tokens
    and so its matcher state, and recomputes only the KV.
    """

    __slots__ = ("llmatcher",)

    def __init__(self, llmatcher: Any) -> None:
        self.llmatcher = llmatcher  # llguidance.LLMatcher

    def fill_mask(self, address: int, num_bytes: int) -> None:
        """Write the allowed next tokens as a bitmask (bit ``t`` of 32-bit word ``t // 32``)."""
        self.llmatcher.unsafe_compute_mask_ptr(address, num_bytes)

    @property
    def error(self) -> str | None:
        """The library's message once the matcher failed (it then stays failed), else None."""
        if not self.llmatcher.is_error():
            return None
        return self.llmatcher.get_error() or "the constraint failed"

    def advance(self, token: int) -> str | None:
        """Consume ``token``; None when the grammar allowed it, else why not (the library's words)."""
        if self.llmatcher.consume_token(token):
            return None
        return self.llmatcher.get_error() or f"token {token} is not allowed by the constraint"

    @property
    def accepting(self) -> bool:
        """Whether the output so far is complete (EOS is allowed now)."""
        return self.llmatcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """Whether nothing but EOS can follow: the structure is complete and cannot grow."""
        return self.llmatcher.is_stopped()


class CompiledConstraint:
    """A grammar compiled once for a ``ConstraintSpec``; each request takes a fresh matcher from it
    (a copy of a template matcher: microseconds, where compiling takes milliseconds)."""

    def __init__(self, spec: ConstraintSpec, template: Any, vocab_size: int) -> None:
        self.spec = spec
        self.vocab_size = vocab_size  # the mask width: the model's vocabulary
        self._template = template
        self._lock = threading.Lock()  # copies may be taken from several threads

    def new_matcher(self) -> ConstraintMatcher:
        with self._lock:
            return ConstraintMatcher(self._template.deep_copy())

    def __repr__(self) -> str:
        return f"CompiledConstraint({self.spec.kind})"
