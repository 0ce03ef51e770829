#!/usr/bin/env python
"""The matmul kernels for int8 weights against oneDNN's packed bfloat16, on the 0.6B shapes.

One "pass" is the seven projections of each of 28 layers (qk 3072x1024, v 1024x1024, o
1024x2048, gate and up 3072x1024, down 1024x3072), each layer's weights its own tensors, so
the pass streams ~1.1 GB of bf16 (~0.55 GB of int8) from memory like a decode step does; the
LM head (151,936 x 1,024) is timed apart. Kernels, taken in turn in every round so that machine
drift hits all alike (best round kept):

- ``bf16 packed``: ``torch.ops.mkldnn._linear_pointwise`` on weights packed once (what qil runs
  without --quantize);
- ``int8 weight-only``: ``torch._weight_int8pack_mm`` (what --quantize int8 runs);
- ``int8 dynamic (fbgemm)``: ``torch.ops.quantized.linear_dynamic``: the activations quantized
  to uint8 per call, one scale for the whole input, and an int8 x int8 GEMM (VNNI) — what
  llama.cpp's q8_0 does with a scale per 32 values instead; measured, not served (one scale
  per call couples the rows of different requests, and per-tensor activation scales cost
  accuracy on real models).

    python scripts/bench_int8_kernels.py --rows 1 8 16 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

SHAPES = [(3072, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072)]
HEAD = (151936, 1024)


def make_weights(shapes, seed=0):
    from qil_worker.model.int8_linear import quantize_per_channel

    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        q, s = quantize_per_channel(w, torch.bfloat16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, s.double(), torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            dyn = torch.ops.quantized.linear_prepack(qw, None)
        out.append(dict(k=k, q=q, s=s, packed=torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1), dyn=dyn))
    return out


KERNELS = {
    "bf16 packed": lambda x, d: torch.ops.mkldnn._linear_pointwise(x, d["packed"], None, "none", [], ""),
    "int8 weight-only": lambda x, d: torch._weight_int8pack_mm(x, d["q"], d["s"]),
    "int8 dynamic (fbgemm)": lambda x, d: torch.ops.quantized.linear_dynamic(x.float(), d["dyn"], True).to(x.dtype),
}


def bench(weights, rows: int, rounds: int) -> dict[str, float]:
    xs = {k: torch.randn(rows, k).bfloat16() for k in {d["k"] for d in weights}}
    best = dict.fromkeys(KERNELS, float("inf"))
    for name, fn in KERNELS.items():  # warm-up
        for d in weights:
            fn(xs[d["k"]], d)
    for _ in range(rounds):
        for name, fn in KERNELS.items():
            t = time.perf_counter()
            for d in weights:
                fn(xs[d["k"]], d)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.backends.quantized.engine = "x86" if "x86" in torch.backends.quantized.supported_engines else "fbgemm"
    with torch.inference_mode():
        layers = make_weights(SHAPES * args.layers)
        head = make_weights([HEAD], seed=1)
        int8_bytes = sum(d["q"].numel() for d in layers)
        print(f"{args.layers} layers ({int8_bytes / 1e9:.2f} GB int8, {2 * int8_bytes / 1e9:.2f} GB bf16) and the "
              f"LM head, {torch.get_num_threads()} threads, best of {args.rounds} rounds; ms")
        print(f"{'rows':>4} {'part':>7} " + " ".join(f"{k:>22s}" for k in KERNELS) + f" {'int8 GB/s':>10}")
        for rows in args.rows:
            for part, weights, size in (("layers", layers, int8_bytes), ("LM head", head, HEAD[0] * HEAD[1])):
                best = bench(weights, rows, args.rounds)
                print(f"{rows:>4} {part:>7} " + " ".join(f"{1e3 * best[k]:22.2f}" for k in KERNELS)
                      + f" {size / best['int8 weight-only'] / 1e9:10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
