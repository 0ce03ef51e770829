"""Running a job on every rank of a tensor-parallel group of spawned processes (gloo on the
CPU by default), and the jobs the tensor-parallel tests run there (each rank loads only its
shard of the checkpoint)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

RANK_TIMEOUT_S = 240  # a whole job on one rank, start-up included (two shared cores)
COLLECTIVE_TIMEOUT_S = 60


def run_ranks(job: Callable[..., Any], world_size: int, workdir: Path, *args: Any,
              killed: tuple[int, ...] = (), device: str = "cpu", backend: str | None = None) -> list[Any]:
    """``job(parallel, *args)`` on ``world_size`` spawned ranks → each rank's return value, in
    rank order (None for the ``killed`` ranks, which must have died of SIGKILL). A rank that
    fails, or outlives ``RANK_TIMEOUT_S``, fails the call. ``device`` and ``backend``: as
    ``join_group`` takes them (NCCL on CUDA unless ``backend`` says otherwise)."""
    ctx = multiprocessing.get_context("spawn")
    store = workdir / "tp-store"
    procs = [ctx.Process(target=_rank_main,
                         args=(job, rank, world_size, str(store), str(workdir), args, device, backend))
             for rank in range(world_size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(RANK_TIMEOUT_S)
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not alive, f"rank(s) {alive} still running after {RANK_TIMEOUT_S} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [workdir / f"rank{r}.err" for r in range(world_size) if r not in killed]
    failed = [e.read_text() for e in errors if e.exists()]
    assert not failed, "\n".join(failed)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL if r in killed else 0 for r in range(world_size)]
    return [None if r in killed else torch.load(workdir / f"rank{r}.pt", weights_only=False)
            for r in range(world_size)]


def _rank_main(job, rank: int, world_size: int, store: str, workdir: str, args: tuple, device: str,
               backend: str | None) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    from qil_worker.parallel.group import join_group, leave_group

    try:
        parallel = join_group(rank, world_size, f"file://{store}", device=device, timeout_s=COLLECTIVE_TIMEOUT_S,
                              backend=backend)
        try:
            result = job(parallel, *args)
        finally:
            leave_group()
        torch.save(result, Path(workdir) / f"rank{rank}.pt")
    except BaseException:
        (Path(workdir) / f"rank{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise


# -- jobs ----------------------------------------------------------------------------------------

SAMPLED_PROMPT = list(range(3, 13))  # 10 tokens: a partial page of 4, copied for the second sample


def forward_and_generate(parallel, checkpoint: str, prompts: list[list[int]], logit_prompt: list[int],
                         fused: bool | None = None, num_pages: int = 30, device: str = "cpu") -> dict[str, Any]:
    """Rank 0: the logits of a full prefill of ``logit_prompt`` (on the host), the greedy tokens
    of ``prompts`` on an engine whose pool of ``num_pages`` pages of 4 forces preemption (prefix
    cache on), and two seeded samples of ``SAMPLED_PROMPT`` (a fork: page copies on every rank);
    with the engine's counters. The other ranks follow it. Every rank: its weight bytes and KV
    heads. The model runs on ``device`` (float32); with ``parallel`` ``SINGLE`` this is the
    single-device run, in the calling process."""
    from qil_worker import Engine, Qwen3
    from qil_worker.engine.config import EngineConfig
    from qil_worker.engine.probe import ForwardProbe
    from qil_worker.engine.runner.follower import follow

    model = Qwen3.from_directory(checkpoint, device=device, dtype="float32", parallel=parallel,
                                 fused_projections=fused)
    config = EngineConfig(num_pages=num_pages, page_size=4, prefix_cache=True)
    out: dict[str, Any] = {"weight_bytes": model.weight_summary()[1], "kv_heads": model.heads.kv_heads}
    if parallel.rank > 0:
        out["steps"] = follow(model, config)
        return out
    probe = ForwardProbe(model, num_pages=num_pages, page_size=4)
    (logits,) = probe.forward([(probe.sequence(logit_prompt), len(logit_prompt))])
    out["logits"] = logits.cpu()
    engine = Engine(model, config)
    results = engine.generate(prompts, max_new_tokens=10)
    out["sampled"] = [r.output_token_ids for r in
                      engine.generate([SAMPLED_PROMPT], max_new_tokens=6, n=2, temperature=1.0, seed=7)[0]]
    stats = engine.stats()
    engine.close()
    out.update(tokens=[r.output_token_ids for r in results], preemptions=sum(r.num_preemptions for r in results),
               pages_used=stats.num_pages_used, prefix_hit_rate=stats.prefix_cache_hit_rate)
    return out


def kill_a_follower_mid_stream(parallel, checkpoint: str, workdir: str) -> dict[str, Any]:
    """Rank 1 follows until rank 0, a few tokens into two long requests, SIGKILLs it; rank 0
    then steps on → what its engine reported, and how long that took."""
    from qil_worker import Engine, FinishReason, Qwen3
    from qil_worker.engine.config import EngineConfig
    from qil_worker.engine.runner.follower import follow
    from qil_worker.errors import DeviceFailedError

    model = Qwen3.from_directory(checkpoint, dtype="float32", parallel=parallel)
    config = EngineConfig(num_pages=64, page_size=4)
    pid_file = Path(workdir) / "follower.pid"
    if parallel.rank > 0:
        pid_file.write_text(str(os.getpid()))
        follow(model, config)
        raise AssertionError("the follower outlived its SIGKILL")
    engine = Engine(model, config)
    ids = [engine.submit([5, 6, 7], max_new_tokens=200), engine.submit([9, 8], max_new_tokens=200)]
    tokens = 0
    while tokens < 6:  # a stream under way (the follower wrote its pid before the first step)
        tokens += sum(e.token_id is not None for e in engine.step())
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    start = time.monotonic()
    finals = {}
    refused = None
    for _ in range(1000):
        try:
            events = engine.step()
        except DeviceFailedError as exc:
            refused = str(exc)
            break
        finals.update({e.request_id: (e.finish_reason, e.error) for e in events if e.finished})
    elapsed = time.monotonic() - start
    engine.close()
    return {"finals": [finals.get(i) for i in ids], "refused": refused, "elapsed": elapsed,
            "failure": engine.device_failure, "error_reason": FinishReason.ERROR, "tokens": tokens}


def pooled_and_generate(parallel, checkpoint: str, embed_prompts: list[list[int]], score_prompts: list[list[int]],
                        gen_prompts: list[list[int]], yes_no: tuple[int, int], embedding: bool = False
                        ) -> dict[str, Any]:
    """Rank 0: embeddings alone (steps whose only finishing chunks are pooled: no logit row),
    scores alone, the tokens of a prompt of three chunks alone, then one batch mixing
    generation, embeddings and scores submitted together (their prompts in the same steps) →
    the answers, the tokens and the pool's use after each part; with ``embedding`` a headless
    checkpoint loads as an embedding model (embeddings only). The other ranks follow it → how
    many steps they ran."""
    from qil_worker import Engine, Qwen3
    from qil_worker.engine.config import EngineConfig
    from qil_worker.engine.runner.follower import follow
    from qil_worker.engine.spec import Pooling, RequestSpec

    model = Qwen3.from_directory(checkpoint, dtype="float32", parallel=parallel, embedding=embedding)
    config = EngineConfig(num_pages=64, page_size=4, token_budget=64, prefill_chunk=16, max_active=16)
    if parallel.rank > 0:
        return {"steps": follow(model, config)}
    engine = Engine(model, config)
    yes, no = yes_no
    out: dict[str, Any] = {"embeddings": engine.embed(embed_prompts)}
    out["pages_after_embed"] = engine.stats().num_pages_used
    if embedding:
        engine.close()
        return out
    out["scores"] = engine.score(score_prompts, yes_token_id=yes, no_token_id=no)
    out["pages_after_score"] = engine.stats().num_pages_used
    # a long prompt alone: its first chunks end no prompt, so those steps have no logit row either
    long_prompt = [t for p in gen_prompts + embed_prompts for t in p][: 3 * config.prefill_chunk]
    out["long_tokens"] = engine.generate([long_prompt], max_new_tokens=4)[0].output_token_ids
    gen_ids = [engine.submit(p, max_new_tokens=6) for p in gen_prompts]
    emb_ids = [engine.submit(RequestSpec.pooled(Pooling("embed", dimensions=16), p)) for p in embed_prompts]
    score_ids = [engine.submit(RequestSpec.pooled(Pooling("score", yes_token_id=yes, no_token_id=no), p))
                 for p in score_prompts]
    first = engine.step()  # every prompt's first chunk in one step (the budget holds them all)
    out["first_step_requests"] = sorted({e.request_id for e in first})
    out["mixed_ids"] = {"generate": gen_ids, "embed": emb_ids, "score": score_ids}
    while not engine.idle:
        engine.step()
    out["mixed_tokens"] = [engine.result(i).output_token_ids for i in gen_ids]
    out["mixed_embeddings"] = [engine.result(i).embedding for i in emb_ids]
    out["mixed_scores"] = [engine.result(i).score for i in score_ids]
    stats = engine.stats()
    out.update(pages_used=stats.num_pages_used, pages_free=stats.num_pages_free, pages_total=stats.num_pages_total,
               running=stats.num_running, waiting=stats.num_waiting)
    engine.close()
    return out


def collectives(parallel, device: str) -> dict[str, Any]:
    """Every rank: the group's backend and device, then ``ParallelState``'s two collectives on
    ``device`` called directly (the model calls them only when sharded): the all-reduce of a
    [4, 3] tensor of rank + 1 (in place), the column gather of a [3, 2] tensor of 0..5 + 100 *
    rank and of its first 0 rows → the results on the host. A gather the backend refuses for
    such tensors → its error under ``gather_refused`` (and nothing after it)."""
    import torch.distributed as dist

    x = torch.full((4, 3), float(parallel.rank + 1), device=device)
    out: dict[str, Any] = {"backend": dist.get_backend(), "device": str(x.device)}
    if x.device.type == "cuda":
        out["current_device"] = torch.cuda.current_device()
    reduced = parallel.all_reduce(x)
    out.update(reduced=reduced.cpu(), in_place=reduced is x)
    columns = torch.arange(6, dtype=torch.float32, device=device).view(3, 2) + 100 * parallel.rank
    try:
        gathered = parallel.all_gather_columns(columns)
    except RuntimeError as exc:
        out["gather_refused"] = str(exc)
        return out
    empty = parallel.all_gather_columns(columns[:0])
    out.update(gathered=gathered.cpu(), gathered_device=str(gathered.device), empty_shape=tuple(empty.shape),
               empty_device=str(empty.device))
    return out
