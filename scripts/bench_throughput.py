#!/usr/bin/env python
"""The workload people compare engines on, qil beside transformers in one run.

N requests, prompt and output lengths drawn uniformly from ranges with a fixed seed, EOS
ignored, all submitted at once. Reported per system: output tokens/s, total (prompt + output)
tokens/s, mean and p99 TTFT, mean and p99 inter-token latency, and for qil the peak KV pages.

Systems:
  qil             the in-process Engine (prefix cache on, as served).
  hf-static       transformers ``generate`` over static batches of --hf-batch requests in
                  arrival order, left-padded, each batch running to its longest output (only the
                  requested tokens count as output).
  hf-continuous   transformers' continuous batching manager (paged attention), each request
                  with its own max_new_tokens, where the installed version has it.
Variant ``--prefix-heavy``: every prompt starts with the same 512-token system prefix; qil is
run with and without its prefix cache and the TTFT ratio is printed, for a cold cache (the burst
is the engine's first traffic: ``qil``) and a warm one (``qil-warm``: the engine served the
prefix alone, one token, before the clock started, as a server has served its system prompt
before; serving benchmarks such as vLLM's send one request of the workload before measuring).

Timing: TTFT = first token on the host − submission (for static batches, submission is the
start of the run); ITL = gaps between a request's consecutive tokens.

``--request-rate R`` (qil systems): requests arrive as a seeded Poisson process of R/s instead of
all at once, and TTFT counts from each request's own arrival, so it shows what the prefix cache
saves a request rather than how long it queued behind the others. ``--schedule-policy`` sets
qil's admission order (``fcfs``, as served by default, or ``shortest-first``). ``--no-overlap``:
qil reads each step's tokens before scheduling the next (overlapped scheduling is on by default
on CUDA); every qil row says ``overlap`` on or off and how many steps were launched before the
previous one was read (``overlapped_steps``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import DTYPES, FULL_SHAPE, QUICK_SHAPE, ensure_model, load_hf  # noqa: E402
from qil_worker.attention.names import ATTENTION_CHOICES  # noqa: E402
from random_models import SHAPES, random_model  # noqa: E402
from qil_worker.engine.schedule_policy import SCHEDULE_POLICIES  # noqa: E402


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
             seed: int, prefix_len: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(prefix_len)]
    return [
        (prefix + [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else float("nan")


def summarize(name: str, wall: float, reqs, ttft: list[float], gaps: list[float], **extra) -> dict:
    out_tokens = sum(n for _, n in reqs)
    in_tokens = sum(len(p) for p, _ in reqs)
    return {
        "system": name,
        "wall_s": wall,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + in_tokens) / wall,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p99_s": p99(ttft),
        "itl_mean_ms": 1000 * statistics.fmean(gaps) if gaps else float("nan"),
        "itl_p99_ms": 1000 * p99(gaps),
        **extra,
    }


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: all at 0 for an infinite rate,
    else a Poisson process of ``rate`` requests/s (seeded)."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def run_qil(model, reqs, args, prefix_cache: bool = True, name: str = "qil", cuda_graphs: bool | None = None,
            served_before: list[int] | None = None) -> dict:
    """One measured run on a fresh engine; ``served_before``: a prompt the engine serves (one
    token) before the clock starts, as a server has served its system prompt before a burst."""
    from qil_worker import Engine

    no_overlap = getattr(args, "no_overlap", False)
    step_graphs = getattr(args, "step_graphs", None)
    engine = Engine(model, num_pages=args.num_pages, page_size=args.page_size,
                    token_budget=args.token_budget, prefill_chunk=args.prefill_chunk,
                    max_active=args.max_active, prefix_cache=prefix_cache, cuda_graphs=cuda_graphs,
                    schedule_policy=args.schedule_policy, attention=args.attention,
                    retained_results=len(reqs) + 1,  # every result is read after the run
                    **({"overlap": False} if no_overlap else {}),
                    step_graphs=step_graphs)
    if served_before is not None:
        engine.generate([served_before], max_new_tokens=1)
    sampling = dict(temperature=args.temperature, seed=args.seed) if args.temperature else {}
    arrivals = arrival_times(len(reqs), args.request_rate, args.seed)
    t0 = time.perf_counter()
    ids: list[str] = []
    submitted_at: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    peak = 0
    while len(ids) < len(reqs) or not engine.idle:
        now = time.perf_counter()
        while len(ids) < len(reqs) and t0 + arrivals[len(ids)] <= now:
            prompt, n = reqs[len(ids)]
            rid = engine.submit(prompt, max_new_tokens=n, ignore_eos=True, **sampling)
            ids.append(rid)
            submitted_at[rid], times[rid] = t0 + arrivals[len(ids) - 1], []
        if engine.idle:  # nothing to compute until the next arrival
            time.sleep(max(0.0, t0 + arrivals[len(ids)] - time.perf_counter()))
            continue
        events = engine.step()
        now = time.perf_counter()
        peak = max(peak, engine.stats().num_pages_used)
        for e in events:
            if e.error:
                raise RuntimeError(e.error)
            if e.token_id is not None:
                times[e.request_id].append(now)
    wall = time.perf_counter() - t0
    ttft = [times[i][0] - submitted_at[i] for i in ids]
    gaps = [b - a for i in ids for a, b in zip(times[i], times[i][1:])]
    hit = sum(engine.result(i).num_cached_tokens for i in ids) / sum(len(p) for p, _ in reqs)
    graphs = engine.runner.decode_graphs
    extra = {} if graphs is None else {
        "graph_decode_steps": graphs.steps, "graphs": engine.runner.graph_capture.count,
        "graph_capture_s": round(engine.runner.graph_capture.seconds, 2),
    }
    if engine.runner.step_graphs is not None:  # steps with prefill chunks, padded
        extra["graph_mixed_steps"] = engine.runner.step_graphs.steps
        extra["eager_steps"] = engine.runner.step_graphs.misses  # fit no graph bucket (or scored prompts)
    if hasattr(engine, "overlap"):
        extra.update(overlap="on" if engine.overlap else "off", overlapped_steps=engine.overlapped_steps)
    engine.close()
    return summarize(name, wall, reqs, ttft, gaps, peak_kv_pages=peak, prefix_hit_rate=round(hit, 3),
                     attention=engine.attention_backend, **extra)


class _BatchTimes:
    """Streamer-compatible recorder: the time of every decoding step of a static batch."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if self._seen_prompt:
            self.times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def run_hf_static(hf, reqs, args) -> dict:
    t0 = time.perf_counter()
    ttft: list[float] = []
    gaps: list[float] = []
    for start in range(0, len(reqs), args.hf_batch):
        batch = reqs[start : start + args.hf_batch]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        longest = max(n for _, n in batch)
        rec = _BatchTimes()
        with torch.inference_mode():
            hf.generate(input_ids=ids.to(hf.device), attention_mask=mask.to(hf.device), do_sample=False,
                        temperature=None, top_p=None, top_k=None, max_new_tokens=longest,
                        min_new_tokens=longest, pad_token_id=0, streamer=rec)
        for _, n in batch:
            ttft.append(rec.times[0] - t0)
            gaps.extend(b - a for a, b in zip(rec.times[: n - 1], rec.times[1:n]))
    return summarize("hf-static", time.perf_counter() - t0, reqs, ttft, gaps)


def run_hf_continuous(hf, reqs, args) -> dict | None:
    if not hasattr(hf, "continuous_batching_context_manager"):
        return None
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs), eos_token_id=None,
                              pad_token_id=0)
    results = {}
    with hf.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        t0 = time.perf_counter()  # after the manager's own start-up and warm-up
        for i, (p, n) in enumerate(reqs):
            manager.add_request(input_ids=p, request_id=f"r{i}", max_new_tokens=n, record_timestamps=True)
        while len(results) < len(reqs):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
            elif out is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
        wall = time.perf_counter() - t0
    ttft, gaps = [], []
    for out in results.values():
        if out.error:
            raise RuntimeError(out.error)
        ts = out.timestamps or []
        if ts:
            ttft.append(ts[0] - t0)
            gaps.extend(b - a for a, b in zip(ts, ts[1:]))
    return summarize("hf-continuous", wall, reqs, ttft, gaps)


def add_row(rows: list[dict], row: dict) -> None:
    """Keep a result and print it at once, so a run cut short still reports what it finished."""
    rows.append(row)
    print(f"[{row['system']}] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in row.items() if k != "system"), flush=True)


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    head = f"{'system':<16}{'out tok/s':>10}{'total tok/s':>12}{'TTFT mean':>11}{'TTFT p99':>10}{'ITL mean':>10}{'ITL p99':>9}{'qil/this':>10}"
    print(head)
    print("-" * len(head))
    qil = next((r for r in rows if r["system"] == "qil"), rows[0])
    for r in rows:
        ratio = qil["output_tok_s"] / r["output_tok_s"]
        print(f"{r['system']:<16}{r['output_tok_s']:>10.1f}{r['total_tok_s']:>12.1f}{r['ttft_mean_s']:>10.2f}s"
              f"{r['ttft_p99_s']:>9.2f}s{r['itl_mean_ms']:>8.0f}ms{r['itl_p99_ms']:>7.0f}ms{ratio:>9.2f}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--random-shape", choices=sorted(SHAPES), default=None,
                   help="instead of a checkpoint, a random model of this shape built in memory "
                   "(qwen3-30b-a3b: Qwen3-MoE's; qil only)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", nargs="+", default=None, choices=sorted(DTYPES),
                   help="default: float32 bfloat16 on CPU, bfloat16 on CUDA")
    p.add_argument("--requests", type=int, default=None, help="default 16 (CPU) / 256 (CUDA)")
    p.add_argument("--prompt-range", type=int, nargs=2, default=None, help="default 32 256 / 100 1024")
    p.add_argument("--output-range", type=int, nargs=2, default=None, help="default 32 128 / 100 1024")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; else seeded sampling (qil)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-heavy", action="store_true", help="all prompts share a 512-token prefix")
    p.add_argument("--rounds", type=int, default=1,
                   help="--prefix-heavy: run qil with a cold, no and a warm cache this many times, "
                        "interleaved, and print each round's TTFT ratios and their median (runs on a "
                        "shared machine vary; the table shows the first round)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s, Poisson arrivals (seeded); default inf = all at once. qil systems only: "
                        "TTFT then counts from each request's own arrival")
    p.add_argument("--systems", nargs="+", default=["qil", "hf-static", "hf-continuous"],
                   help="any of qil, qil-eager (CUDA: no decode graphs), hf-static, hf-continuous")
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--max-active", type=int, default=256)
    p.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES, default="fcfs",
                   help="qil's admission order (both qil runs of --prefix-heavy use it)")
    p.add_argument("--attention", choices=ATTENTION_CHOICES, default="auto", help="qil's attention backend")
    p.add_argument("--no-overlap", action="store_true",
                   help="qil steps synchronously: each step's tokens are read before the next is scheduled")
    p.add_argument("--step-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="qil replays steps with prefill chunks from CUDA graphs too (default: the engine's, off)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny model and lengths (smoke test)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    cuda = args.device.startswith("cuda")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.prefix_heavy and "qil" not in args.systems:
        p.error("--prefix-heavy compares qil runs: include qil in --systems")
    if args.random_shape and {"hf-static", "hf-continuous"} & set(args.systems):
        p.error("--random-shape builds no checkpoint for transformers (use --systems qil)")
    if args.request_rate != float("inf") and {"hf-static", "hf-continuous"} & set(args.systems):
        p.error("--request-rate applies to the qil systems only (use --systems qil)")
    from qil_worker import cpu_memory

    cpu_memory.configure_process(args.device)
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.random_shape] if args.random_shape else QUICK_SHAPE if args.quick else FULL_SHAPE
    args.requests = args.requests or (4 if args.quick else 256 if cuda else 16)
    args.prompt_range = args.prompt_range or ([8, 40] if args.quick else [100, 1024] if cuda else [32, 256])
    args.output_range = args.output_range or ([4, 12] if args.quick else [100, 1024] if cuda else [32, 128])
    dtypes = args.dtype or (["bfloat16"] if cuda else ["float32", "bfloat16"])
    default_dir = Path.home() / ".cache" / "qil" / ("bench-quick" if args.quick else "bench-qwen3-0.6b-shape")
    model_dir = None if args.random_shape else ensure_model(args.model_dir or default_dir, shape)
    prefix = (64 if args.quick else 512) if args.prefix_heavy else 0  # --quick: the tiny model has 512 positions
    reqs = workload(args.requests, tuple(args.prompt_range), tuple(args.output_range), shape["vocab_size"],
                    args.seed, prefix)
    longest = max(len(p) + n for p, n in reqs)
    if args.num_pages is None:  # room for every request at once, as transformers' paths have
        args.num_pages = sum(-(-(len(p) + n) // args.page_size) for p, n in reqs) + 8
    print(f"workload: {len(reqs)} requests, prompts {args.prompt_range} (+{prefix} shared), outputs "
          f"{args.output_range}, {sum(len(p) for p, _ in reqs)} prompt / {sum(n for _, n in reqs)} output tokens, "
          f"arrivals {'all at once' if args.request_rate == float('inf') else f'{args.request_rate:g}/s'}, "
          f"longest {longest}; device {args.device}, {args.threads} threads")

    from qil_worker import Qwen3

    all_rows = {}
    prefix_ratios: dict[str, list[dict]] = {}  # --prefix-heavy: TTFT ratios of every round
    for dtype_name in dtypes:
        rows = []
        if model_dir is None:
            model = random_model(shape, args.device, DTYPES[dtype_name])
        else:
            model = Qwen3.from_directory(model_dir, device=args.device, dtype=dtype_name)
        if "qil" in args.systems:
            run_qil(model, reqs[:2], args)  # warm-up
            add_row(rows, run_qil(model, reqs, args))
        if "qil-eager" in args.systems and cuda:
            add_row(rows, run_qil(model, reqs, args, cuda_graphs=False, name="qil-eager"))
        ratios: list[tuple[float, float]] = []  # --prefix-heavy: (cold, warm) TTFT ratio per round
        for round_ in range(args.rounds if args.prefix_heavy else 0):
            cold = rows[0] if round_ == 0 else run_qil(model, reqs, args)
            uncached = run_qil(model, reqs, args, prefix_cache=False, name="qil-no-cache")
            # the shared prefix plus one token of its own: every prefix page is full, so cached
            warm = run_qil(model, reqs, args, name="qil-warm", served_before=reqs[0][0][:prefix + 1])
            if round_ == 0:
                add_row(rows, uncached)
                add_row(rows, warm)
            ratios.append((uncached["ttft_mean_s"] / cold["ttft_mean_s"], uncached["ttft_mean_s"] / warm["ttft_mean_s"]))
        del model
        hf = None
        if "hf-static" in args.systems or "hf-continuous" in args.systems:
            hf = load_hf(model_dir, DTYPES[dtype_name]).to(args.device)
        if "hf-static" in args.systems:
            add_row(rows, run_hf_static(hf, reqs, args))
        if "hf-continuous" in args.systems:
            try:
                row = run_hf_continuous(hf, reqs, args)
            except Exception as exc:  # noqa: BLE001 - report, keep the other rows
                print(f"hf-continuous failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                row = None
            if row:
                add_row(rows, row)
        del hf
        print_table(rows, f"{dtype_name} on {args.device}" + (" — prefix-heavy" if prefix else ""))
        if args.prefix_heavy:
            by = {r["system"]: r for r in rows}
            print(f"prefix cache: TTFT mean {ratios[0][0]:.2f}x lower with the cache "
                  f"(hit rate {by['qil']['prefix_hit_rate']:.0%}); {ratios[0][1]:.2f}x "
                  f"when the engine had served the prefix before (qil-warm, hit rate "
                  f"{by['qil-warm']['prefix_hit_rate']:.0%})")
            if len(ratios) > 1:
                for i, (cold_ratio, warm_ratio) in enumerate(ratios, 1):
                    print(f"  round {i}: cold {cold_ratio:.2f}x, warm {warm_ratio:.2f}x")
                print(f"prefix cache over {len(ratios)} rounds: median TTFT ratio cold "
                      f"{statistics.median(r[0] for r in ratios):.2f}x, warm {statistics.median(r[1] for r in ratios):.2f}x")
            prefix_ratios[dtype_name] = [{"cold": c, "warm": w} for c, w in ratios]
        all_rows[dtype_name] = rows
    if args.json:
        report = {"args": {k: str(v) for k, v in vars(args).items()}, "results": all_rows}
        if prefix_ratios:
            report["prefix_ttft_ratios"] = prefix_ratios
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
