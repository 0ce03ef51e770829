"""The worker process: owns the model, the KV page pool and the scheduler (``Engine``).

Started by the front with the multiprocessing *spawn* context (never fork: the front runs an
asyncio loop and gRPC threads that must not be copied). Torch is imported here, inside
``worker_main``, so that importing this module in the front stays torch-free.

Loop: block on the pipe while the engine is idle; otherwise drain every pending message (submits,
cancels, stats requests) without blocking, run one ``engine.step()``, and send ONE ``BATCH``
message with everything that step produced. See ``protocol`` for the messages and the transport.

Waking from idle, the worker keeps reading while messages follow each other closely
(``BURST_GAP_S``, at most ``BURST_WINDOW_S``): clients that submit a burst — a closed loop
refilling all its slots when a wave of requests ends together — then get one prefill step
together instead of one request alone first and the rest a whole step later. A busy worker
never waits: it takes whatever arrived while the step ran. Long text prompts are tokenized on
a thread beside the loop (``prompt_encoder``), so a prompt of megabytes stalls no other stream.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

from qil_worker.service import protocol as P
from qil_worker.service.errors import classify_engine_error
from qil_worker.service.heap import freeze_startup_heap
from qil_worker.service.prompt_encoder import PromptEncoder

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


def worker_main(conn: Any, config: dict[str, Any]) -> None:
    """Process entry point. ``config``: model, device, dtype, threads, engine kwargs, demo flag."""
    # The front owns signals: Ctrl-C in a terminal, systemd's stop and ``kill -TERM -PGID`` reach
    # the whole process group, and the front decides when (after the grace period) the worker
    # stops: it sends STOP, and kills a worker that does not. A worker whose front is gone exits
    # on its own (EOF on the pipe, or the parent check while idle).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from qil_worker.service import logs

    logs.setup(config.get("log_level", "INFO"), config.get("log_format", "text"))
    parent_pid = os.getppid()
    try:
        engine, info = _load(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the front, then exit
        log.error("worker failed to start: %s", exc)
        try:
            conn.send((P.FATAL, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(3)
    try:
        conn.send((P.READY, info))
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


DEFAULT_NUM_PAGES = 512


def _load(config: dict[str, Any]):
    import torch

    from qil_worker.cpu_memory import configure_process
    from qil_worker.engine import Engine
    from qil_worker.engine.memory import size_pool
    from qil_worker.model import Qwen3

    configure_process(config.get("device", "cpu"))  # before the model: the first oneDNN call fixes them
    if config.get("threads"):
        torch.set_num_threads(int(config["threads"]))
    model_dir = config.get("model")
    demo = not model_dir
    if demo:
        from qil_worker.service.demo_model import ensure_demo_model

        model_dir = str(ensure_demo_model())
        log.info("serving the embedded DEMO model (random weights) from %s", model_dir)
    t0 = time.perf_counter()
    model = Qwen3.from_directory(model_dir, device=config.get("device", "cpu"), dtype=config.get("dtype"))
    cfg = model.config
    tokenizer, tokenizer_dir = _load_tokenizer(config, model_dir, cfg.vocab_size)
    engine_kw = dict(config.get("engine", {}))
    num_pages = engine_kw.pop("num_pages", None)
    memory_bytes = config.get("kv_memory_bytes")
    memory_fraction = config.get("kv_memory_fraction")
    if num_pages is None and memory_bytes is None and memory_fraction is None:
        num_pages = DEFAULT_NUM_PAGES
    pool = size_pool(
        model, int(engine_kw.get("page_size", 16)), num_pages=num_pages,
        memory_bytes=memory_bytes, memory_fraction=memory_fraction,
        warmup_tokens=int(engine_kw.get("token_budget", 512)),
        reserved_pages=Engine.scratch_pages(model, engine_kw.get("cuda_graphs"), engine_kw.get("debug", False)),
    )
    engine = Engine(model, num_pages=pool.num_pages, tokenizer=tokenizer, **engine_kw)
    _warm_up(engine, cfg.vocab_size)
    _install_forward_fault(model, os.environ.get(FAULT_FORWARD_ENV))
    frozen = freeze_startup_heap()
    stats = engine.stats()
    info = {
        "name": "demo" if demo else str(model_dir),
        "demo": demo,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_ids": list(cfg.eos_token_ids),
        "dtype": str(getattr(model, "dtype", cfg.torch_dtype)).replace("torch.", ""),
        "device": str(getattr(model, "device", config.get("device", "cpu"))),
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "has_tokenizer": tokenizer is not None,
        "has_chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "tokenizer": tokenizer_dir,
        "prefix_cache": engine.prefix_cache is not None,
        "schedule_policy": stats.schedule_policy,
        "cuda_graphs": engine.decode_graphs is not None,
        "attention": engine.attention_backend,
        "kv_pool": pool.summary(),
        "page_bytes": pool.page_bytes,
        "page_size": stats.page_size,
        "token_budget": stats.token_budget,
        "prefill_chunk": stats.prefill_chunk,
        "max_active": stats.max_active,
        "pid": os.getpid(),
        "stats": _stats(engine),
    }
    memory = _memory_summary(model, pool)
    info["memory"] = memory
    log.info(
        "model %s loaded and warm in %.2fs: dtype %s, device %s, %d KV pages (%s); memory: %s; "
        "tokenizer: %s; prefix cache: %s; schedule: %s; attention: %s; decode CUDA graphs: %s; "
        "%d start-up objects frozen for the GC",
        info["name"], time.perf_counter() - t0, info["dtype"], info["device"], pool.num_pages,
        pool.summary(), memory, tokenizer_dir or "none", "on" if info["prefix_cache"] else "off",
        info["schedule_policy"], info["attention"], "on" if info["cuda_graphs"] else "off", frozen,
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


def _load_tokenizer(config: dict[str, Any], model_dir: str, vocab_size: int) -> tuple[Any, str | None]:
    """The tokenizer lives in the worker, next to the engine, and not in the front.

    The engine detokenizes every token and matches stop strings in the same step that produced
    the token, so a request ends exactly where its stop string appears (no token is generated,
    and no KV page held, past it) and text deltas leave the worker already whole characters.
    Doing this in the front would need a round trip per token to stop, and would pull
    transformers (and its import time and memory) into the process that must stay light.

    ``config["tokenizer"]``: a directory (must load), or None for the model directory's own
    tokenizer when it has one and transformers is installed (otherwise: serve token ids only).
    ``config["use_tokenizer"]`` False disables it.
    """
    from qil_worker.errors import TokenizerUnavailableError
    from qil_worker.text import load_tokenizer
    from qil_worker.text.tokenizer import has_tokenizer_files

    if not config.get("use_tokenizer", True):
        return None, None
    explicit = config.get("tokenizer")
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


def _warm_up(engine: Any, vocab_size: int) -> None:
    """One tiny request end to end, so the first real request does not pay for lazy init."""
    rid = engine.submit([i % vocab_size for i in range(4)], max_new_tokens=2, request_id="__qil_warmup__")
    while not engine.idle:
        engine.step()
    engine.release(rid)


def _stats(engine: Any) -> tuple[int, ...]:
    s = engine.stats()
    return (
        s.num_pages_total, s.num_pages_used, s.num_pages_free, s.num_running, s.num_waiting,
        s.num_pages_cached, float(s.prefix_cache_hit_rate),
    )


def _opt(value: float | None) -> float:
    return -1.0 if value is None else float(value)


def _submit(engine: Any, msg: tuple, error: BaseException | None = None) -> tuple:
    """Queue a SUBMIT in the engine → its ack ``(rid, error or None, prompt tokens)``."""
    _, rid, token_ids, max_new_tokens, stop_ids, options = msg
    try:
        if error is not None:  # its prompt could not be encoded
            raise error
        engine.submit(
            token_ids,
            max_new_tokens=max_new_tokens,
            stop_token_ids=list(stop_ids) or None,
            request_id=rid,
            **options,
        )
        return (rid, None, engine.num_prompt_tokens(rid))
    except Exception as exc:  # noqa: BLE001 - rejected in-band, the worker goes on
        return (rid, classify_engine_error(exc), 0)


def _serve(conn: Any, engine: Any, parent_pid: int) -> int:
    encoder = PromptEncoder(engine.tokenizer)
    try:
        return _loop(conn, engine, parent_pid, encoder)
    finally:
        encoder.close()


def _loop(conn: Any, engine: Any, parent_pid: int, encoder: PromptEncoder) -> int:
    finish_codes = P.FINISH_CODES
    stop_code = finish_codes["stop"]
    while True:
        burst_until = 0.0
        if engine.idle:
            # Block (no spinning) until the front sends something or a prompt is encoded; check
            # now and then that the front still exists (EOF on the pipe is the main signal).
            while not conn.poll(0.0 if encoder.busy else PARENT_CHECK_S):
                if encoder.busy and encoder.wait(ENCODING_POLL_S):
                    break
                if os.getppid() != parent_pid:
                    log.warning("front process %d is gone; worker exits", parent_pid)
                    return 0
            burst_until = time.monotonic() + BURST_WINDOW_S
        acks: list = []
        tickets: list = []
        # Drain everything pending before the step, so submits and cancels take effect at once.
        while conn.poll(min(BURST_GAP_S, max(0.0, burst_until - time.monotonic()))):
            msg = conn.recv()
            tag = msg[0]
            if tag == P.SUBMIT:
                if encoder.takes(msg[5]):
                    encoder.start(msg)  # acknowledged once encoded (``encoder.finished``)
                else:
                    acks.append(_submit(engine, msg))
            elif tag == P.CANCEL:
                if not encoder.cancel(msg[1]):
                    engine.cancel(msg[1])
            elif tag == P.STATS:
                tickets.append(msg[1])
            elif tag == P.STOP:
                return 0
        for msg, error, cancelled in encoder.finished():
            acks.append(_submit(engine, msg, error))
            if cancelled:
                engine.cancel(msg[1])
        events = []
        step_info = None
        if not engine.idle:
            t0 = time.perf_counter()
            step_events = engine.step()
            step_info = (time.perf_counter() - t0, len({ev.request_id for ev in step_events}))
            for ev in step_events:
                final = None
                code = 0
                if ev.finished:
                    code = finish_codes.get(getattr(ev.finish_reason, "value", ev.finish_reason), 4)
                    if ev.error:
                        log.warning("request failed: %s", ev.error, extra={"request_id": ev.request_id})
                    try:
                        r = engine.result(ev.request_id)
                        final = (
                            len(r.prompt_token_ids),
                            len(r.output_token_ids),
                            _opt(r.queue_time),
                            _opt(r.ttft),
                            _opt(r.mean_inter_token_latency),
                            _opt(r.max_inter_token_latency),
                            _opt(r.completion_time),
                            int(r.num_preemptions),
                            int(r.num_cached_tokens),
                            r.stop_reason if code == stop_code else None,
                        )
                        engine.release(ev.request_id)
                    except Exception:  # noqa: BLE001 - metrics are best effort
                        log.debug(
                            "no result: %s", traceback.format_exc(), extra={"request_id": ev.request_id}
                        )
                        final = (
                            0, ev.index + (ev.token_id is not None), -1.0, -1.0, -1.0, -1.0, -1.0,
                            0, 0, ev.stop_reason if code == stop_code else None,
                        )
                events.append(
                    (
                        ev.request_id,
                        -1 if ev.token_id is None else int(ev.token_id),
                        ev.index,
                        code,
                        ev.error,
                        final,
                        ev.text,
                        ev.logprob,
                        ev.top_logprobs,
                    )
                )
        if acks or events or tickets:
            conn.send((P.BATCH, acks, events, _stats(engine), tickets, step_info))
        if engine.device_failure is not None:
            # every later step would fail too: exit, and the front starts a fresh worker
            log.error("the device is unusable (%s); the worker exits to be restarted", engine.device_failure)
            return DEVICE_FAILED_EXIT
