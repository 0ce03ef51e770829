"""Work done on a thread beside the worker's step loop, and the submits that wait for it.

Two kinds of slow per-request work would stall every stream if the loop did it: tokenizing a
prompt of megabytes (``prompt_encoder``) and compiling a large structured-output constraint
(``constraint_compiles``). Both libraries release the GIL while they work, so each kind runs on
its own ``SideThread``, one job at a time in arrival order, and the loop steps on meanwhile. A
submit whose prompt or constraint is still being prepared waits in ``WaitingSubmits``; a cancel
that arrives meanwhile is remembered and ends the request right after it is submitted.

The threads are daemons: a worker told to stop exits at once instead of waiting for a job
nobody will use (a 16 MiB prompt takes many seconds). ``ThreadPoolExecutor``'s threads are
joined when the process exits, so it is not used here.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from qil_worker.engine.spec import RequestSpec


def run_now(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` run here, as a done future (for jobs quick enough for the loop)."""
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except BaseException as exc:  # noqa: BLE001 - handed to the loop with its job
        done.set_exception(exc)
    return done


class SideThread:
    """A daemon thread running ``fn(*args)`` jobs in arrival order, started on first use."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its future holds the result or what it raised."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()
        done: Future = Future()
        self._queue.put((done, fn, args))
        return done

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            done, fn, args = item
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the loop with its job
                done.set_exception(exc)

    def close(self) -> None:
        """Let the thread end after the job under way (queued jobs' futures: cancel them)."""
        self._queue.put(None)


@dataclass(frozen=True)
class Pending:
    """A submit on its way into the engine: its spec (once encoded, its prompt as ids) and,
    once compiled, its constraint (``Engine.submit(spec, constraint=compiled)``)."""

    spec: RequestSpec
    compiled: Any = None  # a structured.matcher.CompiledConstraint

    @property
    def request_id(self) -> str:
        return self.spec.request_id  # type: ignore[return-value]  # (the front always sets it)


@dataclass
class _Waiting:
    submit: Pending
    ready: Future
    cancelled: bool = field(default=False)


class WaitingSubmits:
    """Submits waiting for a ``Future`` (their prompt encoded, their constraint compiled)."""

    def __init__(self) -> None:
        self._waiting: dict[str, _Waiting] = {}

    def add(self, submit: Pending, ready: Future, cancelled: bool = False) -> None:
        """``cancelled``: a cancel for it came already."""
        self._waiting[submit.request_id] = _Waiting(submit, ready, cancelled)

    def cancel(self, rid: str) -> bool:
        """A cancel for a waiting request: it ends as soon as it is submitted; False when
        ``rid`` is not waiting here."""
        waiting = self._waiting.get(rid)
        if waiting is None:
            return False
        waiting.cancelled = True
        return True

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def futures(self) -> list[Future]:
        return [w.ready for w in self._waiting.values()]

    def finished(self, prepared: Callable[[Pending, Any], Pending]) -> list[tuple[Pending, BaseException | None, bool]]:
        """``(submit, error, cancelled)`` for every submit whose future is done, in submission
        order: ``prepared(submit, result)``, or the original submit when the future raised
        ``error``; and whether a cancel came meanwhile."""
        done = []
        for rid, waiting in list(self._waiting.items()):
            if not waiting.ready.done():
                continue
            del self._waiting[rid]
            error = waiting.ready.exception()
            submit = waiting.submit if error is not None else prepared(waiting.submit, waiting.ready.result())
            done.append((submit, error, waiting.cancelled))
        return done

    def drop(self) -> None:
        """Cancel every future still queued (a job under way is abandoned)."""
        for waiting in self._waiting.values():
            waiting.ready.cancel()


def wait_any(futures: Iterable[Future], timeout: float) -> bool:
    """Block up to ``timeout`` for one of ``futures`` to finish; whether one has."""
    done, _ = wait(list(futures), timeout, FIRST_COMPLETED)
    return bool(done)

