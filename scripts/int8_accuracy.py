#!/usr/bin/env python
"""What int8 weight-only quantization costs in accuracy, on the random Qwen3-0.6B-shaped model.

The unquantized model (``--dtype``, default bfloat16) greedily continues ``--prompts`` random
prompts of ``--prompt-len`` tokens by ``--new-tokens`` tokens; those sequences (prompt +
continuation) are then computed by each variant, teacher-forced, in one prefill forward and
again one token per forward (the decode kernels):

- ``int8``: every projection and the LM head quantized (``--quantize int8``'s default);
- ``int8, LM head unquantized``: the projections only (``quantize_weights(head=False)``);
- ``int4`` / ``int4-g32`` (``--variants``): group-wise 4-bit, groups of 128 / 32 inputs.

Printed per variant: max abs logit error against the unquantized model's logits over every
position (and the largest logit, for scale), greedy agreement (the share of continuation
positions whose argmax is the unquantized model's token), and how many tokens a free-running
greedy decode matches before it first departs. A random model's logits are nearly flat, so its
greedy choices are decided by small margins: agreement here is a pessimistic figure.

    python scripts/int8_accuracy.py
    python scripts/int8_accuracy.py --dtype float32 --prompts 2 --new-tokens 32
    python scripts/int8_accuracy.py --variants int8 int4 int4-g32
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import FULL_SHAPE, QUICK_SHAPE, ensure_model  # noqa: E402


VARIANTS = {"int8": "int8", "int8-body": "int8, LM head unquantized", "int4": "int4",
            "int4-body": "int4, LM head unquantized", "int4-g32": "int4-g32",
            "int4-g32-body": "int4-g32, LM head unquantized"}


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation through the engine."""
    from qil_worker import Engine

    pages = sum(-(-(len(p) + new_tokens) // 16) for p in prompts) + 8
    engine = Engine(model, num_pages=pages, page_size=16, max_active=len(prompts), prefix_cache=False)
    ids = [engine.submit(p, max_new_tokens=new_tokens, ignore_eos=True) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while not engine.idle:
        for event in engine.step():
            if event.token_id is not None:
                out[event.request_id].append(event.token_id)
    engine.close()
    return [out[i] for i in ids]


def teacher_forced(model, sequence: list[int], one_by_one: bool) -> torch.Tensor:
    """float32 logits [len, vocab] of every position of ``sequence``."""
    from qil_worker.engine.probe import ForwardProbe

    probe = ForwardProbe(model, num_pages=-(-len(sequence) // 16) + 4, page_size=16)
    seq = probe.sequence(sequence)
    if not one_by_one:
        return probe.forward([(seq, len(sequence))])[0].float()
    return torch.cat([probe.forward([(seq, 1)])[0].float() for _ in sequence])


def load(model_dir: Path, dtype: str, variant: str):
    from qil_worker import Qwen3

    if variant == "none":
        return Qwen3.from_directory(model_dir, dtype=dtype)
    model = Qwen3.from_directory(model_dir, dtype=dtype, pack_weights=False)
    model.quantize_weights(variant.removesuffix("-body"), head=not variant.endswith("-body"))
    model.pack_weights()
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="random model cache (default ~/.cache/qil/bench-qwen3-0.6b-shape, made once)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode", action="store_true",
                   help="also compute the sequences one token per forward (the decode kernels; slow)")
    p.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=["int8", "int8-body"],
                   help="quantizations to measure (NAME-body: the LM head left unquantized)")
    args = p.parse_args(argv)
    from qil_worker import cpu_memory

    cpu_memory.configure_process("cpu")
    torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    default = Path.home() / ".cache" / "qil" / ("bench-quick" if args.quick else "bench-qwen3-0.6b-shape")
    model_dir = ensure_model(args.model_dir or default, shape)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, shape["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()

    t = time.perf_counter()
    reference = load(model_dir, args.dtype, "none")
    continuations = greedy(reference, prompts, args.new_tokens)
    sequences = [p + c for p, c in zip(prompts, continuations)]
    want = [teacher_forced(reference, s, False) for s in sequences]
    reference_format, reference_bytes = reference.weight_summary()
    print(f"{'/'.join(args.variants)} accuracy: {args.prompts} prompts x {args.prompt_len} tokens + {args.new_tokens} greedy, "
          f"{args.dtype}, {torch.get_num_threads()} threads (reference {time.perf_counter() - t:.0f}s: "
          f"{reference_format}, {reference_bytes / 2**20:.1f} MiB)", flush=True)
    del reference
    gc.collect()

    print(f"{'variant':28s} {'path':8s} {'max |dlogit|':>13s} {'max |logit|':>12s} {'agreement':>10s} "
          f"{'free-run match':>15s} {'weights MiB':>12s}")
    for variant in args.variants:
        label = VARIANTS[variant]
        model = load(model_dir, args.dtype, variant)
        _, weight_bytes = model.weight_summary()
        free_run = greedy(model, prompts, args.new_tokens)
        matched = []
        for ref, got in zip(continuations, free_run):
            same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
            matched.append(same)
        paths = ("prefill", "decode") if args.decode else ("prefill",)
        for path in paths:
            error = scale = 0.0
            agree = total = 0
            for seq, ref_logits in zip(sequences, want):
                got = teacher_forced(model, seq, path == "decode")
                error = max(error, (got - ref_logits).abs().max().item())
                scale = max(scale, ref_logits.abs().max().item())
                # the argmax at position i predicts token i + 1: only the continuation's tokens
                cont = slice(args.prompt_len - 1, len(seq) - 1)
                agree += (got[cont].argmax(-1) == ref_logits[cont].argmax(-1)).sum().item()
                total += len(seq) - args.prompt_len
            print(f"{label:28s} {path:8s} {error:13.4f} {scale:12.3f} {agree / total:10.3f} "
                  f"{sum(matched) / len(matched):9.1f}/{args.new_tokens:<5d} {weight_bytes / 2**20:12.1f}",
                  flush=True)
        del model
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
