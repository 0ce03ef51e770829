"""Supervision of the worker process: spawn it, wait until it is ready, restart it with bounded
backoff when it dies, and stop it. What the worker says goes to the front's ``WorkerEvents``.

A worker is identified by its generation (``WorkerProcess.gen``): messages of an earlier worker,
still queued on the event loop when a new one runs, are dropped.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from qil_worker.service import protocol as P
from qil_worker.service.protocol import WorkerConfig
from qil_worker.service.front.worker_process import WorkerFailed, WorkerProcess, WorkerState

log = logging.getLogger("qil.front")

MAX_RESTART_DELAY_S = 30.0


class WorkerEvents(Protocol):
    """What the supervisor tells its owner (all called on the event loop)."""

    def worker_ready(self, info: P.WorkerInfo) -> None: ...

    def worker_batch(self, batch: P.StepBatch) -> None: ...

    def worker_answer(self, answer: P.Tokenized | P.Detokenized) -> None:
        """The answer to a tokenizer call."""

    def worker_lost(self, pid: int) -> None:
        """A ready worker died (not while stopping): its requests are gone with it."""

    def worker_state(self, state: WorkerState) -> None: ...

    def worker_restarting(self) -> None:
        """A new worker is being started after a death."""


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int  # deaths in a row after which the worker stays FAILED
    backoff_s: float  # the delay before the first restart, doubled for each further one
    stable_after_s: float  # a worker that ran this long before dying resets the count
    start_timeout_s: float  # how long a worker may take to load and warm up


class WorkerSupervisor:
    def __init__(self, worker_config: WorkerConfig, policy: RestartPolicy, events: WorkerEvents) -> None:
        self._worker_config = worker_config
        self._policy = policy
        self._events = events
        self.state = WorkerState.STARTING
        self.restarts = 0
        self.info: P.WorkerInfo | None = None  # the latest ready worker's
        self._failures = 0  # worker deaths in a row (reset by a worker that ran stable_after_s)
        self._gen = 0
        self._worker: WorkerProcess | None = None
        self._ready: asyncio.Future | None = None
        self._draining = False
        self._stopping = False
        self._restart_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def pid(self) -> int:
        return self._worker.pid if self._worker is not None else 0

    @property
    def draining(self) -> bool:
        """Shutting down: the worker will not be restarted."""
        return self._draining

    def begin_drain(self) -> None:
        self._draining = True

    def send(self, msg: P.ToWorker) -> None:
        if self._worker is not None:
            self._worker.send(msg)

    def _set_state(self, state: WorkerState) -> None:
        if state != self.state:
            self.state = state
            self._events.worker_state(state)

    async def start(self) -> None:
        """Start the first worker and wait until it is loaded and warm (or raise WorkerFailed)."""
        self._loop = asyncio.get_running_loop()
        await self._spawn()

    async def _spawn(self) -> None:
        loop = self._loop
        assert loop is not None
        self._gen += 1

        def deliver(gen: int, msg: P.FromWorker | None) -> None:  # on the pipe's reader thread
            try:
                loop.call_soon_threadsafe(self._on_message, gen, msg)
            except RuntimeError:  # loop closed
                pass

        self._ready = loop.create_future()
        worker = WorkerProcess.spawn(self._gen, self._worker_config, deliver)
        self._worker = worker
        log.info("worker %d started (pid %d)", worker.gen, worker.pid)
        try:
            try:
                info = await asyncio.wait_for(asyncio.shield(self._ready), self._policy.start_timeout_s)
            except asyncio.TimeoutError:
                raise WorkerFailed("worker did not become ready in time") from None
        except BaseException as exc:
            # A failed start is over here: its late EOF must not count as another death (nor
            # start another restart loop), and its pipe, thread and process are released now.
            self._worker = None
            if isinstance(exc, asyncio.CancelledError):  # the server stops while the model loads
                self._stopping = True  # nothing to drain, no restart
                self._ready.cancel()  # nobody awaits it any more (else its error goes unread)
            worker.kill()
            loop.run_in_executor(None, worker.reap, 5.0)
            raise
        worker.mark_ready()
        self.info = info
        self._events.worker_ready(info)
        self._set_state(WorkerState.READY)
        log.info(
            "worker ready (pid %d): model %s%s, dtype %s, device %s; %s; memory: %s; tokenizer: %s; "
            "prefix cache: %s",
            worker.pid, info.name, " [DEMO: random weights]" if info.demo else "", info.dtype,
            info.device, info.kv_pool, info.memory, info.tokenizer or "none (token ids only)",
            "on" if info.prefix_cache else "off",
        )

    def _on_message(self, gen: int, msg: P.FromWorker | None) -> None:
        worker = self._worker
        if worker is None or gen != worker.gen:
            return  # a message from a previous worker
        if isinstance(msg, P.StepBatch):
            self._events.worker_batch(msg)
        elif isinstance(msg, P.TOKENIZER_ANSWERS):
            self._events.worker_answer(msg)
        elif msg is None:
            self._on_worker_gone(worker)
        elif isinstance(msg, P.Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg.info)
        elif isinstance(msg, P.Fatal):
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(WorkerFailed(msg.message))

    def _on_worker_gone(self, worker: WorkerProcess) -> None:
        worker.close_outbox()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(WorkerFailed("worker process exited while starting"))
            return
        if self._stopping:
            return
        # State first (health NOT_SERVING), then the in-flight calls end with UNAVAILABLE.
        self._set_state(WorkerState.STOPPING if self._draining else WorkerState.RESTARTING)
        self._events.worker_lost(worker.pid)
        if self._draining:
            return
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.ensure_future(self._restart(worker))

    async def _restart(self, dead: WorkerProcess) -> None:
        loop = asyncio.get_running_loop()
        exitcode = await loop.run_in_executor(None, dead.reap, 5.0)
        log.warning("worker exit code: %s", exitcode)
        policy = self._policy
        if dead.stable_for(policy.stable_after_s):
            self._failures = 0
        while not self._draining:
            self._failures += 1
            if self._failures > policy.max_restarts:
                log.error("worker died %d times in a row; giving up", self._failures)
                self._set_state(WorkerState.FAILED)
                return
            delay = min(policy.backoff_s * 2 ** (self._failures - 1), MAX_RESTART_DELAY_S)
            log.warning("restarting worker in %.1fs (attempt %d)", delay, self._failures)
            await asyncio.sleep(delay)
            if self._draining:
                return
            try:
                self.restarts += 1
                self._events.worker_restarting()
                await self._spawn()
                return
            except WorkerFailed as exc:
                log.error("worker restart failed: %s", exc)
                self._set_state(WorkerState.RESTARTING)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker (``Stop``, then a kill if it does not exit within ``timeout``)."""
        self._stopping = True
        self._set_state(WorkerState.STOPPING)
        if self._restart_task is not None:
            self._restart_task.cancel()
        if self._worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._worker.stop, timeout)
