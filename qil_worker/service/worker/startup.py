"""The worker's start-up: the model, its tokenizer and the KV pool that ``WorkerConfig`` names,
loaded into one engine, warmed, and described for the front (``WorkerInfo``) and the log.
Torch is imported inside ``load``: the front imports the worker's modules only to name its
spawn target."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from qil_worker.service import protocol as P
from qil_worker.service.heap import freeze_startup_heap
from qil_worker.service.worker.pool_agreement import agreed_pool

log = logging.getLogger("qil.worker")

# TEST-ONLY fault injection, off by default and settable only through the worker's environment
# (never from the network): "N" or "N:K" makes model forward calls N..N+K-1 (1-based, counted
# after the warm-up; K defaults to 1) raise RuntimeError, to test that a failing step ends its
# requests with an in-band error and the server keeps serving; "N:K:device" raises what a
# sticky CUDA error raises instead, to test that the worker is replaced.
FAULT_FORWARD_ENV = "QIL_TEST_FAULT_FORWARD"


def load(config: P.WorkerConfig) -> tuple[Any, P.WorkerInfo]:
    """The engine ``config`` names (its model, tokenizer and KV pool), warm, and what the worker
    tells the front of it (``WorkerInfo``, also the start-up log line)."""
    import torch

    from qil_worker.cpu_memory import configure_process
    from qil_worker.engine import Engine
    from qil_worker.model import Qwen3
    from qil_worker.parallel.group import gather_ints
    from qil_worker.text.tokenizer import EncodingTraits, encoding_traits, tokenizer_summary

    configure_process(config.device)  # before the model: the first oneDNN call fixes them
    if config.threads:
        torch.set_num_threads(config.threads)
    model_dir = config.model
    demo = not model_dir
    if demo:
        from qil_worker.model.demo import ensure_demo_model

        model_dir = str(ensure_demo_model())
        log.info("serving the embedded DEMO model (random weights) from %s", model_dir)
    t0 = time.perf_counter()
    task = resolve_task(config.task, model_dir)
    embedding = task == "embed"
    parallel = _tensor_parallel(config, model_dir, embedding)
    model = Qwen3.from_directory(
        model_dir, device=config.device, dtype=config.dtype, quantize=config.quantize, parallel=parallel,
        embedding=embedding, compile=config.compile,
    )
    weight_format, weight_bytes = model.weight_summary()
    rank_bytes = gather_ints(parallel, weight_bytes)  # the followers send theirs after loading
    cfg = model.config
    tokenizer, tokenizer_dir = _load_tokenizer(config, model_dir, cfg.vocab_size)
    pool = agreed_pool(model, config, parallel)
    # retained_results=0: results reach the front in the final events, none is read back
    engine_config = dataclasses.replace(config.engine, num_pages=pool.num_pages, retained_results=0)
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
    count = cfg.parameter_count()
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
        weight_bytes=sum(rank_bytes),
        tensor_parallel_size=parallel.world_size,
        nnodes=config.nnodes,
        rank_weight_bytes=max(rank_bytes),
        tokenizer_summary={} if tokenizer is None else tokenizer_summary(tokenizer, cfg.max_position_embeddings),
        architecture=cfg.architecture,
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        num_parameters=count.total,
        num_active_parameters=count.active,
        task=task,
        task_explicit=config.task != "auto",
    )
    log.info(
        "model %s (task %s) loaded and warm in %.2fs: %s; dtype %s, device %s, weights %s (%s); "
        "tensor parallel: %d rank(s) on %d node(s), at most %s of weights per rank; %d KV pages (%s); memory: %s; "
        "tokenizer: %s; prefix cache: %s; schedule: %s; attention: %s; decode CUDA graphs: %s; "
        "overlapped scheduling: %s; structured output: %s; %d start-up objects frozen for the GC",
        info.name, info.task, time.perf_counter() - t0, cfg.describe(), info.dtype, info.device, info.weight_format,
        _mib(info.weight_bytes), info.tensor_parallel_size, info.nnodes, _mib(info.rank_weight_bytes), pool.num_pages,
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
        from qil_worker.cpu_memory import resident_bytes

        rss = resident_bytes()
        if rss:
            parts.append(f"process RSS {_mib(rss)}")
    return ", ".join(parts)


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


def _tensor_parallel(config: P.WorkerConfig, model_dir: str, embedding: bool) -> Any:
    """This worker's place as rank 0 of ``tensor_parallel_size`` ranks (the others spawned and
    joined here, loading the model as rank 0 does: ``embedding``); the single-device state at 1."""
    from qil_worker.parallel import SINGLE
    from qil_worker.parallel.group import join_group
    from qil_worker.service.worker.ranks import init_method_of, node_ranks, start_followers

    size = config.tensor_parallel_size
    if size == 1:
        return SINGLE
    init_method = init_method_of(config)
    start_followers(config, model_dir, size, init_method, embedding, ranks=node_ranks(config)[1:])
    log.info("tensor parallel: %d ranks on %d node(s) (%s), meeting at %s", size, config.nnodes,
             "NCCL" if config.device.startswith("cuda") else "gloo", init_method)
    return join_group(0, size, init_method, device=config.device)


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


def resolve_task(requested: str, model_dir: str) -> str:
    """The server's task (``qil_worker.task.resolve``) from the checkpoint's embedding marks."""
    from qil_worker.model.embedding_checkpoint import detect
    from qil_worker.task import resolve

    found = detect(model_dir)
    return resolve(requested, found is not None, found is not None and found.headless)
