"""The worker process as the front sees it: one spawned process, its pipe and two threads.

The threads keep the event loop free of pipe I/O: the writer drains an outbox (a full pipe while
the worker is busy in a long step blocks only it), the reader hands each message, and ``None``
when the pipe ends, to a callback that the front makes thread-safe.
"""

from __future__ import annotations

import atexit
import enum
import logging
import multiprocessing
import queue
import threading
import time
import weakref
from typing import Any, Callable

from qil_worker.service import protocol as P
from qil_worker.service.protocol import WorkerConfig

log = logging.getLogger("qil.front")

# Workers not yet reaped. The worker ignores SIGTERM (the front owns shutdown), so an interpreter
# that exits without stopping its server (an embedding that never called stop(), an exception in
# the front) would wait forever in multiprocessing's exit-time join: kill them first.
_live: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()
_exit_hook_installed = False


def _kill_live_workers() -> None:
    for worker in list(_live):
        worker.kill()


class WorkerState(enum.IntEnum):  # numbers of qil.v1.WorkerState
    STARTING = 1
    READY = 2
    RESTARTING = 3
    FAILED = 4
    STOPPING = 5


class WorkerFailed(Exception):
    """The worker could not start (bad model directory, ...) or died while starting."""


class WorkerProcess:
    """A running worker process; ``gen`` tells its messages from an earlier worker's."""

    def __init__(self, gen: int, proc: Any, conn: Any) -> None:
        self.gen = gen
        self.proc = proc
        self.pid: int = proc.pid
        self.conn = conn
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ready_at: float | None = None  # monotonic time it reported ready (None: never)
        self._reap_lock = threading.Lock()  # a restart and a shutdown may both reap it
        self._reaped = False
        self._exitcode: int | None = None

    @classmethod
    def spawn(
        cls, gen: int, worker_config: WorkerConfig, deliver: Callable[[int, Any], None]
    ) -> "WorkerProcess":
        """Start ``worker_main(worker_config)`` in a fresh interpreter and the pipe threads;
        ``deliver(gen, message)`` is called from the reader thread."""
        from qil_worker.service.worker.loop import worker_main  # torch-free at import time

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=worker_main, args=(child, worker_config), name="qil-worker", daemon=True)
        proc.start()
        child.close()  # the front keeps only its end: EOF on it means the worker is gone
        worker = cls(gen, proc, parent)
        global _exit_hook_installed
        if not _exit_hook_installed:  # after multiprocessing's own hook, so it runs before it
            atexit.register(_kill_live_workers)
            _exit_hook_installed = True
        _live.add(worker)
        threading.Thread(target=worker._write, name="qil-worker-writer", daemon=True).start()
        threading.Thread(
            target=worker._read, args=(deliver,), name="qil-worker-reader", daemon=True
        ).start()
        return worker

    def mark_ready(self) -> None:
        self.ready_at = time.monotonic()

    def stable_for(self, seconds: float) -> bool:
        """Whether it was ready at least ``seconds`` before now (a crash after a long good run
        is not part of a crash loop)."""
        return self.ready_at is not None and time.monotonic() - self.ready_at >= seconds

    def send(self, msg: P.ToWorker) -> None:
        self.outbox.put(msg)

    def close_outbox(self) -> None:
        """Ends the writer thread once what is queued has been written."""
        self.outbox.put(None)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except (OSError, ValueError):  # gone already, or reaped
            pass

    def stop(self, timeout: float) -> int | None:
        """Blocking (run it in an executor): ask the worker to stop, then ``reap`` it."""
        self.send(P.Stop())
        return self.reap(timeout)

    def reap(self, timeout: float) -> int | None:
        """Blocking (run it in an executor): wait up to ``timeout`` seconds for the process to
        end, kill it if it has not, and release its pipe, writer thread and process handle.
        Returns the exit code."""
        with self._reap_lock:
            if self._reaped:
                return self._exitcode
            self.close_outbox()
            self.proc.join(timeout)
            if self.proc.is_alive():
                log.warning("worker (pid %d) did not exit; killing it", self.pid)
                self.proc.kill()
                self.proc.join(5.0)
            self._exitcode = self.proc.exitcode
            try:
                self.conn.close()
            except OSError:
                pass
            if self._exitcode is not None:
                self.proc.close()
                self._reaped = True
                _live.discard(self)
            return self._exitcode

    def _write(self) -> None:
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return

    def _read(self, deliver: Callable[[int, Any], None]) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError, ValueError):
                deliver(self.gen, None)
                return
            except Exception:  # noqa: BLE001 - a message we cannot unpickle: treat as dead
                log.exception("bad message from worker")
                deliver(self.gen, None)
                return
            deliver(self.gen, msg)
