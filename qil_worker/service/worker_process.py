"""The worker process as the front sees it: one spawned process, its pipe and two threads.

The threads keep the event loop free of pipe I/O: the writer drains an outbox (a full pipe while
the worker is busy in a long step blocks only it), the reader hands each message, and ``None``
when the pipe ends, to a callback that the front makes thread-safe.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing
import queue
import threading
from typing import Any, Callable

from qil_worker.service import protocol as P

log = logging.getLogger("qil.front")


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
        self.conn = conn
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.info: dict[str, Any] | None = None

    @classmethod
    def spawn(
        cls, gen: int, worker_config: dict[str, Any], deliver: Callable[[int, Any], None]
    ) -> "WorkerProcess":
        """Start ``worker_main(worker_config)`` in a fresh interpreter and the pipe threads;
        ``deliver(gen, message)`` is called from the reader thread."""
        from qil_worker.service.worker import worker_main  # torch-free at import time

        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=worker_main, args=(child, worker_config), name="qil-worker", daemon=True)
        proc.start()
        child.close()  # the front keeps only its end: EOF on it means the worker is gone
        worker = cls(gen, proc, parent)
        threading.Thread(target=worker._write, name="qil-worker-writer", daemon=True).start()
        threading.Thread(
            target=worker._read, args=(deliver,), name="qil-worker-reader", daemon=True
        ).start()
        return worker

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: tuple) -> None:
        self.outbox.put(msg)

    def close_outbox(self) -> None:
        """Ends the writer thread once what is queued has been written."""
        self.outbox.put(None)

    def wait_exit(self, timeout: float) -> int | None:
        """Blocking: the exit code once the process has ended within ``timeout`` (else None)."""
        self.proc.join(timeout)
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def stop(self, timeout: float) -> None:
        """Blocking (run it in an executor): ask the worker to stop, wait ``timeout`` seconds,
        then kill it."""
        self.send((P.STOP,))
        self.close_outbox()
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.warning("worker did not stop; killing it")
            self.proc.kill()
            self.proc.join(5.0)
        try:
            self.conn.close()
        except OSError:
            pass

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
