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

The thread is a daemon, for the reason ``prompt_encoder`` gives: a worker told to stop exits at
once instead of waiting for a compile nobody will use.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from qil_worker.errors import InvalidRequestError
from qil_worker.service.protocol import Submit
from qil_worker.structured.spec import CONSTRAINT_KINDS, ConstraintSpec

log = logging.getLogger("qil.worker")

# Constraints compiled lately that are looked up in the loop; a quarter of the compiler's cache
# (qil_worker.structured.compiler.CACHE_SIZE, which also keeps those that failed to compile).
INLINE_RECENT = 64


@dataclass
class _Pending:
    submit: Submit  # the constraint still as Engine.submit's keyword (``json_schema``...)
    compiled: Future
    cancelled: bool = field(default=False)


class ConstraintCompiles:
    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._queue: queue.SimpleQueue[tuple[Future, ConstraintSpec] | object | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started on first use
        self._pending: dict[str, _Pending] = {}
        # specs compiled (or refused) lately, least recent first; written on the thread, read in
        # the loop (under the lock)
        self._recent: collections.OrderedDict[ConstraintSpec, None] = collections.OrderedDict()
        self._recent_lock = threading.Lock()

    @staticmethod
    def takes(options: dict[str, Any]) -> bool:
        """Whether a submit asks for a constraint (``json_object`` False asks for none)."""
        return any(options.get(kind) not in (None, False) for kind in CONSTRAINT_KINDS)

    def start(self, submit: Submit, cancelled: bool = False) -> None:
        """Begin compiling a ``Submit``'s constraint (``cancelled``: a cancel came already)."""
        compiled: Future = Future()
        self._pending[submit.request_id] = _Pending(submit, compiled, cancelled)
        try:
            spec = ConstraintSpec.from_kwargs(**{k: submit.options.get(k) for k in CONSTRAINT_KINDS})
        except Exception as exc:  # noqa: BLE001 - rejected with its submit, in order
            compiled.set_exception(exc)
            return
        with self._recent_lock:
            recent = spec in self._recent
        if recent:
            self._compile(compiled, spec)  # a cache hit (or its remembered refusal): no thread hop
        else:
            self._put((compiled, spec))

    def _compile(self, compiled: Future, spec: ConstraintSpec) -> None:
        try:
            compiled.set_result(self._engine.compile_constraint(spec))
        except BaseException as exc:  # noqa: BLE001 - handed to the loop with its submit
            compiled.set_exception(exc)
            if type(exc) is not InvalidRequestError:
                return  # a time-out (a subclass) or a missing library: the compiler forgets it
        with self._recent_lock:
            self._recent[spec] = None
            self._recent.move_to_end(spec)
            while len(self._recent) > INLINE_RECENT:
                self._recent.popitem(last=False)

    def _put(self, item: object) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="qil-compile", daemon=True)
            self._thread.start()
        self._queue.put(item)

    def _run(self) -> None:
        """The compiling thread: one constraint at a time, in submission order, until ``close``."""
        while (item := self._queue.get()) is not None:
            compiled, spec = item
            if compiled.set_running_or_notify_cancel():
                self._compile(compiled, spec)

    def cancel(self, rid: str) -> bool:
        """A cancel for a request still being compiled: it ends as soon as it is submitted."""
        pending = self._pending.get(rid)
        if pending is None:
            return False
        pending.cancelled = True
        return True

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` for a compile to finish; whether one has."""
        done, _ = wait([p.compiled for p in self._pending.values()], timeout, FIRST_COMPLETED)
        return bool(done)

    def finished(self) -> list[tuple[Submit, BaseException | None, bool]]:
        """``(submit, error, cancelled)`` for every compile done since the last call, in
        submission order: the ``Submit`` with its constraint compiled (``options["constraint"]``,
        the original when compiling raised ``error``), and whether a cancel came meanwhile."""
        done = []
        for rid, pending in list(self._pending.items()):
            if not pending.compiled.done():
                continue
            del self._pending[rid]
            error = pending.compiled.exception()
            submit = pending.submit
            if error is None:
                options = {k: v for k, v in submit.options.items() if k not in CONSTRAINT_KINDS}
                options["constraint"] = pending.compiled.result()
                submit = dataclasses.replace(submit, options=options)
            done.append((submit, error, pending.cancelled))
        return done

    def close(self) -> None:
        """Drop what is still queued; a compile under way is abandoned with its daemon thread."""
        for pending in self._pending.values():
            pending.compiled.cancel()
        self._queue.put(None)
