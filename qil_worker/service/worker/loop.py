"""The worker process: owns the model, the KV page pool and the scheduler (``Engine``).

Started by the front with the multiprocessing *spawn* context (never fork: the front runs an
asyncio loop and gRPC threads that must not be copied). Torch is imported here, inside
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

import dataclasses
import logging
import os
import signal
import sys
import time
from typing import Any

from qil_worker.service import protocol as P
from qil_worker.service.errors import classify_engine_error
from qil_worker.service.worker.constraint_compiles import ConstraintCompiles
from qil_worker.service.heap import freeze_startup_heap
from qil_worker.freed_memory import release_outsized
from qil_worker.service.worker.beside_loop import Pending
from qil_worker.service.worker.prompt_encoder import PromptEncoder, PromptRoom
from qil_worker.service.worker.tokenizer_calls import detokenize, tokenize

log = logging.getLogger("qil.worker")

PARENT_CHECK_S = 1.0
DEVICE_FAILED_EXIT = 4  # the exit code of a worker whose device failed (see Engine.device_failure)
BURST_GAP_S = 0.002  # waking from idle: a message this soon after the last one joins the first step
BURST_WINDOW_S = 0.01  # ... for at most this long after the wake-up
ENCODING_POLL_S = 0.01  # idle while prompts are tokenized: how often the pipe is checked

# TEST-ONLY fault injection, off by default and settable only through the worker's environment
# (never from the network): "N" or "N:K" makes model forward calls N..N+K-1 (1-based, counted
# after the warm-up; K defaults to 1) raise RuntimeError, to test that a failing step ends its
# requests with an in-band error and the server keeps serving; "N:K:device" raises what a
# sticky CUDA error raises instead, to test that the worker is replaced.
FAULT_FORWARD_ENV = "QIL_TEST_FAULT_FORWARD"


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
        engine, info = _load(config)
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


def _load(config: P.WorkerConfig):
    import torch

    from qil_worker.cpu_memory import configure_process
    from qil_worker.engine import Engine
    from qil_worker.engine.memory import size_pool
    from qil_worker.engine.runner.model_runner import scratch_pages
    from qil_worker.model import Qwen3
    from qil_worker.text.tokenizer import EncodingTraits, encoding_traits, tokenizer_summary

    configure_process(config.device)  # before the model: the first oneDNN call fixes them
    if config.threads:
        torch.set_num_threads(config.threads)
    model_dir = config.model
    demo = not model_dir
    if demo:
        from qil_worker.service.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
        log.info("serving the embedded DEMO model (random weights) from %s", model_dir)
    t0 = time.perf_counter()
    model = Qwen3.from_directory(
        model_dir, device=config.device, dtype=config.dtype, quantize=config.quantize,
    )
    weight_format, weight_bytes = model.weight_summary()
    cfg = model.config
    tokenizer, tokenizer_dir = _load_tokenizer(config, model_dir, cfg.vocab_size)
    engine_config = config.engine
    memory_bytes, memory_fraction = config.kv_memory_bytes, config.kv_memory_fraction
    sized = memory_bytes is not None or memory_fraction is not None  # else: engine_config.num_pages
    scratch = scratch_pages(model, engine_config.cuda_graphs, engine_config.debug)
    pool = size_pool(
        model, engine_config.page_size, num_pages=None if sized else engine_config.num_pages,
        memory_bytes=memory_bytes, memory_fraction=memory_fraction, warmup_tokens=engine_config.token_budget,
        reserved_pages=scratch, graphs=scratch > 0,  # the scratch page means graphs
    )
    # retained_results=0: results reach the front in the final events, none is read back
    engine_config = dataclasses.replace(engine_config, num_pages=pool.num_pages, retained_results=0)
    engine = Engine(model, engine_config, tokenizer=tokenizer)
    _warm_up(engine, cfg.vocab_size)
    _install_forward_fault(model, os.environ.get(FAULT_FORWARD_ENV))
    structured = _can_constrain(engine)  # imports the grammar library: before the heap freeze
    if structured and config.structured_warmup:
        # Before Ready, not on a thread beside the loop: building the library's tokenizer tables
        # holds the GIL for much of its second or two, which would stall every stream that long.
        t_warm = time.perf_counter()
        engine.grammars.warm()
        log.info("structured output: grammar tables built in %.2fs", time.perf_counter() - t_warm)
    traits = encoding_traits(tokenizer) if tokenizer is not None else EncodingTraits()
    frozen = freeze_startup_heap()
    stats = engine.stats()
    info = P.WorkerInfo(
        name="demo" if demo else str(model_dir),
        demo=demo,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_ids=list(cfg.eos_token_ids),
        dtype=str(getattr(model, "dtype", cfg.torch_dtype)).replace("torch.", ""),
        device=str(model.device),
        num_hidden_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        has_tokenizer=tokenizer is not None,
        has_chat_template=bool(getattr(tokenizer, "chat_template", None)),
        tokenizer=tokenizer_dir,
        prefix_cache=engine.prefix_cache is not None,
        schedule_policy=stats.schedule_policy,
        cuda_graphs=engine.runner.decode_graphs is not None,
        attention=engine.attention_backend,
        kv_pool=pool.summary(),
        memory=_memory_summary(model, pool),
        page_bytes=pool.page_bytes,
        page_size=stats.page_size,
        token_budget=stats.token_budget,
        prefill_chunk=stats.prefill_chunk,
        max_active=stats.max_active,
        pid=os.getpid(),
        stats=pool_stats(engine),
        structured_output=structured,
        max_token_bytes=traits.max_token_bytes,
        normal_form=traits.normal_form,
        weight_format=weight_format,
        weight_bytes=weight_bytes,
        tokenizer_summary={} if tokenizer is None else tokenizer_summary(tokenizer, cfg.max_position_embeddings),
    )
    log.info(
        "model %s loaded and warm in %.2fs: dtype %s, device %s, weights %s (%s); %d KV pages (%s); memory: %s; "
        "tokenizer: %s; prefix cache: %s; schedule: %s; attention: %s; decode CUDA graphs: %s; "
        "overlapped scheduling: %s; structured output: %s; %d start-up objects frozen for the GC",
        info.name, time.perf_counter() - t0, info.dtype, info.device, info.weight_format,
        _mib(info.weight_bytes), pool.num_pages,
        info.kv_pool, info.memory, tokenizer_dir or "none", "on" if info.prefix_cache else "off",
        info.schedule_policy, info.attention, "on" if info.cuda_graphs else "off",
        "on" if engine.overlap else "off", "on" if info.structured_output else "off", frozen,
    )
    return engine, info


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _memory_summary(model: Any, pool: Any) -> str:
    """KV pool bytes, and torch's allocated device memory on CUDA or the process RSS on CPU."""
    parts = [f"KV pool {_mib(pool.total_bytes)}"]
    device = getattr(model, "device", None)
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        parts.append(f"cuda allocated {_mib(torch.cuda.memory_allocated(device))}")
    else:
        rss = _rss_bytes()
        if rss:
            parts.append(f"process RSS {_mib(rss)}")
    return ", ".join(parts)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except Exception:  # noqa: BLE001
            return 0


def _install_forward_fault(model: Any, spec: str | None) -> None:
    """TEST ONLY (see ``FAULT_FORWARD_ENV``): wrap this model instance's ``forward``."""
    if not spec:
        return
    import torch

    first, count, kind = (spec.split(":") + ["", ""])[:3]
    first_call, num = int(first), int(count or 1)
    error = RuntimeError
    if kind == "device":  # what torch raises for an illegal memory access on CUDA
        error = getattr(torch, "AcceleratorError", RuntimeError)
    inner = model.forward
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if first_call <= calls[0] < first_call + num:
            cause = "CUDA error: an illegal memory access was encountered; " if kind == "device" else ""
            raise error(f"{cause}injected fault in forward call {calls[0]} ({FAULT_FORWARD_ENV})")
        return inner(*args, **kwargs)

    model.forward = forward  # the instance attribute shadows the method for this model only
    log.warning("TEST FAULT INJECTION ON: forward calls %d..%d will raise", first_call, first_call + num - 1)


def _load_tokenizer(config: P.WorkerConfig, model_dir: str, vocab_size: int) -> tuple[Any, str | None]:
    """The tokenizer lives in the worker, next to the engine, and not in the front.

    The engine detokenizes every token and matches stop strings in the same step that produced
    the token, so a request ends exactly where its stop string appears (no token is generated,
    and no KV page held, past it) and text deltas leave the worker already whole characters.
    Doing this in the front would need a round trip per token to stop, and would pull
    transformers (and its import time and memory) into the process that must stay light.

    ``config.tokenizer``: a directory (must load), or None for the model directory's own
    tokenizer when it has one and transformers is installed (otherwise: serve token ids only).
    ``config.use_tokenizer`` False disables it.
    """
    from qil_worker.errors import TokenizerUnavailableError
    from qil_worker.text import load_tokenizer
    from qil_worker.text.tokenizer import has_tokenizer_files

    if not config.use_tokenizer:
        return None, None
    explicit = config.tokenizer
    path = explicit or model_dir
    if explicit is None:
        if not has_tokenizer_files(path):
            log.info("no tokenizer files in %s: serving token ids only", path)
            return None, None
        try:
            tokenizer = load_tokenizer(path)
        except TokenizerUnavailableError as exc:
            log.warning("serving token ids only: %s", exc)
            return None, None
    else:
        tokenizer = load_tokenizer(path)  # asked for explicitly: failing to load is fatal
    size = len(tokenizer)
    if size > vocab_size:
        raise TokenizerUnavailableError(
            f"the tokenizer of {path} has {size} tokens but the model's vocabulary has only "
            f"{vocab_size}: they do not belong together"
        )
    return tokenizer, str(path)


def _can_constrain(engine: Any) -> bool:
    """Whether constrained requests can run: the grammar library imports and there is a
    tokenizer (``Engine.grammars`` says which is missing otherwise; its tables are built later)."""
    try:
        engine.grammars
    except Exception as exc:  # noqa: BLE001 - FeatureUnavailableError: said once, here
        log.info("structured output unavailable: %s", exc)
        return False
    return True


def _warm_up(engine: Any, vocab_size: int) -> None:
    """One tiny request end to end, so the first real request does not pay for lazy init."""
    engine.submit([i % vocab_size for i in range(4)], max_new_tokens=2, request_id="__qil_warmup__")
    while not engine.idle:
        engine.step()


def pool_stats(engine: Any) -> P.PoolStats:
    s = engine.stats()
    return P.PoolStats(
        s.num_pages_total, s.num_pages_used, s.num_pages_free, s.num_running, s.num_waiting,
        s.num_pages_cached, float(s.prefix_cache_hit_rate),
    )


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
