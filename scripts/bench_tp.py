#!/usr/bin/env python
"""Tensor parallelism on CPU (gloo): TP 1 against TP N on one random dense Qwen3, the machine's
cores split between the ranks (TP 1 gets them all).

Rank 0 runs the engine (greedy, --batch requests of --prompt tokens, --new tokens each); the
other ranks follow. Reported per TP size: output tokens/s of the whole batch, each rank's
weight bytes and peak RSS, and rank 0's time inside the forward's all-reduces per step (which
includes waiting for the slowest rank: on shared cores that is mostly skew, not transfer).
The model directory (--model-dir) is written once with random weights and reused. ``--quick``:
a tiny shape, a smoke test of a few seconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPE = dict(vocab_size=16384, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
             num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
             tie_word_embeddings=True)
QUICK = dict(SHAPE, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=1024)


def rank_main(rank: int, world: int, store: str, model_dir: str, args: dict, out: str) -> None:
    import torch

    torch.set_num_threads(args["threads"])
    from qil_worker import Engine, Qwen3
    from qil_worker.engine.config import EngineConfig
    from qil_worker.engine.runner.follower import follow
    from qil_worker.parallel import SINGLE
    from qil_worker.parallel.group import join_group, leave_group

    parallel = join_group(rank, world, f"file://{store}") if world > 1 else SINGLE
    model = Qwen3.from_directory(model_dir, dtype="float32", parallel=parallel)
    reduce_s = [0.0]
    if parallel.sharded:  # time every all-reduce of the forward (a bench's wrapper, not the model's)
        def timed(x, _reduce=parallel.all_reduce):
            t = time.perf_counter()
            _reduce(x)
            reduce_s[0] += time.perf_counter() - t
            return x
        for layer in model.layers:
            layer.reduce = timed
    config = EngineConfig(num_pages=512, page_size=16, token_budget=1024, prefill_chunk=512,
                          max_active=args["batch"], prefix_cache=False)
    result = {"rank": rank, "weight_bytes": model.weight_summary()[1]}
    if rank > 0:
        result["steps"] = follow(model, config)
    else:
        engine = Engine(model, config)
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(args["prompt"])] for i in range(args["batch"])]
        engine.generate(prompts[:1], max_new_tokens=2)  # warm
        reduce_s[0] = 0.0
        start = time.perf_counter()
        steps = 0
        for p in prompts:
            engine.submit(p, max_new_tokens=args["new"], ignore_eos=True)
        while not engine.idle:
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - start
        engine.close()
        result.update(tokens_per_s=args["batch"] * args["new"] / elapsed, steps=steps,
                      all_reduce_ms_per_step=1e3 * reduce_s[0] / steps)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if world > 1:
        leave_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def run(world: int, model_dir: str, args: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, world, f"{tmp}/store", model_dir, args, tmp))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"TP {world}: a rank failed ({[p.exitcode for p in procs]})")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores / TP)")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    from qil_worker.model.demo import write_random_checkpoint

    shape = QUICK if a.quick else SHAPE
    model_dir = a.model_dir or os.path.join(tempfile.gettempdir(), "qil-bench-tp" + ("-quick" if a.quick else ""))
    if not Path(model_dir, "config.json").exists():
        write_random_checkpoint(Path(model_dir), shape)
    cores = os.cpu_count() or 1
    print(f"model {json.dumps(shape)}; {cores} cores; batch {a.batch} x ({a.prompt} prompt + {a.new} new)")
    for world in a.tp:
        threads = a.threads or max(1, cores // world)
        ranks = run(world, model_dir, dict(batch=a.batch, prompt=a.prompt, new=a.new, threads=threads))
        lead = ranks[0]
        per_rank = ", ".join(f"rank {r['rank']}: {r['weight_bytes'] / 2**20:.0f} MiB weights, "
                             f"{r['peak_rss_mb']:.0f} MiB peak RSS" for r in ranks)
        print(f"TP {world} ({threads} thread(s) per rank): {lead['tokens_per_s']:.1f} tok/s over {lead['steps']} steps, "
              f"all-reduce {lead['all_reduce_ms_per_step']:.2f} ms/step; {per_rank}")


if __name__ == "__main__":
    main()
