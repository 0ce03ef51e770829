"""The worker process: owns the model, the KV page pool and the scheduler (``Engine``).

Started by the front with the multiprocessing *spawn* context (never fork: the front runs an
asyncio loop and gRPC threads that must not be copied). Torch is imported here, inside
``worker_main``, so that importing this module in the front stays torch-free.

Loop: block on the pipe while the engine is idle; otherwise drain every pending message (submits,
cancels, stats requests) without blocking, run one ``engine.step()``, and send ONE ``BATCH``
message with everything that step produced. See ``protocol`` for the messages and the transport.
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

log = logging.getLogger("qil.worker")

PARENT_CHECK_S = 1.0


def worker_main(conn: Any, config: dict[str, Any]) -> None:
    """Process entry point. ``config``: model, device, dtype, threads, engine kwargs, demo flag."""
    # The front owns signals: Ctrl-C in a terminal reaches the whole process group, and the
    # front decides when (after the grace period) the worker stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logging.basicConfig(
        level=config.get("log_level", "INFO"),
        format="%(asctime)s %(levelname)s [worker %(process)d] %(message)s",
    )
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


def _load(config: dict[str, Any]):
    import torch

    from qil_worker.engine import Engine
    from qil_worker.model import Qwen3

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
    engine = Engine(model, **config.get("engine", {}))
    _warm_up(engine, model.config.vocab_size)
    cfg = model.config
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
        "page_size": stats.page_size,
        "token_budget": stats.token_budget,
        "prefill_chunk": stats.prefill_chunk,
        "max_active": stats.max_active,
        "pid": os.getpid(),
        "stats": _stats(engine),
    }
    log.info("model %s loaded and warm in %.2fs", info["name"], time.perf_counter() - t0)
    return engine, info


def _warm_up(engine: Any, vocab_size: int) -> None:
    """One tiny request end to end, so the first real request does not pay for lazy init."""
    rid = engine.submit([i % vocab_size for i in range(4)], max_new_tokens=2, request_id="__qil_warmup__")
    while not engine.idle:
        engine.step()
    engine.release(rid)


def _stats(engine: Any) -> tuple[int, ...]:
    s = engine.stats()
    return (s.num_pages_total, s.num_pages_used, s.num_pages_free, s.num_running, s.num_waiting)


def _opt(value: float | None) -> float:
    return -1.0 if value is None else float(value)


def _serve(conn: Any, engine: Any, parent_pid: int) -> int:
    finish_codes = P.FINISH_CODES
    while True:
        if engine.idle:
            # Block (no spinning) until the front sends something; check now and then that the
            # front still exists (EOF on the pipe is the main signal, this is a backstop).
            while not conn.poll(PARENT_CHECK_S):
                if os.getppid() != parent_pid:
                    log.warning("front process %d is gone; worker exits", parent_pid)
                    return 0
        acks: list = []
        tickets: list = []
        # Drain everything pending before the step, so submits and cancels take effect at once.
        while conn.poll(0):
            msg = conn.recv()
            tag = msg[0]
            if tag == P.SUBMIT:
                _, rid, token_ids, max_new_tokens, stop_ids = msg
                try:
                    engine.submit(
                        list(token_ids),
                        max_new_tokens=max_new_tokens,
                        stop_token_ids=list(stop_ids) or None,
                        request_id=rid,
                    )
                    acks.append((rid, None))
                except Exception as exc:  # noqa: BLE001 - rejected in-band, the worker goes on
                    acks.append((rid, classify_engine_error(exc)))
            elif tag == P.CANCEL:
                engine.cancel(msg[1])
            elif tag == P.STATS:
                tickets.append(msg[1])
            elif tag == P.STOP:
                return 0
        events = []
        if not engine.idle:
            for ev in engine.step():
                final = None
                code = 0
                if ev.finished:
                    code = finish_codes.get(getattr(ev.finish_reason, "value", ev.finish_reason), 4)
                    try:
                        r = engine.result(ev.request_id)
                        e2e = r.completion_time
                        final = (
                            len(r.prompt_token_ids),
                            len(r.output_token_ids),
                            _opt(r.queue_time),
                            _opt(r.ttft),
                            _opt(r.mean_inter_token_latency),
                            _opt(r.max_inter_token_latency),
                            _opt(e2e),
                            int(r.num_preemptions),
                        )
                        engine.release(ev.request_id)
                    except Exception:  # noqa: BLE001 - metrics are best effort
                        log.debug("no result for %s: %s", ev.request_id, traceback.format_exc())
                        final = (0, ev.index + (ev.token_id is not None), -1.0, -1.0, -1.0, -1.0, -1.0, 0)
                events.append(
                    (
                        ev.request_id,
                        -1 if ev.token_id is None else int(ev.token_id),
                        ev.index,
                        code,
                        ev.error,
                        final,
                    )
                )
        if acks or events or tickets:
            conn.send((P.BATCH, acks, events, _stats(engine), tickets))
