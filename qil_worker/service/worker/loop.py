"""The worker process's loop: it owns the engine (model, KV page pool, scheduler) that
``startup.load`` made.

Started by the front with the multiprocessing *spawn* context (never fork: the front runs an
asyncio loop and gRPC threads that must not be copied). Torch is imported at start-up, inside
``worker_main``, so that importing this module in the front stays torch-free.

Loop: block on the pipe while the engine is idle; otherwise drain every pending message (submits,
cancels) without blocking, run one ``engine.step()``, and send ONE ``StepBatch`` with everything
that step produced. The engine finishes its own requests (their final events carry the results),
so the loop only maps events to records. See ``protocol`` for the messages and the transport.

Waking from idle, the worker keeps reading while messages follow each other closely
(``BURST_GAP_S``, at most ``BURST_WINDOW_S``): clients that submit a burst — a closed loop
refilling all its slots when a wave of requests ends together — then get one prefill step
together instead of one request alone first and the rest a whole step later. A busy worker
never waits: it takes whatever arrived while the step ran. Long text prompts are tokenized on
a thread beside the loop (``prompt_encoder``), so a prompt of megabytes stalls no other stream;
so are long Tokenize / Detokenize calls (``tokenizer_calls``), short ones are answered in the
loop. Structured-output constraints are compiled on another thread (``constraint_compiles``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from typing import Any

from qil_worker.service import protocol as P
from qil_worker.service.errors import classify_engine_error
from qil_worker.service.worker.constraint_compiles import ConstraintCompiles
from qil_worker.freed_memory import release_outsized
from qil_worker.service.worker.beside_loop import Pending
from qil_worker.service.worker.prompt_encoder import PromptEncoder, PromptRoom
from qil_worker.service.worker.startup import load, pool_stats
from qil_worker.service.worker.tokenizer_calls import detokenize, tokenize

log = logging.getLogger("qil.worker")

PARENT_CHECK_S = 1.0
DEVICE_FAILED_EXIT = 4  # the exit code of a worker whose device failed (see Engine.device_failure)
BURST_GAP_S = 0.002  # waking from idle: a message this soon after the last one joins the first step
BURST_WINDOW_S = 0.01  # ... for at most this long after the wake-up
ENCODING_POLL_S = 0.01  # idle while prompts are tokenized: how often the pipe is checked



def worker_main(conn: Any, config: P.WorkerConfig) -> None:
    """Process entry point: load what ``config`` names, tell the front, serve it."""
    # The front owns signals: Ctrl-C in a terminal, systemd's stop and ``kill -TERM -PGID`` reach
    # the whole process group, and the front decides when (after the grace period) the worker
    # stops: it sends STOP, and kills a worker that does not. A worker whose front is gone exits
    # on its own (EOF on the pipe, or the parent check while idle).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from qil_worker.service import logs

    logs.setup(config.log_level, config.log_format)
    parent_pid = os.getppid()
    try:
        engine, info = load(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the front, then exit
        log.error("worker failed to start: %s", exc)
        try:
            conn.send(P.Fatal(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(3)
    try:
        conn.send(P.Ready(info))
        code = _serve(conn, engine, parent_pid)
    except (EOFError, OSError):
        log.warning("front went away; worker exits")
        code = 0
    finally:
        try:
            engine.close()
        except Exception:  # noqa: BLE001
            pass
    sys.exit(code)


def submit(engine: Any, msg: Pending, error: BaseException | None = None) -> P.Ack:
    """Queue a submit in the engine (``error``: why its prompt could not be encoded or its
    constraint compiled)."""
    try:
        if error is not None:
            raise error
        engine.submit(msg.spec, constraint=msg.compiled)
        return P.Ack(msg.request_id, engine.num_prompt_tokens(msg.request_id))
    except Exception as exc:  # noqa: BLE001 - rejected in-band, the worker goes on
        return P.Ack(msg.request_id, 0, P.Rejection(*classify_engine_error(exc)))


def final_record(result: Any) -> P.FinalRecord:
    """An engine ``Result`` of a finished request → what the front keeps of it."""
    reason = result.finish_reason
    return P.FinalRecord(
        reason=reason,
        error=result.error,
        num_prompt_tokens=len(result.prompt_token_ids),
        num_output_tokens=len(result.output_token_ids),
        num_cached_tokens=int(result.num_cached_tokens),
        stop_reason=result.stop_reason if reason is P.FinishReason.STOP else None,
        metrics=P.RequestTimings(
            queue_time_s=result.queue_time,
            ttft_s=result.ttft,
            mean_itl_s=result.mean_inter_token_latency,
            max_itl_s=result.max_inter_token_latency,
            e2e_s=result.completion_time,
            num_preemptions=int(result.num_preemptions),
        ),
        pooled=result.embedding if result.embedding is not None else result.score,
    )


def step_batch(acks: list[P.Ack], events: list, stats: P.PoolStats, timing: P.StepTiming | None,
               engine: Any = None) -> P.StepBatch:
    """One loop iteration's acks and engine events → the batch the front gets (``engine``:
    where the cached prompt tokens of requests with their first token are read)."""
    finals = {}
    cached = {}
    for ev in events:
        if ev.result is not None:
            if ev.error:
                log.warning("request failed: %s", ev.error, extra={"request_id": ev.request_id})
            finals[(ev.request_id, ev.sample_index) if ev.sample_index else ev.request_id] = final_record(ev.result)
        elif ev.index == 0 and ev.token_id is not None and engine is not None:
            cached[ev.request_id] = int(engine.result(ev.request_id).num_cached_tokens)
    return P.StepBatch(
        acks=acks,
        request_ids=[ev.request_id for ev in events],
        token_ids=[-1 if ev.token_id is None else ev.token_id for ev in events],
        texts=[ev.text for ev in events],
        logprobs=[ev.logprob for ev in events],
        top_logprobs=[ev.top_logprobs for ev in events],
        finals=finals,
        stats=stats,
        timing=timing,
        cached=cached,
        prompt_logprobs={
            ev.request_id: P.ScoredPrompt(ev.prompt_logprobs, ev.prompt_top_logprobs)
            for ev in events if ev.prompt_logprobs is not None
        },
        samples=[ev.sample_index for ev in events] if any(ev.sample_index for ev in events) else None,
    )


def _serve(conn: Any, engine: Any, parent_pid: int) -> int:
    room = PromptRoom(engine.model.config.max_position_embeddings, engine.pool.total, engine.page_size)
    encoder = PromptEncoder(engine.tokenizer, room)
    compiles = ConstraintCompiles(engine)
    try:
        return _loop(conn, engine, parent_pid, encoder, compiles)
    finally:
        encoder.close()
        compiles.close()


def _wait_for_work(conn: Any, parent_pid: int, beside: tuple[PromptEncoder, ConstraintCompiles]) -> bool:
    """Block (no spinning) until the front sends something or a prompt is encoded or a
    constraint compiled (``beside``); False when the front is gone (EOF on the pipe is the main
    signal, the parent check the fallback)."""
    while not conn.poll(0.0 if any(b.busy for b in beside) else PARENT_CHECK_S):
        busy = [b for b in beside if b.busy]
        if any(b.wait(ENCODING_POLL_S / len(busy)) for b in busy):
            return True
        if os.getppid() != parent_pid:
            log.warning("front process %d is gone; worker exits", parent_pid)
            return False
    return True


def _drain(conn: Any, engine: Any, encoder: PromptEncoder, compiles: ConstraintCompiles,
           burst_until: float) -> list[P.Ack] | None:
    """Take every pending message (and, waking from idle, those of a burst until
    ``burst_until``) so submits and cancels take effect before the step; None on ``Stop``.

    A submit goes to the engine once its long text prompt is encoded (``encoder``) and then its
    constraint compiled (``compiles``), each on a thread; it is acknowledged then."""
    acks: list[P.Ack] = []

    def submit_now(pending: Pending, error: BaseException | None = None, cancelled: bool = False) -> None:
        acks.append(submit(engine, pending, error))
        if cancelled:  # a cancel came while it was encoded or compiled
            engine.cancel(pending.request_id)

    def submit_when_ready(pending: Pending, error: BaseException | None = None, cancelled: bool = False) -> None:
        if error is None and compiles.takes(pending.spec):
            compiles.start(pending, cancelled)  # acknowledged once compiled (``compiles.finished``)
        else:
            submit_now(pending, error, cancelled)

    while conn.poll(min(BURST_GAP_S, max(0.0, burst_until - time.monotonic()))):
        msg = conn.recv()
        if isinstance(msg, P.Submit):
            pending = Pending(msg.spec)
            if encoder.takes(msg.spec):
                encoder.start(pending)  # acknowledged once encoded (``encoder.finished``)
            else:
                submit_when_ready(pending)
        elif isinstance(msg, P.Cancel):
            if not (encoder.cancel(msg.request_id) or compiles.cancel(msg.request_id)):
                engine.cancel(msg.request_id)
        elif isinstance(msg, P.TOKENIZER_CALLS):
            _tokenizer_call(conn, engine, encoder, msg)
        elif isinstance(msg, P.Stop):
            return None
    for answer in encoder.answers():
        conn.send(answer)
    for encoded in encoder.finished():
        submit_when_ready(*encoded)
    for compiled in compiles.finished():
        submit_now(*compiled)
    if encoder.take_outsized():
        release_outsized()  # its text and buffers are freed now: hand them back
    return acks


def _tokenizer_call(conn: Any, engine: Any, encoder: PromptEncoder, call: P.Tokenize | P.Detokenize) -> None:
    """Answer a Tokenize / Detokenize now, or on the encoding thread when it is long."""
    if isinstance(call, P.Tokenize):
        answer, args = tokenize, (engine.tokenizer, call)
    else:
        answer, args = detokenize, (engine.tokenizer, engine.model.config.vocab_size, call)
    if encoder.takes_call(call):
        encoder.start_call(answer, *args)  # answered by ``_drain`` once done
    else:
        conn.send(answer(*args))


def _loop(conn: Any, engine: Any, parent_pid: int, encoder: PromptEncoder, compiles: ConstraintCompiles) -> int:
    while True:
        burst_until = 0.0
        if engine.idle:
            if not _wait_for_work(conn, parent_pid, (encoder, compiles)):
                return 0
            burst_until = time.monotonic() + BURST_WINDOW_S
        acks = _drain(conn, engine, encoder, compiles, burst_until)
        if acks is None:
            return 0
        events: list = []
        timing = None
        if not engine.idle:
            t0 = time.perf_counter()
            events = engine.step()
            timing = P.StepTiming(time.perf_counter() - t0, len({ev.request_id for ev in events}))
        if acks or timing is not None:
            # (a step without events, a prompt chunk, still changes the pool's numbers)
            conn.send(step_batch(acks, events, pool_stats(engine), timing, engine))
        if engine.device_failure is not None:
            # every later step would fail too: exit, and the front starts a fresh worker
            log.error("the device is unusable (%s); the worker exits to be restarted", engine.device_failure)
            return DEVICE_FAILED_EXIT
