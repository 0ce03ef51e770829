#!/usr/bin/env python
"""Throughput and latency of the gRPC service against the in-process Engine, same workload.

    python scripts/bench_service.py            # Qwen3-0.6B-shaped random model (slow on CPU)
    python scripts/bench_service.py --quick    # tiny model: a smoke run in seconds

Workload: ``--requests`` prompts of ``--prompt-len`` random ids, ``--max-new-tokens`` each (EOS
disabled, so every request produces exactly that many), ``--concurrency`` requests in flight
(closed loop). The in-process Engine (in this process) and a ``python -m qil_worker serve``
subprocess with the same engine settings, driven by ``--concurrency`` gRPC streams, run it in
alternation after a warm-up round each. Prints the best tokens/s of each over ``--repeat``
rounds, their ratio (target: >= 0.95), and p50/p99 TTFT and inter-token latency as the gRPC
client sees them (coalesced tokens count as arriving together: an ITL of 0).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

QWEN3_06B = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=40960,
)
QUICK = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=256, vocab_size=1024, tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def make_model(shape: dict, seed: int = 0) -> Path:
    """A random Qwen3 checkpoint of ``shape`` (written with torch + safetensors, no transformers),
    cached under $QIL_CACHE_DIR (or ~/.cache/qil)."""
    from qil_worker.service.demo_model import cache_root

    key = hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    path = cache_root() / f"bench-{key}"
    if (path / "config.json").exists():
        return path
    from qil_worker.service.demo_model import write_random_checkpoint

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write_random_checkpoint(tmp, {**shape, "eos_token_id": None}, seed=seed)
    os.replace(tmp, path)
    return path


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]


def engine_kwargs(args) -> dict:
    return dict(num_pages=args.num_pages, page_size=args.page_size, token_budget=args.token_budget,
                prefill_chunk=args.prefill_chunk, max_active=args.max_active)


def load_engine(args, model_dir: Path):
    import torch

    from qil_worker import cpu_memory
    from qil_worker.engine import Engine
    from qil_worker.model import Qwen3

    cpu_memory.configure_process(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = Qwen3.from_directory(model_dir, device=args.device, dtype=args.dtype)
    return Engine(model, **engine_kwargs(args))


def _closed_loop(engine, args, prompts: list[list[int]]) -> dict:
    pending = list(prompts)
    live = 0
    tokens = 0
    ttft: list[float] = []
    t0 = time.perf_counter()
    while pending or live:
        while pending and live < args.concurrency:
            engine.submit(pending.pop(0), max_new_tokens=args.max_new_tokens)
            live += 1
        for ev in engine.step():
            if ev.token_id is not None:
                tokens += 1
            if ev.finished:
                r = engine.result(ev.request_id)
                if r.ttft is not None:
                    ttft.append(r.ttft)
                engine.release(ev.request_id)
                live -= 1
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99)}


def start_server(args, model_dir: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "qil_worker", "serve", "--model", str(model_dir), "--port", "0",
           "--device", args.device, "--num-pages", str(args.num_pages), "--page-size", str(args.page_size),
           "--token-budget", str(args.token_budget), "--prefill-chunk", str(args.prefill_chunk),
           "--max-active", str(args.max_active), "--log-level", "WARNING"]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    while True:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("server exited before serving")
        if line.startswith("qil serving on "):
            return proc, line.split()[3]


async def run_grpc(args, target: str, prompts: list[list[int]]) -> dict:
    from qil_client import AsyncClient

    async with AsyncClient(target, timeout=3600) as client:
        return await _grpc_closed_loop(args, client, prompts)


async def _grpc_closed_loop(args, client, prompts: list[list[int]]) -> dict:
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    queue = list(prompts)
    if True:

        async def one_stream():
            nonlocal tokens
            while queue:
                prompt = queue.pop(0)
                start = time.perf_counter()
                last = None
                async for ev in client.stream(prompt, max_new_tokens=args.max_new_tokens):
                    now = time.perf_counter()
                    n = len(ev.token_ids)
                    if not n:
                        continue
                    tokens += n
                    if last is None:
                        ttft.append(now - start)
                        n -= 1
                    else:
                        itl.append(now - last)
                        n -= 1
                    itl.extend([0.0] * n)  # tokens that arrived together (coalesced)
                    last = now

        t0 = time.perf_counter()
        await asyncio.gather(*(one_stream() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model and workload (smoke run)")
    p.add_argument("--model", default=None, help="use this checkpoint instead of a random one")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers of the random model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--num-pages", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--max-active", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-rounds", type=int, default=1, help="unmeasured runs of the workload first")
    p.add_argument("--repeat", type=int, default=3, help="measured rounds of each side (best is reported)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.requests = args.requests or (16 if args.quick else 32)
    args.prompt_len = args.prompt_len or (16 if args.quick else 128)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)

    shape = dict(QUICK if args.quick else QWEN3_06B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    model_dir = Path(args.model) if args.model else make_model(shape)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = workload(args, vocab)

    # Both sides stay loaded and alternate (local, gRPC, local, gRPC, ...): on a shared or noisy
    # machine, the best of each over --repeat rounds compares like with like. The idle side
    # blocks (the worker waits on its pipe), so it takes no CPU from the other.
    engine = load_engine(args, model_dir)
    proc, target = start_server(args, model_dir)
    locals_, remotes = [], []
    try:
        for _ in range(args.warmup_rounds):  # unmeasured: CPU kernels are picked per shape
            _closed_loop(engine, args, prompts)
            asyncio.run(run_grpc(args, target, prompts))
        for _ in range(args.repeat):
            locals_.append(_closed_loop(engine, args, prompts))
            remotes.append(asyncio.run(run_grpc(args, target, prompts)))
    finally:
        proc.terminate()
        proc.wait(60)
        engine.close()
    local = max(locals_, key=lambda r: r["tokens_per_s"])
    remote = max(remotes, key=lambda r: r["tokens_per_s"])
    report = {
        "model": str(model_dir), "shape": shape if not args.model else None,
        "workload": dict(requests=args.requests, prompt_len=args.prompt_len,
                         max_new_tokens=args.max_new_tokens, concurrency=args.concurrency),
        "in_process": local, "grpc": remote, "repeat": args.repeat,
        "all_tokens_per_s": {"in_process": [r["tokens_per_s"] for r in locals_],
                             "grpc": [r["tokens_per_s"] for r in remotes]},
        "ratio": remote["tokens_per_s"] / local["tokens_per_s"],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        ms = 1e3
        print(f"model {model_dir} ({args.requests} requests x {args.max_new_tokens} tokens, "
              f"prompt {args.prompt_len}, {args.concurrency} concurrent)")
        print(f"in-process : {local['tokens_per_s']:9.1f} tok/s  ({local['tokens']} tokens in {local['wall_s']:.2f}s)")
        print(f"gRPC       : {remote['tokens_per_s']:9.1f} tok/s  ({remote['tokens']} tokens in {remote['wall_s']:.2f}s)")
        print(f"ratio      : {report['ratio']:.3f}  (target >= 0.95; best of {args.repeat} rounds each)")
        print(f"gRPC TTFT  : p50 {remote['ttft_p50_s'] * ms:.1f} ms  p99 {remote['ttft_p99_s'] * ms:.1f} ms")
        print(f"gRPC ITL   : p50 {remote['itl_p50_s'] * ms:.2f} ms  p99 {remote['itl_p99_s'] * ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
