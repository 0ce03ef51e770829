"""The in-process engine: submit requests, step the batched forward, read events and results."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from qil_worker.attention.backend import AttentionBackend
from qil_worker.engine import samples
from qil_worker.engine import prompt_logprobs
from qil_worker.engine.config import EngineConfig
from qil_worker.engine.in_flight import InFlightStep, stays_in_flight
from qil_worker.engine.runner.model_runner import ModelRunner
from qil_worker.engine.runner.pooling import PooledAnswers
from qil_worker.engine.outputs import Event, FinishReason, RequestMetrics, Result
from qil_worker.engine.request import Request, members, unforked
from qil_worker.engine.sampling_params import SamplingParams
from qil_worker.engine.scheduler import ScheduledChunk, Scheduler
from qil_worker.engine.spec import DEFAULT_MAX_NEW_TOKENS, Pooling, RequestSpec
from qil_worker.engine.validation import validate_submit
from qil_worker.kv import PagePool, PageTable, PrefixCache, page_hashes
from qil_worker.errors import (
    DeviceFailedError,
    DuplicateRequestError,
    FeatureUnavailableError,
    InvalidRequestError,
    TokenizerUnavailableError,
    UnknownRequestError,
)
from qil_worker.model import Qwen3
from qil_worker.parallel.state import RankFailedError
from qil_worker.structured.matcher import CompiledConstraint
from qil_worker.structured.spec import ConstraintSpec
from qil_worker.text.output import TextOutput
from qil_worker.text.prompt import encode_prompt
from qil_worker.text.rerank_prompt import answer_token_ids

if TYPE_CHECKING:
    from qil_worker.structured.compiler import GrammarCompiler

log = logging.getLogger(__name__)



# CUDA's sticky errors, as its runtime words them: after one of these every later call on the
# device fails too. Others (out of memory, a cuBLAS allocation failure) pass with the step.
STICKY_CUDA_ERRORS = (
    "illegal memory access", "device-side assert", "unspecified launch failure",
    "misaligned address", "illegal instruction", "hardware stack error", "invalid program counter",
    "launch timed out", "uncorrectable ECC error", "uncorrectable NVLink error",
)


def device_unusable(exc: BaseException) -> bool:
    """Whether a failed step left the device unusable (torch raises ``AcceleratorError``, older
    versions a RuntimeError, with CUDA's message), or the tensor-parallel group it runs on."""
    if isinstance(exc, RankFailedError):
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError) or not isinstance(exc, RuntimeError):
        return False
    message = str(exc)
    return "CUDA error" in message and any(cause in message for cause in STICKY_CUDA_ERRORS)


@dataclass(frozen=True)
class EngineStats:
    num_pages_total: int
    num_pages_used: int
    num_pages_free: int
    page_size: int
    token_budget: int
    prefill_chunk: int
    max_active: int
    num_running: int
    num_waiting: int
    num_pages_cached: int = 0  # idle pages kept for their prefix (counted as free)
    prefix_cache_hit_rate: float = 0.0  # cached / all prompt tokens, each request's first admission
    schedule_policy: str = "fcfs"  # admission order of waiting requests


class Engine:
    """Continuous batching over a paged KV cache: each ``step()`` is one model forward.

    Not thread-safe: one owner calls ``submit``/``cancel``/``step`` (the worker process loop);
    only ``grammars`` and ``compile_constraint`` may be used from other threads meanwhile.

    A request's final event carries its ``Result``, and the engine forgets finished requests by
    itself: ``result()`` knows the ``retained_results`` most recent ones (0: none, as a server
    that reads the results from the events wants), and ``release()`` forgets one at once.
    """

    def __init__(
        self,
        model: Qwen3,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        attention: str | AttentionBackend | None = None,
        **options: Any,
    ) -> None:
        """``config``: how the engine runs (``EngineConfig``), or its fields as keywords
        (``num_pages=512, page_size=16, token_budget=512, prefill_chunk=512, max_active=64``,
        ``prefix_cache``, ``schedule_policy``, ``cuda_graphs``, ``step_graphs``, ``overlap``,
        ``debug``, ``retained_results``, ``compile_decode``). ``attention``: a backend's name (``EngineConfig.attention``)
        or a backend object (``attention.backend``). ``tokenizer``: optional; text prompts, text
        deltas and stop strings need it. With ``overlap`` the tokens and events are the same as
        without; a step's events come with the next ``step()``."""
        backend = attention if isinstance(attention, AttentionBackend) else None
        if isinstance(attention, str):
            options["attention"] = attention
        elif backend is not None:
            options["attention"] = "auto"  # (the object given is used instead)
        if config is None:
            config = EngineConfig(**options)
        elif options:
            raise TypeError("give an EngineConfig or its fields, not both")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer  # optional: text prompts, text deltas, stop strings
        self.page_size = config.page_size
        self.runner = ModelRunner(model, config, backend)
        self.attention_backend = self.runner.attention.name  # as GetInfo reports it
        self.pool = PagePool(config.num_pages, on_reuse=self.runner.kv.forget_pages)
        self.prefix_cache = PrefixCache(self.pool, config.page_size) if config.prefix_cache else None
        self.scheduler = Scheduler(
            self.pool, config.token_budget, config.prefill_chunk, config.max_active,
            prefix_cache=self.prefix_cache, policy=config.schedule_policy,
        )
        self._eos_ids = frozenset(model.config.eos_token_ids)
        # requests whose final event is not handed out yet (active ones, cancels in ``_pending``)
        self._requests: dict[str, Request] = {}
        self._pending: list[Event] = []  # final events of cancels, emitted by the next step
        self._retained_results = config.retained_results
        # per request, the result of each sample (one unless it asked for n > 1)
        self._results: collections.OrderedDict[str, list[Result]] = collections.OrderedDict()
        self._ids = itertools.count()
        self._closed = False
        # Why the device can no longer be used (``device_unusable``); the engine then refuses work.
        self.device_failure: str | None = None
        self.overlap = model.device.type == "cuda" if config.overlap is None else bool(config.overlap)
        self._in_flight: InFlightStep | None = None  # launched, not read yet (``overlap``)
        self.overlapped_steps = 0  # steps launched before the previous step was read
        self._grammars: GrammarCompiler | None = None  # built on first use (structured output)
        self._grammars_lock = threading.Lock()

    # -- requests in -------------------------------------------------------------------------

    def submit(
        self,
        token_ids: RequestSpec | Sequence[int] | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        stop_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        sampling: SamplingParams | None = None,
        *,
        constraint: CompiledConstraint | None = None,
        **options: Any,
    ) -> str:
        """Queue a request and return its id; invalid or impossible requests raise at once.

        The request is a ``RequestSpec`` (``qil_worker.engine.spec``: what the service sends), or
        its keyword form (``RequestSpec.of``): the prompt is ``token_ids``, or ``text`` / chat
        ``messages`` (with ``enable_thinking``) when the engine has a tokenizer. Sampling is given
        as ``sampling=SamplingParams(...)`` or as its fields, e.g. ``temperature=0.7, top_p=0.9,
        seed=1``; the default is greedy. With a tokenizer, events carry text deltas and
        ``stop_strings`` end the request when the text contains one (``include_stop_string``,
        ``skip_special_tokens``).

        Structured output (needs the tokenizer and the ``structured`` extra): at most one of
        ``json_schema`` (a JSON Schema, str or dict), ``json_object=True`` (any JSON object),
        ``regex``, ``grammar`` (llguidance's Lark dialect) or ``choice`` (a list of strings:
        the output is exactly one) is compiled here (cached), or ``constraint`` is one already
        compiled by ``compile_constraint``. The output then matches it; the request ends with
        STOP as soon as the structure is complete (``stop_reason`` None unless an EOS or stop id
        ended it), and a request cut by ``max_new_tokens`` or a stop string holds a prefix.

        ``n`` (a sampling field): that many samples of the prompt, computed once; each event
        and result then carries its ``sample_index`` (see ``qil_worker.engine.samples``).
        """
        if isinstance(token_ids, RequestSpec):
            if options or sampling is not None or stop_token_ids is not None or request_id is not None:
                raise TypeError("pass a RequestSpec alone (or the keyword form without one)")
            spec = token_ids
        else:
            spec = RequestSpec.of(token_ids, max_new_tokens, stop_token_ids, request_id, sampling, **options)
        return self._admit(spec, constraint)

    def _admit(self, spec: RequestSpec, constraint: CompiledConstraint | None) -> str:
        """``submit`` of a spec: the checks that need the model, the pool and the tokenizer,
        then the request (and its samples) into the scheduler."""
        self._check_open()
        prompt_spec = spec.prompt
        token_ids = prompt_spec.token_ids
        pooling = spec.pooling
        if pooling is not None:
            if pooling.kind == "score" and pooling.yes_token_id is None:  # the tokenizer's yes and no
                yes, no = answer_token_ids(self.tokenizer)
                pooling = dataclasses.replace(pooling, yes_token_id=yes, no_token_id=no)
            pooling.check_model(self.model.config.hidden_size, self.model.config.vocab_size)
        if prompt_spec.is_text:
            token_ids = encode_prompt(
                self.tokenizer, prompt_spec.text, prompt_spec.messages, prompt_spec.enable_thinking,
                tools=prompt_spec.tools, document=spec.embeds,
            )
        text_options = spec.text
        if text_options.stop_strings and self.tokenizer is None:
            raise TokenizerUnavailableError(
                "stop strings need a tokenizer; this engine has none", field="stop_strings"
            )
        prompt, stops = validate_submit(
            token_ids, spec.max_new_tokens, spec.stop_token_ids, self.model.config, self.pool.total,
            self.page_size, prompt_spec.field,
        )
        sampling, max_new_tokens = spec.sampling, spec.max_new_tokens
        sampling.check_vocab(self.model.config.vocab_size)
        scored_prompt = prompt_logprobs.PromptLogprobs.asked(sampling.prompt_logprobs, len(prompt))
        if spec.constraint is not None and constraint is not None:
            raise InvalidRequestError(spec.constraint.kind, "give a constraint or a compiled constraint=, not both")
        if constraint is not None and not isinstance(constraint, CompiledConstraint):
            raise TypeError(f"constraint must be a CompiledConstraint, got {type(constraint).__name__}")
        samples.check_fits(sampling.n, len(prompt), max_new_tokens, self.scheduler, self.page_size)
        request_id = spec.request_id
        if request_id in self._requests:
            # active, or cancelled with its final event not yet handed out: reusing the id now
            # would interleave two requests' events under one id
            raise DuplicateRequestError(request_id)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests or request_id in self._results:
                request_id = f"req-{next(self._ids)}"
        if spec.constraint is not None:
            constraint = self.compile_constraint(spec.constraint)
        if constraint is not None and constraint.vocab_size != self.model.config.vocab_size:
            raise ValueError("the constraint was compiled for another model's vocabulary")

        def text_output() -> TextOutput | None:
            if self.tokenizer is None or pooling is not None:  # a pooled request makes no text
                return None
            return TextOutput(self.tokenizer, text_options.stop_strings, text_options.include_stop_string,
                              text_options.skip_special_tokens)

        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            max_new_tokens=max_new_tokens,
            stop_token_ids=frozenset(stops) | (frozenset() if sampling.ignore_eos else self._eos_ids),
            page_table=PageTable(self.page_size),
            metrics=RequestMetrics(arrival_time=time.perf_counter()),
            sampling=sampling,
            page_hashes=page_hashes(prompt, self.page_size) if self.prefix_cache is not None else [],
            seed=sampling.seed if sampling.seed is not None else secrets.randbits(63),
            text=text_output(),
            prompt_logprobs=scored_prompt,
            grammar=constraint.new_matcher() if constraint is not None else None,
            pooling=pooling,
        )
        if sampling.n > 1:

            def fresh(sample: Request) -> None:
                sample.text = text_output()
                sample.grammar = constraint.new_matcher() if constraint is not None else None

            samples.make_samples(request, sampling.n, fresh)
        self._results.pop(request_id, None)  # a finished request of the same id is forgotten
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    @property
    def grammars(self) -> "GrammarCompiler":
        """The engine's grammar compiler (thread-safe; created on first use). Raises
        ``FeatureUnavailableError`` without llguidance or without a tokenizer. Its ``warm()``
        builds llguidance's tokenizer info ahead of the first constrained request."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise FeatureUnavailableError(
                        "structured output needs the model's tokenizer; this engine has none "
                        "(serve a model directory with its tokenizer files and the text extra)"
                    )
                from qil_worker.structured.compiler import GrammarCompiler

                self._grammars = GrammarCompiler(
                    self.tokenizer, self.model.config.vocab_size, sorted(self._eos_ids)
                )
            return self._grammars

    def compile_constraint(self, spec: ConstraintSpec) -> CompiledConstraint:
        """Compile (or find cached) a request's constraint, for ``submit(constraint=...)``;
        thread-safe, so a worker compiles beside its step loop. Errors name ``spec.kind``:
        ``InvalidRequestError`` for a constraint that does not compile (the library's message),
        ``FeatureUnavailableError`` for what is missing."""
        try:
            return self.grammars.compile(spec)
        except FeatureUnavailableError as exc:
            if exc.field is None:
                exc.field = spec.kind
            raise

    def cancel(self, request_id: str) -> bool:
        """End a request (all its samples) now and free its pages; True if it was still active."""
        request = self._requests.get(request_id)
        live = [] if request is None else [m for m in members(request) if not m.finished]
        for sample in live:
            self._finish(sample, FinishReason.CANCELLED)
            self._pending.append(samples.tagged(self._final_event(sample, handed_out_now=False), sample))
        return bool(live)

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Run one batched forward over all scheduled work and return the events of the step read.

        Without overlap the step launched here is read at once and its events returned. With
        ``overlap`` the step launched here stays on the device and the one launched by the
        previous call is read after it, so the host work of scheduling and staging this step
        runs while the device computes the previous one; its events are returned now. A step
        whose successor needs its tokens on the host is read before scheduling instead (the
        synchronous fallback; which steps: ``qil_worker.engine.in_flight``). Either way one call
        reads at most one step, so a request has at most one event per call.
        """
        self._check_open()
        events, self._pending = self._pending, []
        for event in events:  # the cancelled (or deferred failed) requests' ids are free again
            self._requests.pop(event.request_id, None)
        previous, self._in_flight = self._in_flight, None
        read_before = False
        if previous is not None and not previous.stays_in_flight:  # the next step needs its tokens
            self._land(previous, events)
            previous, read_before = None, True
        # beside a step in flight, scheduling gives up rather than preempt: requests that
        # ended in that step free their pages once it is read, which may spare the preemption
        chunks = self.scheduler.schedule(preempt=previous is None)
        if chunks is None:
            self._land(previous, events)
            previous, read_before = None, True
            chunks = self.scheduler.schedule()
        launched: InFlightStep | None = None
        failure: Exception | None = None
        if chunks:
            now = time.perf_counter()
            for chunk in chunks:
                if chunk.request.metrics.first_scheduled_time is None:
                    chunk.request.metrics.first_scheduled_time = now
            try:
                launched = self._launch(chunks, previous)
            except Exception as exc:  # the whole forward failed: its requests fail below, keep serving
                log.exception("step failed for %d request(s)", len(chunks))
                failure = exc
        if previous is not None:
            if launched is not None:
                self.overlapped_steps += 1  # launched before the previous step was read
            self._land(previous, events)
            read_before = True
        if failure is not None:
            failed = [chunk.request for chunk in chunks]
            failed += [s for r in failed for s in unforked(r)]  # their prompt failed too
            # a request may have had its token of the step read above: its failure is the next call's
            self._fail_step(failed, failure, events, defer=read_before)
        elif launched is not None and self.device_failure is None:
            if self.overlap:
                launched.mark()
                self._in_flight = launched
            else:
                self._land(launched, events)
        return events

    def _launch(self, chunks: list[ScheduledChunk], previous: InFlightStep | None) -> InFlightStep:
        """Queue a step's forward and sampling on the device (the runner's) and commit its KV
        writes; nothing waits for the device. Inputs of tokens still in flight come from
        ``previous``."""
        launched = self.runner.launch(chunks, previous.sample.tokens if previous is not None else None)
        requests, forks = launched.requests, launched.forks
        self.scheduler.commit(launched.computed)
        for row, group in forks:  # before any token is accepted: a sample that ends holds the pages
            samples.fork(requests[row], group, self.scheduler, self.pool, self.runner)
        # pooled requests end when their answers are read: before the next schedule
        stays = self.overlap and stays_in_flight(requests, forks) and launched.pooled is None
        return InFlightStep(chunks, requests, launched.sample, stays, pooled=launched.pooled)

    def _land(self, step: InFlightStep, events: list[Event]) -> None:
        """Read a launched step's tokens and accept them into ``events``; a request that ended
        since the launch (in the step before, or cancelled) gets nothing from it."""
        try:
            sampled = step.sample.read()
        except Exception as exc:  # the step failed on the device after all
            log.exception("step failed for %d request(s)", len(step.requests))
            for request in step.requests:
                request.in_flight_row = -1
            self._fail_step([c.request for c in step.chunks] + step.requests, exc, events)
            return
        now = time.perf_counter()
        accept = self._accept_token
        append = events.append
        marked = step.marked
        for request, token, logprob, top in zip(step.requests, sampled.tokens, sampled.logprobs, sampled.top_logprobs):
            if marked:  # overlapped: the token is known now; a request that ended since the launch drops it
                request.in_flight_row = -1
                if request.finished:
                    continue
            event = accept(request, token, now, logprob, top)
            if request.prompt_logprobs is not None:
                event = request.prompt_logprobs.attach(event)
            append(event if request.group is None else samples.tagged(event, request))
        if step.pooled is not None:
            self._answer(step.pooled, now, events)

    def _answer(self, pooled: PooledAnswers, now: float, events: list[Event]) -> None:
        """Pooled requests whose prompt the step ended: each gets its answer and ends (STOP)."""
        for request, answer in zip(pooled.requests, pooled.read()):
            if request.finished:  # cancelled since the launch
                continue
            request.pooled = answer
            request.metrics.record_token(now)  # the answer is its "first token": TTFT means time to it
            self._finish(request, FinishReason.STOP)
            events.append(self._final_event(request, handed_out_now=True))

    def _fail_step(self, requests: list[Request], exc: Exception, events: list[Event], defer: bool = False) -> None:
        """A step failed as a whole: fail its unfinished ``requests`` (per-request isolation) —
        or, when the device is unusable after it, every unfinished request. ``defer``: their
        final events go out with the next step, as a cancel's (unless the device is unusable:
        the worker exits after this step)."""
        message = f"step failed: {type(exc).__name__}: {exc}"
        failed = list(dict.fromkeys(r for r in requests if not r.finished))
        if device_unusable(exc):  # no later step can succeed: end everything, refuse work
            self.device_failure = message
            self._in_flight = None
            defer = False
            in_step = set(failed)
            failed += [
                m for r in self._requests.values() for m in members(r)
                if not m.finished and m not in in_step
            ]
        out = self._pending if defer else events
        for request in failed:
            out.append(samples.tagged(self._fail(request, message, handed_out_now=not defer), request))

    def _accept_token(
        self,
        request: Request,
        token: int,
        now: float,
        logprob: float | None,
        top_logprobs: list[tuple[int, float]] | None,
    ) -> Event:
        try:
            grammar, text_out = request.grammar, request.text
            if grammar is not None:
                refused = grammar.advance(token)
                if refused is not None:  # a lexer limit, or a token the mask should have forbidden
                    return self._fail(request, f"constraint: {refused}")
            output = request.output_token_ids
            output.append(token)
            request.metrics.record_token(now)
            text = text_out.push(token) if text_out is not None else None
            reason = None
            if token in request.stop_token_ids:
                reason, request.stop_reason = FinishReason.STOP, token
            elif text_out is not None and text_out.matched_stop is not None:
                reason, request.stop_reason = FinishReason.STOP, text_out.matched_stop
            elif grammar is not None and grammar.stopped:
                reason = FinishReason.STOP  # the structure is complete; nothing may follow
            elif len(output) >= request.max_new_tokens:
                reason = FinishReason.LENGTH
            result = None
            if reason is not None:
                if text_out is not None:
                    text += text_out.finish()
                    if reason is FinishReason.LENGTH and text_out.matched_stop is not None:
                        # the last characters, released only now, completed a stop string
                        reason, request.stop_reason = FinishReason.STOP, text_out.matched_stop
                self._finish(request, reason)
                result = self._retire(request)
            return Event.of_token(
                request.request_id, token, len(output) - 1, reason, logprob, top_logprobs, text, request.stop_reason,
                result,
            )
        except Exception as exc:  # a fault of this request only
            log.exception("request %s failed", request.request_id)
            return self._fail(request, f"{type(exc).__name__}: {exc}")

    def _fail(self, request: Request, message: str, handed_out_now: bool = True) -> Event:
        request.error = message
        self._finish(request, FinishReason.ERROR)
        return self._final_event(request, handed_out_now=handed_out_now)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.remove(request)
        request.finish_reason = reason
        request.metrics.finished_time = time.perf_counter()

    def _final_event(self, request: Request, handed_out_now: bool) -> Event:
        """The closing event of a request that ended without producing a token; unless
        ``handed_out_now``, its id stays taken until the next step hands the event out."""
        text = request.text.finish() if request.text is not None else None
        return Event(
            request.request_id, None, len(request.output_token_ids), True,
            request.finish_reason, request.error, text=text,
            result=self._retire(request, keep_id=not handed_out_now),
        )

    def _retire(self, request: Request, keep_id: bool = False) -> Result:
        """A finished request's result, kept among the newest ``retained_results``; the request
        itself is forgotten (``keep_id``: once its final event is handed out). A request of
        several samples is forgotten, and its results kept, with its last sample."""
        result = request.result()
        if request.group is not None and request.group.running_after(request):
            return result
        if not keep_id:
            self._requests.pop(request.request_id, None)
        if self._retained_results:
            self._results[request.request_id] = [m.result() for m in members(request)]
            while len(self._results) > self._retained_results:
                self._results.popitem(last=False)
        return result

    # -- state and results -------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing waiting, nothing running, no step in flight and no event left to hand out."""
        return not self.scheduler.has_work and not self._pending and self._in_flight is None

    def result(self, request_id: str) -> Result:
        """The request as it stands: an active one, or a finished one still retained (the
        ``retained_results`` most recent, unless released). Of a request with several samples:
        sample 0 (``results`` has them all)."""
        return self.results(request_id)[0]

    def results(self, request_id: str) -> list[Result]:
        """``result`` of every sample of the request, in sample order (one unless ``n > 1``)."""
        request = self._requests.get(request_id)
        if request is not None:
            return [m.result() for m in members(request)]
        try:
            return list(self._results[request_id])
        except KeyError:
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None

    def num_prompt_tokens(self, request_id: str) -> int:
        """The prompt's length in tokens (after encoding text or rendering chat messages)."""
        return len(self._get(request_id).prompt_token_ids)

    def release(self, request_id: str) -> None:
        """Forget a finished request's result now (one the engine already let go of, or never
        knew, is nothing to forget)."""
        request = self._requests.get(request_id)
        if request is not None and not all(m.finished for m in members(request)):
            raise ValueError(f"request {request_id!r} is still active; cancel it first")
        self._results.pop(request_id, None)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_pages_total=self.pool.total,
            num_pages_used=self.pool.num_used,
            num_pages_free=self.pool.num_free,
            page_size=self.page_size,
            token_budget=s.token_budget,
            prefill_chunk=s.prefill_chunk,
            max_active=s.max_active,
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_pages_cached=self.pool.num_idle_cached,
            prefix_cache_hit_rate=self.prefix_cache.hit_rate if self.prefix_cache is not None else 0.0,
            schedule_policy=s.policy,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 16,
        stop_token_ids: Sequence[int] | None = None,
        *,
        json_schema: str | dict | None = None,
        json_object: bool | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        choice: Sequence[str] | None = None,
        constraint: CompiledConstraint | None = None,
        **sampling_fields: object,
    ) -> list[Result] | list[list[Result]]:
        """Run a batch of prompts to completion and return their results in order; with
        ``n > 1`` (a sampling field), a list of the ``n`` samples' results per prompt. A
        constraint (see ``submit``) applies to every prompt.

        All or nothing: when a prompt is refused, the ones before it are withdrawn."""
        spec = ConstraintSpec.from_kwargs(json_schema, json_object, regex, grammar, choice)
        if spec is not None:
            if constraint is not None:
                raise InvalidRequestError(spec.kind, "give a constraint or a compiled constraint=, not both")
            constraint = self.compile_constraint(spec)
        ids: list[str] = []
        try:
            for prompt in prompts:
                ids.append(
                    self.submit(prompt, max_new_tokens, stop_token_ids, constraint=constraint, **sampling_fields)
                )
        except Exception:
            self._withdraw(ids)
            raise
        results = self._run_to_end(ids)
        n = sampling_fields.get("n", 1)
        if n == 1:
            return [results[i][0] for i in ids]
        return [[results[i][s] for s in range(n)] for i in ids]

    def embed(
        self, inputs: Sequence[Sequence[int] | str], dimensions: int | None = None, normalize: bool = True
    ) -> list[list[float]]:
        """The embeddings of a batch of inputs (token-id lists, or texts encoded with the
        tokenizer's own special tokens), in order: see ``spec.Pooling``. All or nothing, as
        ``generate``; a failed request raises ``RuntimeError`` with its error."""
        pooling = Pooling("embed", dimensions=dimensions, normalize=normalize)
        return [r.embedding for r in self._pool(inputs, pooling)]

    def score(
        self, inputs: Sequence[Sequence[int] | str], yes_token_id: int | None = None, no_token_id: int | None = None
    ) -> list[float]:
        """P(yes) of a yes/no judge at the end of each input (a reranker's prompt, e.g.
        ``text.rerank_prompt``), in order; the answers' ids default to the tokenizer's "yes"
        and "no"."""
        pooling = Pooling("score", yes_token_id=yes_token_id, no_token_id=no_token_id)
        return [r.score for r in self._pool(inputs, pooling)]

    def _pool(self, inputs: Sequence[Sequence[int] | str], pooling: Pooling) -> list[Result]:
        ids: list[str] = []
        try:
            for item in inputs:
                text, token_ids = (item, None) if isinstance(item, str) else (None, item)
                ids.append(self.submit(RequestSpec.pooled(pooling, token_ids, text)))
        except Exception:
            self._withdraw(ids)
            raise
        by_id = self._run_to_end(ids)
        results = [by_id[i][0] for i in ids]
        failed = next((r for r in results if r.finish_reason is not FinishReason.STOP), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} {failed.finish_reason.label}: {failed.error}")
        return results

    def _run_to_end(self, ids: list[str]) -> dict[str, dict[int, Result]]:
        """Step until every request of ``ids`` ended; their results by sample index (released)."""
        wanted = set(ids)
        results: dict[str, dict[int, Result]] = {i: {} for i in ids}
        done: set[str] = set()
        while len(done) < len(ids):
            for event in self.step():
                if event.result is not None and event.request_id in wanted:
                    results[event.request_id][event.sample_index] = event.result
                    if event.request_finished:
                        done.add(event.request_id)
        for i in ids:
            self.release(i)
        return results

    def _withdraw(self, request_ids: list[str]) -> None:
        """Forget requests that were submitted but not yet stepped, as if never submitted."""
        for request_id in request_ids:
            for sample in members(self._requests.pop(request_id)):
                self._finish(sample, FinishReason.CANCELLED)

    def close(self) -> None:
        """Cancel what is active and drop the KV tensors; events not yet handed out are dropped."""
        if self._closed:
            return
        self._in_flight = None  # its tokens are dropped with the requests
        for request in list(self._requests.values()):
            for sample in members(request):
                if not sample.finished:
                    self._finish(sample, FinishReason.CANCELLED)
        self._pending.clear()
        self._closed = True
        self.runner.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is closed")
        if self.device_failure is not None:
            raise DeviceFailedError(f"the device is unusable after a failed step ({self.device_failure})")

    def _get(self, request_id: str) -> Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"unknown request id {request_id!r}") from None
