#!/usr/bin/env python
"""Time of one decode step at several batch sizes, the fast path against its reference.

CUDA: steps replayed from CUDA graphs against eager. CPU: weights packed for oneDNN (as
``Qwen3.from_directory`` loads them) against the plain parameters (``pack_weights=False``).
``--quantize int8``: the model as loaded (``--dtype``) against its int8 weight-only quantization
instead (``Qwen3.from_directory(quantize="int8")``). ``--attention A B``: attention backend A
against B instead (e.g. ``sdpa varlen-packed``; CUDA graphs as the engine's default).
``--pack-hint A B`` (CPU): weights packed for oneDNN with batch hint A against hint B
(``linear.PACK_BATCH_HINT``). ``--in-place`` (CPU): a lone decode row's keys gathered against
attended where they lie in the cache (``CpuAttention.key_run``; batch 1 only). For each batch
size B: B requests with --prompt-len tokens (or lengths spread evenly over ``--prompt-len MIN
MAX``) are prefilled, then --steps decode steps are timed (wall time of ``Engine.step()``,
which ends with the host reading the sampled tokens). Prints ms/step and tokens/s for both, and
the speed-up.

    python scripts/bench_decode_step.py --device cuda --batch 1 8 64 256
    python scripts/bench_decode_step.py --device cuda --attention sdpa varlen-packed --prompt-len 100 2000
    python scripts/bench_decode_step.py --dtype bfloat16 --batch 1 8 16
    python scripts/bench_decode_step.py --dtype bfloat16 --batch 1 8 16 --quantize int8
    python scripts/bench_decode_step.py --batch 1 8 --pack-hint 1 8
    python scripts/bench_decode_step.py --dtype bfloat16 --batch 1 --in-place
    python scripts/bench_decode_step.py --dtype bfloat16 --batch 1 --compile-decode --rounds 5
    python scripts/bench_decode_step.py --dtype bfloat16 --batch 1 --compile-decode --quantize int8 --rounds 5
    python scripts/bench_decode_step.py --device cuda --batch 256 --prompt-len 100 2000 --profile 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import FULL_SHAPE, QUICK_SHAPE, ensure_model  # noqa: E402


def prompt_lengths(batch: int, spec: list[int]) -> list[int]:
    """``spec`` [N]: all N; [MIN, MAX]: spread evenly from MIN to MAX over the batch."""
    low, high = spec[0], spec[-1]
    return [low + (high - low) * b // max(1, batch - 1) for b in range(batch)]


def prefilled_engine(model, batch: int, prompt_len: list[int], steps: int, cuda_graphs: bool | None,
                     page_size: int, attention: str = "auto", compile_decode: bool = False):
    """An engine whose ``batch`` requests are all prefilled and decoding, with room for ``steps``
    more decode steps (and the warm-up ones)."""
    from qil_worker import Engine

    lengths = prompt_lengths(batch, prompt_len)
    budget = max(4096, batch, max(lengths))
    # early requests decode while later ones prefill: room for those tokens too
    new_tokens = steps + 8 + -(-sum(lengths) // budget)
    pages = sum(-(-(n + new_tokens) // page_size) for n in lengths) + 8
    engine = Engine(model, num_pages=pages, page_size=page_size, token_budget=budget,
                    prefill_chunk=max(lengths), max_active=batch, cuda_graphs=cuda_graphs,
                    prefix_cache=False, attention=attention, compile_decode=compile_decode)
    vocab = model.config.vocab_size
    for b, n in enumerate(lengths):
        engine.submit([(b * 131 + i * 7) % vocab for i in range(n)],
                      max_new_tokens=new_tokens, ignore_eos=True)
    started: set[str] = set()
    while len(started) < batch:  # prefill everyone
        started.update(e.request_id for e in engine.step() if e.token_id is not None)
    for _ in range(3):  # capture the graph, warm up
        engine.step()
    return engine


def time_steps(model, batch: int, prompt_len: list[int], steps: int, cuda_graphs: bool | None, page_size: int,
               attention: str = "auto", compile_decode: bool = False) -> float:
    """Mean seconds per decode step of ``batch`` requests."""
    engine = prefilled_engine(model, batch, prompt_len, steps, cuda_graphs, page_size, attention, compile_decode)
    t0 = time.perf_counter()
    for _ in range(steps):
        events = engine.step()
        assert len(events) == batch, f"expected {batch} decode events, got {len(events)}"
    elapsed = (time.perf_counter() - t0) / steps
    engine.close()
    return elapsed


def profile_steps(model, batch: int, prompt_len: list[int], steps: int, page_size: int, attention: str,
                  top: int = 15) -> None:
    """Prints where ``steps`` eager decode steps of ``batch`` requests spend the device's time (the
    CPU's on CPU), by operator, with torch.profiler. Eager, so every kernel is its own row: a
    graph replays the same kernels, without the launch gaps."""
    from torch.profiler import ProfilerActivity, profile

    import torch

    engine = prefilled_engine(model, batch, prompt_len, steps, False, page_size, attention)
    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        if cuda:
            torch.cuda.synchronize(model.device)
    engine.close()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"profile: {steps} eager decode steps of {batch} requests, {attention} attention, by {key}")
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))


@contextlib.contextmanager
def keys_gathered(enabled: bool):
    """While ``enabled``: CPU attention gathers every decode row's keys, never attending a lone
    row's in place (the reference of ``--in-place``)."""
    from qil_worker.attention.cpu import CpuAttention
    from qil_worker.attention.sdpa import GatherSdpa

    if not enabled:
        yield
        return
    shipped = CpuAttention.key_run
    CpuAttention.key_run = GatherSdpa.key_run
    try:
        yield
    finally:
        CpuAttention.key_run = shipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 elsewhere")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[128], help="N, or MIN MAX (spread)")
    p.add_argument("--attention", nargs=2, default=None, metavar=("A", "B"),
                   help="compare two attention backends (auto, sdpa, varlen, varlen-packed)")
    p.add_argument("--quantize", choices=("int8", "int4", "int4-g32"), default=None,
                   help="compare the model as loaded with its weight-only quantization (int8, or "
                   "group-wise 4-bit int4 / int4-g32)")
    p.add_argument("--pack-hint", type=int, nargs=2, default=None, metavar=("A", "B"),
                   help="CPU: compare weights packed for oneDNN with batch hint A against hint B")
    p.add_argument("--in-place", action="store_true",
                   help="CPU: compare a lone decode row's keys gathered with attended in place")
    p.add_argument("--compile-decode", action="store_true",
                   help="CPU: compare eager decode steps with the model's compiled decode forward "
                   "(engine compile_decode; batch 1 is the step it covers)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time the pair this many times, alternating which goes first; the median speed-up")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="then profile STEPS eager decode steps at the largest batch (torch.profiler, "
                   "by device time per operator) with the second backend/variant's attention")
    args = p.parse_args(argv)
    from qil_worker import cpu_memory

    cpu_memory.configure_process(args.device)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from qil_worker import Qwen3

    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    default = Path.home() / ".cache" / "qil" / ("bench-quick" if args.quick else "bench-qwen3-0.6b-shape")
    model_dir = ensure_model(args.model_dir or default, shape)
    model = Qwen3.from_directory(model_dir, device=args.device, dtype=args.dtype)
    if args.compile_decode:  # (with --quantize: both arms quantized)
        names = ("eager", "compiled")
        if args.quantize:
            model = Qwen3.from_directory(model_dir, device=args.device, dtype=args.dtype, quantize=args.quantize)
        started, rss = time.perf_counter(), cpu_memory.resident_bytes()
        if model.compiled_decode() is None:
            raise SystemExit("the decode step did not compile (see the log)")
        print(f"decode step compiled in {time.perf_counter() - started:.1f} s; resident memory "
              f"{rss / 2**30:.2f} -> {cpu_memory.resident_bytes() / 2**30:.2f} GiB")
        reference, fast = (model, False, "auto", False), (model, False, "auto", True)
    elif args.quantize:
        names = ("as-loaded", args.quantize)
        quantized = Qwen3.from_directory(model_dir, device=args.device, dtype=args.dtype, quantize=args.quantize)
        reference, fast = (model, None, "auto"), (quantized, None, "auto")
    elif args.pack_hint:
        from qil_worker.model import linear

        names = tuple(f"hint {h}" for h in args.pack_hint)
        loaded = []
        for hint in args.pack_hint:
            linear.PACK_BATCH_HINT[model.dtype] = hint
            loaded.append(Qwen3.from_directory(model_dir, device=args.device, dtype=args.dtype))
        reference, fast = ((m, False, "auto") for m in loaded)
    elif args.in_place:
        names = ("gathered", "in place")  # the same engine settings; ``keys_gathered`` makes the difference
        reference = fast = (model, False, "auto")
    elif args.attention:
        names = tuple(args.attention)
        reference, fast = ((model, None, a) for a in args.attention)
    elif model.device.type == "cuda":
        names = ("eager", "graph")
        reference, fast = (model, False, "auto"), (model, True, "auto")
    else:
        names = ("plain", "packed")
        plain = Qwen3.from_directory(model_dir, device=args.device, dtype=args.dtype, pack_weights=False)
        reference, fast = (plain, False, "auto"), (model, False, "auto")
    print(f"decode step, {model.dtype} on {model.device}, prompt {'-'.join(map(str, args.prompt_len))}, "
          f"page size {args.page_size}")
    print(f"{'batch':>6}{names[0] + ' ms':>10}{names[1] + ' ms':>10}{names[0] + ' tok/s':>13}"
          f"{names[1] + ' tok/s':>13}{'speed-up':>10}")
    for batch in args.batch:
        def timed(arm, batch=batch):
            model_, graphs, attention = arm[:3]
            with keys_gathered(args.in_place and arm is reference):
                return time_steps(model_, batch, args.prompt_len, args.steps, graphs, args.page_size,
                                  attention, len(arm) > 3 and arm[3])

        ratios = []
        for round_ in range(args.rounds):
            if round_ % 2 == 0:
                slow, quick = timed(reference), timed(fast)
            else:
                quick, slow = timed(fast), timed(reference)
            ratios.append(slow / quick)
            print(f"{batch:>6}{1000 * slow:>10.2f}{1000 * quick:>10.2f}{batch / slow:>13.0f}{batch / quick:>13.0f}"
                  f"{slow / quick:>9.2f}x", flush=True)
        if args.rounds > 1:
            print(f"{batch:>6} median speed-up of {args.rounds} rounds: {statistics.median(ratios):.3f}x "
                  f"({min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    if args.profile:
        profile_steps(fast[0], max(args.batch), args.prompt_len, args.profile, args.page_size, fast[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
