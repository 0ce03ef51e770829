"""The front: the worker's supervisor and the table of requests in flight behind one object that
the RPC handlers (gRPC, HTTP) call (asyncio, torch-free).

``supervisor`` (a ``WorkerSupervisor``) runs the worker process; ``requests`` (a
``RequestsInFlight``) holds the requests, whose logs the streaming calls follow
(``streams.Subscription``). Every batch of the worker carries the page pool's numbers after its
step, so ``stats`` is current without asking the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from qil_worker.engine.spec import Prompt, RequestSpec  # torch-free
from qil_worker.errors import CapacityError, InvalidRequestError
from qil_worker.request_limits import MAX_REQUEST_ID_LENGTH
from qil_worker.task import refusal as task_refusal
from qil_worker.service.front import limits
from qil_worker.service import protocol as P
from qil_worker.service.front.calls_in_flight import CallsInFlight
from qil_worker.service.errors import (
    ServiceError,
    already_exists,
    classify_engine_error,
    from_worker_rejection,
    invalid,
    resource_exhausted,
    unavailable,
)
from qil_worker.service.front.request_log import FrontRequest, Retention, assistant_split
from qil_worker.service.front.outsized_submit import PromptSize
from qil_worker.service.front.requests_in_flight import RequestsInFlight
from qil_worker.service.front.supervisor import RestartPolicy, WorkerSupervisor
from qil_worker.service.front.worker_process import WorkerState
from qil_worker.freed_memory import OUTSIZED_CHARS, map_large_blocks, release_outsized
from qil_worker.text.prompt import ROLES, PromptRoom, PromptTooLong, prompt_chars, tokenize_refusal
from qil_worker.text.tokenizer import min_tokens

# When to release after an outsized request: its message outlives ``submit`` until the RPC
# handler ends, and gRPC's server loop keeps the last call's state (for a refused call, with the
# exception whose traceback holds the request) until the next call arrives: again later for that.
RELEASE_AFTER_S = (0.2, 2.0, 10.0)


def release_outsized_later() -> None:
    """After an outsized request (``freed_memory.OUTSIZED_CHARS``), once its call is over."""
    loop = asyncio.get_running_loop()
    for delay in RELEASE_AFTER_S:
        loop.call_later(delay, release_outsized)


@contextlib.contextmanager
def _released_when_outsized(spec: RequestSpec) -> Iterator[None]:
    """Around a submit of ``spec``: after an outsized text or messages prompt, drop it from the
    spec (a refusal's traceback keeps the frames, and gRPC keeps the last call's) and give the
    freed memory back once the call is over (``release_outsized_later``)."""
    prompt = spec.prompt
    outsized = prompt_chars(prompt.text, prompt.messages) >= OUTSIZED_CHARS
    try:
        yield
    finally:
        if outsized:
            prompt.forget_text()
            release_outsized_later()


log = logging.getLogger("qil.front")

WORKER_DIED = "worker process died"


@dataclass
class FrontConfig:
    """The front's own settings, and what its worker is started with (``worker``)."""

    worker: P.WorkerConfig = field(default_factory=P.WorkerConfig)
    max_queued: int = 1024
    max_restarts: int = 5
    restart_backoff_s: float = 0.5
    stable_after_s: float = 30.0
    start_timeout_s: float = 900.0
    retain_finished: int = limits.RETAIN_FINISHED
    retain_seconds: float = limits.RETAIN_SECONDS
    retain_tokens: int = limits.RETAIN_TOKENS
    # A streaming call (Generate, StreamEvents) whose reader leaves more than this many produced
    # tokens unwritten is ended with RESOURCE_EXHAUSTED and its requests are cancelled.
    max_stream_backlog: int = limits.MAX_STREAM_BACKLOG


def _min_prompt_tokens(prompt: Prompt, max_token_bytes: int, normal_form: str | None) -> int:
    """``text.tokenizer.min_tokens`` of a text or chat prompt (0 for malformed messages: the
    worker names the message at fault first)."""
    text, messages = prompt.text, prompt.messages
    if messages and any(m.get("role") not in ROLES for m in messages):
        return 0
    texts = [text] if isinstance(text, str) else [m["content"] for m in messages or ()]
    return min_tokens(texts, max_token_bytes, normal_form)


class Front:
    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self.requests = RequestsInFlight(
            Retention(config.retain_finished, config.retain_tokens, config.retain_seconds),
            on_finished=self._report_finished,
        )
        self.supervisor = WorkerSupervisor(
            config.worker,
            RestartPolicy(config.max_restarts, config.restart_backoff_s, config.stable_after_s,
                          config.start_timeout_s),
            events=self,
        )
        self.stats: P.PoolStats = P.EMPTY_STATS  # of the worker's latest batch
        self._calls = CallsInFlight()  # Tokenize / Detokenize waiting for the worker
        self.num_requests_total = 0
        self.on_state_change: Callable[[WorkerState], Any] | None = None
        self.metrics: Any = None  # a metrics.Metrics when --metrics-port is given

    # ---------------------------------------------------------------- the worker

    @property
    def info(self) -> P.WorkerInfo | None:
        """What the latest ready worker told (None until one was)."""
        return self.supervisor.info

    @property
    def state(self) -> WorkerState:
        return self.supervisor.state

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    @property
    def worker_pid(self) -> int:
        return self.supervisor.pid

    @property
    def draining(self) -> bool:
        """Shutting down: no new requests; the worker will not be restarted."""
        return self.supervisor.draining

    @property
    def num_unfinished(self) -> int:
        return self.requests.num_unfinished

    @property
    def max_unfinished(self) -> int:
        return self.config.worker.engine.max_active + self.config.max_queued

    async def start(self) -> None:
        """Start the first worker and wait until it is loaded and warm (or raise WorkerFailed)."""
        map_large_blocks()  # a received prompt of megabytes is unmapped when freed
        await self.supervisor.start()

    # supervisor.WorkerEvents
    def worker_ready(self, info: P.WorkerInfo) -> None:
        self.stats = info.stats
        if self.metrics is not None:
            self.metrics.on_worker(info)

    def worker_batch(self, batch: P.StepBatch) -> None:
        self.requests.apply(batch)
        self.stats = batch.stats
        if self.metrics is not None:
            self.metrics.on_step(batch.timing)
            self.metrics.on_stats(self.stats, self.num_unfinished)

    def worker_answer(self, answer: P.Tokenized | P.Detokenized) -> None:
        self._calls.answer(answer)

    def worker_lost(self, pid: int) -> None:
        log.error("worker process (pid %d) died; failing %d request(s)", pid, self.num_unfinished)
        self.requests.lose_all(WORKER_DIED)
        self._calls.fail_all(unavailable(WORKER_DIED))
        self.stats = self.stats.all_free()
        if self.metrics is not None:
            self.metrics.on_stats(self.stats, self.num_unfinished)

    def worker_state(self, state: WorkerState) -> None:
        if self.on_state_change is not None:
            self.on_state_change(state)

    def worker_restarting(self) -> None:
        if self.metrics is not None:
            self.metrics.on_restart()

    # ---------------------------------------------------------------- finished requests

    def _report_finished(self, req: FrontRequest) -> None:
        """One INFO line per finished request, and its metrics."""
        final = req.final
        assert final is not None
        reason = final.reason.label
        n_out = len(req.tokens)
        fields: dict[str, Any] = {
            "reason": reason, "prompt_tokens": req.prompt_len, "output_tokens": n_out,
        }
        timing = ""
        metrics = final.metrics
        if metrics is not None:
            for name, value in (("queue_s", metrics.queue_time_s), ("ttft_s", metrics.ttft_s),
                                ("mean_itl_s", metrics.mean_itl_s), ("max_itl_s", metrics.max_itl_s),
                                ("e2e_s", metrics.e2e_s)):
                fields[name] = None if value is None else round(value, 6)
            fields["preemptions"] = metrics.num_preemptions
            fields["cached_tokens"] = final.num_cached_tokens
            timing = " ttft=%s itl=%s e2e=%s" % tuple(
                "-" if fields[k] is None else f"{fields[k] * 1000:.1f}ms"
                for k in ("ttft_s", "mean_itl_s", "e2e_s")
            )
        error = final.error
        if error:
            fields["error"] = error
        log.info(
            "finished: reason=%s tokens_in=%d tokens_out=%d%s%s", reason, req.prompt_len, n_out,
            timing, f" error={error!r}" if error else "",
            extra={"request_id": req.rid, "fields": fields},
        )
        if self.metrics is not None:
            try:
                self.metrics.on_finished(reason, req.prompt_len, n_out, metrics)
            except Exception:  # noqa: BLE001 - metrics never break serving
                log.exception("metrics update failed")

    # ---------------------------------------------------------------- operations for handlers

    def check_accepting(self) -> None:
        if self.draining:
            raise unavailable("server is shutting down")
        if self.state != WorkerState.READY:
            raise unavailable(f"worker is {self.state.name.lower()}")

    def find(self, rid: str) -> FrontRequest | None:
        """A live or retained request, for a subscriber."""
        return self.requests.find(rid)

    def _refuse_too_many_ids(self, num_ids: int, max_new_tokens: int) -> None:
        """Refuse, as the engine would, more token ids than the model has positions for:
        millions of ids cost the worker seconds to receive."""
        max_positions = self.info.max_position_embeddings if self.info is not None else 0
        if max_positions and num_ids + max_new_tokens > max_positions:
            too_long = CapacityError.positions(num_ids, max_new_tokens, max_positions)
            raise from_worker_rejection(*classify_engine_error(too_long))

    def _refuse_text_too_long(
        self, bound_of: Callable[[int, str | None], int], max_new_tokens: int, prompt_field: str
    ) -> None:
        """Refuse, as the worker would, a text or chat prompt whose size alone shows that it
        cannot fit (``bound_of(max_token_bytes, normal_form)``, a bound on its tokens): a
        prompt of megabytes is not shipped to the worker (nor pickled) only to be refused there."""
        info = self.info
        room = PromptRoom(info.max_position_embeddings, info.stats.pages_total, info.page_size)
        limit = room.max_prompt(max_new_tokens)
        if limit is None or not info.max_token_bytes:
            return
        bound = bound_of(info.max_token_bytes, info.normal_form)
        if bound > limit:  # (raised from a frame that does not hold the text)
            too_long = room.refusal(PromptTooLong(bound, exact=False), max_new_tokens, prompt_field)
            raise from_worker_rejection(*classify_engine_error(too_long))

    def refuse_unfit(self, request_id: str, max_new_tokens: int, prompt: PromptSize) -> None:
        """For a request known, before its prompt is decoded, by its prompt's size
        (``outsized_submit``): raise what ``submit`` would raise for it before reaching the
        worker when that size alone refuses it; return when it does not (the caller then
        parses the request whole and submits it)."""
        self._admit(request_id)
        if prompt.given == ["token_ids"]:
            self._refuse_too_many_ids(prompt.num_token_ids, max_new_tokens)
        elif self.info is not None:
            self._refuse_text_too_long(prompt.min_tokens, max_new_tokens, prompt.given[0])

    def _refuse_off_task(self, spec: RequestSpec) -> None:
        """Refuse a request this server's task does not serve (``qil_worker.task``)."""
        info = self.info
        if info is None:
            return
        kind = "generate" if spec.pooling is None else spec.pooling.kind
        why = task_refusal(info.task, kind, info.task_explicit)
        if why is not None:
            raise from_worker_rejection(*classify_engine_error(InvalidRequestError("task", why)))

    async def submit(self, request_id: str, spec: RequestSpec) -> FrontRequest:
        """Queue a request in the worker; returns once the engine accepted it.

        ``spec`` is valid in itself (it was checked when made, before anything was built from
        it); ``request_id`` is the caller's (empty: the front names it). After an outsized text
        prompt the process gives its freed memory back, once the call that carried it is over
        (``freed_memory``).
        """
        with _released_when_outsized(spec):
            self._refuse_off_task(spec)
            rid = self._admit(request_id)
            prompt, max_new_tokens = spec.prompt, spec.max_new_tokens
            if prompt.token_ids is not None:
                self._refuse_too_many_ids(len(prompt.token_ids), max_new_tokens)
            elif self.info is not None:
                self._refuse_text_too_long(
                    lambda max_token_bytes, normal_form: _min_prompt_tokens(prompt, max_token_bytes, normal_form),
                    max_new_tokens, prompt.field,
                )
            req, acked = self.requests.add(rid, len(prompt.token_ids or ()), spec.sampling.n)
            req.assistant = assistant_split(spec)
            self.supervisor.send(P.Submit(spec.with_id(rid)))
            try:
                ack = await acked
            except asyncio.CancelledError:
                self.supervisor.send(P.Cancel(rid))  # the caller is gone; the request must not run on
                raise
            except ServiceError:
                self.requests.withdraw(req)
                raise
            if ack.rejection is not None:  # the table has forgotten the request
                r = ack.rejection
                raise from_worker_rejection(r.kind, r.field, r.message)
            self.num_requests_total += 1
            log.debug(
                "submitted: tokens_in=%d max_new_tokens=%d", ack.num_prompt_tokens, max_new_tokens,
                extra={"request_id": rid},
            )
            return req

    def _admit(self, request_id: str) -> str:
        """The checks of a submit that come before its prompt's; → the request's id."""
        if len(request_id) > MAX_REQUEST_ID_LENGTH:
            raise invalid("request_id", f"at most {MAX_REQUEST_ID_LENGTH} characters, got {len(request_id)}")
        if not request_id.isprintable():  # ids go into log lines: no line breaks or controls
            raise invalid("request_id", f"printable characters only, got {request_id!r}")
        self.check_accepting()
        rid = request_id or uuid.uuid4().hex
        if self.requests.live(rid) is not None:
            raise already_exists(rid)
        if self.num_unfinished >= self.max_unfinished:
            raise resource_exhausted(
                f"{self.num_unfinished} unfinished requests; the server admits {self.max_unfinished}"
            )
        return rid

    def cancel_nowait(self, rid: str) -> bool:
        if self.requests.live(rid) is None:
            return False
        self.supervisor.send(P.Cancel(rid))
        return True

    async def cancel(self, request_ids: Iterable[str], timeout: float = 5.0) -> list[tuple[str, bool]]:
        """Cancel requests and wait until they are over (their pages are then free).

        Per id: True when the request was still active and ended cancelled. An id given twice
        counts once.
        """
        ids = list(request_ids)
        sent: dict[str, FrontRequest] = {}
        for rid in ids:
            req = self.requests.live(rid)
            if rid not in sent and req is not None and self.cancel_nowait(rid):
                sent[rid] = req
        if sent:
            await self.requests.wait_ended(sent.values(), timeout)
        result = []
        for rid in ids:
            req = sent.get(rid)  # (an id given twice gets the same answer twice)
            active = req is not None and (
                req.final is None or req.final.reason is P.FinishReason.CANCELLED or req.lost
            )
            result.append((rid, active))
        return result

    @property
    def num_pending_calls(self) -> int:
        """Tokenize / Detokenize calls waiting for the worker's answer."""
        return len(self._calls)

    async def tokenize(
        self, text: str | None, messages: list[dict[str, str]] | None, enable_thinking: bool | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The ids of a prompt as a submit of it would get them (both None: no tokens); a prompt
        of more tokens than the model has positions is refused, as a submit of it would be, and
        from its size alone where that shows it (a text of megabytes is not shipped to the
        worker only to be refused there)."""
        try:
            max_tokens = self._tokenize_limit(text, messages)
            answer = await self._tokenizer_call(
                lambda call_id: P.Tokenize(call_id, text, messages, enable_thinking, max_tokens, tools)
            )
        finally:
            if prompt_chars(text, messages) >= OUTSIZED_CHARS:
                release_outsized_later()
        return answer.token_ids

    def _tokenize_limit(self, text: str | None, messages: list[dict[str, str]] | None) -> int | None:
        """The most tokens a Tokenize may give (None: unknown yet); raises when the prompt's size
        alone exceeds it."""
        info = self.info
        if info is None or not info.max_position_embeddings:
            return None
        limit = info.max_position_embeddings
        if info.max_token_bytes and (text is not None or messages is not None):
            prompt = Prompt(text=text, messages=messages)
            bound = _min_prompt_tokens(prompt, info.max_token_bytes, info.normal_form)
            if bound > limit:
                raise invalid(prompt.field, tokenize_refusal(bound, limit, exact=False))
        return limit

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        try:
            answer = await self._tokenizer_call(
                lambda call_id: P.Detokenize(call_id, token_ids, skip_special_tokens)
            )
        finally:
            if len(token_ids) >= OUTSIZED_CHARS:
                release_outsized_later()
        return answer.text

    async def _tokenizer_call(self, make: Callable[[int], P.Tokenize | P.Detokenize]) -> Any:
        """Send a call to the worker and wait for its answer; ServiceError for a refusal
        (or UNAVAILABLE: the worker died). A caller that stops waiting leaves no entry."""
        self.check_accepting()
        call_id, answered = self._calls.open()
        try:
            self.supervisor.send(make(call_id))
            answer = await answered
        finally:
            self._calls.close(call_id)
        if answer.rejection is not None:
            r = answer.rejection
            raise from_worker_rejection(r.kind, r.field, r.message)
        return answer

    # ---------------------------------------------------------------- shutdown

    async def drain(self, grace_s: float) -> int:
        """Stop accepting, let running requests finish for ``grace_s``, then cancel the rest."""
        self.supervisor.begin_drain()
        if self.num_unfinished:
            log.info("draining %d request(s) for up to %.1fs", self.num_unfinished, grace_s)
            await self.requests.wait_idle(grace_s)
        left = self.requests.unfinished_ids()
        if left:
            log.info("cancelling %d request(s) after the grace period", len(left))
            await self.cancel(left, timeout=3.0)
        return len(left)

    async def stop_worker(self, timeout: float = 10.0) -> None:
        await self.supervisor.stop(timeout)
