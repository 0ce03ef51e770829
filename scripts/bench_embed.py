#!/usr/bin/env python
"""Embeddings per second, qil against transformers with the same pooling, on the CPU or a GPU.

A random model with Qwen3-0.6B's shapes (bench_engine.py's, written once under
~/.cache/qil), --texts random token-id inputs of --min-len to --max-len tokens (seeded).
qil: ``Engine.embed`` of all of them at once (the scheduler packs them under its token
budget; prefix cache off: random inputs share nothing). transformers: ``Qwen3Model`` over
batches of --batch inputs sorted by length (as sentence-transformers batches: little padding),
left-padded with an attention mask, the last token's hidden state L2-normalised — the model
card's pooling. Rounds alternate the systems (qil first in even rounds) so that machine drift
hits both; the ratio is taken round by round and its median printed, with the smallest cosine
between the two systems' embeddings of the same input.

    python scripts/bench_embed.py                      # 256 texts of 32-512 tokens, bf16
    python scripts/bench_embed.py --texts 32 --rounds 3
    python scripts/bench_embed.py --quick              # tiny model: a smoke test
    python scripts/bench_embed.py --device cuda --batch 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import DTYPES, FULL_SHAPE, QUICK_SHAPE, ensure_model  # noqa: E402


def inputs_of(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.texts,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def qil_embed(engine, inputs: list[list[int]]) -> tuple[float, list[list[float]]]:
    t = time.perf_counter()
    vectors = engine.embed(inputs)
    return time.perf_counter() - t, vectors


@torch.inference_mode()
def hf_embed(model, inputs: list[list[int]], batch: int) -> tuple[float, list[list[float]]]:
    # .tolist() of each batch's vectors waits for the device, so the clock covers its work
    t = time.perf_counter()
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out: list[list[float] | None] = [None] * len(inputs)
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        width = max(len(inputs[i]) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):  # left padding: every row's last token in the last column
            ids[r, width - len(inputs[i]):] = torch.tensor(inputs[i])
            mask[r, width - len(inputs[i]):] = 1
        hidden = model(input_ids=ids.to(model.device),
                       attention_mask=mask.to(model.device)).last_hidden_state[:, -1]
        for r, vector in zip(rows, F.normalize(hidden.float(), dim=-1).tolist()):
            out[r] = vector
    return time.perf_counter() - t, out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="random model cache (default ~/.cache/qil/bench-qwen3-0.6b-shape)")
    p.add_argument("--quick", action="store_true", help="tiny model and inputs: a smoke test")
    p.add_argument("--texts", type=int, default=None, help="inputs (default 256; 8 with --quick)")
    p.add_argument("--min-len", type=int, default=None, help="default 32 (4 with --quick)")
    p.add_argument("--max-len", type=int, default=None, help="default 512 (24 with --quick)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both systems run there)")
    p.add_argument("--batch", type=int, default=16, help="transformers' batch (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=512, help="qil engine (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    defaults = (8, 4, 24) if args.quick else (256, 32, 512)
    for name, value in zip(("texts", "min_len", "max_len"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 1 <= args.min_len <= args.max_len or min(args.texts, args.batch, args.rounds) < 1:
        p.error("need 1 <= --min-len <= --max-len and positive --texts, --batch, --rounds")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModel

    from qil_worker import Engine, Qwen3, cpu_memory

    cpu_memory.configure_process(args.device)
    torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    tmp = tempfile.TemporaryDirectory(prefix="qil-bench-embed-") if args.quick and args.model_dir is None else None
    model_dir = args.model_dir or (Path(tmp.name) / "model" if tmp else
                                   Path(os.path.expanduser("~/.cache/qil/bench-qwen3-0.6b-shape")))
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    ensure_model(model_dir, shape)
    dtype = DTYPES[args.dtype]
    inputs = inputs_of(args, shape["vocab_size"])
    tokens = sum(len(i) for i in inputs)
    page_size = 16
    engine = Engine(
        Qwen3.from_directory(model_dir, device=args.device, dtype=dtype), num_pages=sum(-(-len(i) // page_size) for i in inputs) + 8,
        page_size=page_size, token_budget=args.token_budget, prefill_chunk=args.token_budget,
        max_active=64, prefix_cache=False,
    )
    hf = AutoModel.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    qil_embed(engine, inputs[:2])  # warm both (first-call allocations, oneDNN primitives)
    hf_embed(hf, inputs[:2], args.batch)
    ratios, qil_rates, hf_rates, cosines = [], [], [], []
    for r in range(args.rounds):
        runs = [("qil", lambda: qil_embed(engine, inputs)), ("hf", lambda: hf_embed(hf, inputs, args.batch))]
        timed = dict((name, fn()) for name, fn in (runs if r % 2 == 0 else runs[::-1]))
        (q_s, q_vec), (h_s, h_vec) = timed["qil"], timed["hf"]
        qil_rates.append(len(inputs) / q_s)
        hf_rates.append(len(inputs) / h_s)
        ratios.append(h_s / q_s)
        cosines.append(min(F.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0).item()
                           for a, b in zip(q_vec, h_vec)))
        print(f"round {r + 1}: qil {len(inputs) / q_s:.2f} emb/s, transformers {len(inputs) / h_s:.2f} emb/s, "
              f"ratio {h_s / q_s:.2f}", flush=True)
    print(f"\n{len(inputs)} inputs of {args.min_len}-{args.max_len} tokens ({tokens} tokens), {args.dtype}, "
          f"{args.device}, {args.threads} threads, {args.rounds} round(s)")
    print("| system | embeddings/s | tokens/s |")
    print("|---|---|---|")
    for name, rates in (("qil", qil_rates), ("transformers", hf_rates)):
        rate = statistics.median(rates)
        print(f"| {name} | {rate:.2f} | {rate * tokens / len(inputs):.0f} |")
    print(f"ratio qil / transformers (median of rounds): {statistics.median(ratios):.2f}")
    print(f"smallest cosine between the systems' embeddings: {min(cosines):.5f}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
