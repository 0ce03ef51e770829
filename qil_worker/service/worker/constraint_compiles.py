"""Structured-output constraints compiled on a thread beside the worker's step loop.

A usual schema compiles in a few ms, but a large one (a long enum, many properties) takes up to
the grammar library's limits, and the first compile of a process builds the tokenizer's token
tables for the library (1–2 s at a 151k vocabulary). In the step loop that would stall every
stream; on a thread the loop steps on meanwhile (llguidance releases the GIL while it works). A
constrained request is acknowledged to the front once its constraint is compiled and the engine
accepted it; a cancel that arrives before then ends it right after. A constraint among the
last ``INLINE_RECENT`` this worker compiled is still in the compiler's cache (its LRU holds more,
and only this worker uses it), so it is looked up in the loop: it never waits behind a slow
compile on the thread. Mirrors ``prompt_encoder`` (and runs after it: a long text prompt is
encoded first, then its constraint compiled).

The thread and the waiting submits are ``beside_loop``'s.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

from qil_worker.engine.spec import RequestSpec
from qil_worker.errors import InvalidRequestError
from qil_worker.service.worker.beside_loop import Pending, SideThread, WaitingSubmits, run_now, wait_any
from qil_worker.structured.spec import ConstraintSpec

log = logging.getLogger("qil.worker")

# Constraints compiled lately that are looked up in the loop; a quarter of the compiler's cache
# (qil_worker.structured.compiler.CACHE_SIZE, which also keeps those that failed to compile).
INLINE_RECENT = 64


class ConstraintCompiles:
    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._thread = SideThread("qil-compile")
        # submits whose constraint is still as Engine.submit's keyword (``json_schema``...)
        self._waiting = WaitingSubmits()
        # specs compiled (or refused) lately, least recent first; written on the thread, read in
        # the loop (under the lock)
        self._recent: collections.OrderedDict[ConstraintSpec, None] = collections.OrderedDict()
        self._recent_lock = threading.Lock()

    @staticmethod
    def takes(spec: RequestSpec) -> bool:
        """Whether a submit asks for a constraint."""
        return spec.constraint is not None

    def start(self, submit: Pending, cancelled: bool = False) -> None:
        """Begin compiling a submit's constraint (``cancelled``: a cancel came already)."""
        constraint = submit.spec.constraint
        assert constraint is not None
        with self._recent_lock:
            recent = constraint in self._recent
        # a cache hit (or its remembered refusal) needs no thread hop
        compiled = run_now(self._compile, constraint) if recent else self._thread.run(self._compile, constraint)
        self._waiting.add(submit, compiled, cancelled)

    def _compile(self, spec: ConstraintSpec) -> Any:
        """The compiled constraint; a refusal (``InvalidRequestError``) is remembered as recent
        too, a time-out (a subclass) or a missing library is not: the compiler forgets those."""
        try:
            compiled = self._engine.compile_constraint(spec)
        except InvalidRequestError as exc:
            if type(exc) is InvalidRequestError:
                self._remember(spec)
            raise
        self._remember(spec)
        return compiled

    def _remember(self, spec: ConstraintSpec) -> None:
        with self._recent_lock:
            self._recent[spec] = None
            self._recent.move_to_end(spec)
            while len(self._recent) > INLINE_RECENT:
                self._recent.popitem(last=False)

    def cancel(self, rid: str) -> bool:
        """A cancel for a request still being compiled: it ends as soon as it is submitted."""
        return self._waiting.cancel(rid)

    @property
    def busy(self) -> bool:
        return bool(self._waiting)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` for a compile to finish; whether one has."""
        return wait_any(self._waiting.futures(), timeout)

    def finished(self) -> list[tuple[Pending, BaseException | None, bool]]:
        """``(submit, error, cancelled)`` for every compile done since the last call, in
        submission order: the submit with its constraint compiled (the original when compiling
        raised ``error``), and whether a cancel came meanwhile."""
        def prepared(submit: Pending, compiled: Any) -> Pending:
            return Pending(dataclasses.replace(submit.spec, constraint=None), compiled)

        return self._waiting.finished(prepared)

    def close(self) -> None:
        """Drop what is still queued; a compile under way is abandoned with its daemon thread."""
        self._waiting.drop()
        self._thread.close()
