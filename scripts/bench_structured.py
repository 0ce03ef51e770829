#!/usr/bin/env python
"""Structured output's cost in the engine: constrained vs free throughput, and a new schema's TTFT.

On the random model with Qwen3-0.6B's shapes (bench_engine.py's), with a byte-level BPE of
Qwen3's vocabulary size trained locally (no real Qwen3 tokenizer can be downloaded here):

  throughput  --requests concurrent requests, --prompt-len random prompt tokens each, sampled
              (temperature 1, seeded), under a nested JSON schema, then the same requests free
              with the same output lengths as the constrained run produced (EOS masked): output
              tok/s of each and the ratio, runs interleaved (C F C F ...), medians of --repeat.
              The constrained runs also report where the grammar's time goes per step: mask
              fill (llguidance) and mask apply (unpack + masked fill), in ms.
  ttft        one request at a time on an idle engine: TTFT (submit → first token on the host,
              compile included) of a schema the engine has not seen vs one it has (cached),
              --ttft-trials pairs, medians; the overhead is the difference.
  setup       llguidance's tokenizer info: build time and resident memory, paid once per engine
              (on the first constrained request, or earlier through ``engine.grammars.warm()``).

The tokenizer is trained once on local text (Python sources) and cached under
``~/.cache/qil/bench-tokenizer-<size>``; ``--quick`` runs a tiny model and tokenizer (smoke test).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import FULL_SHAPE, QUICK_SHAPE, ensure_model  # noqa: E402

QWEN3_SPECIALS = [  # Qwen3's added tokens, in id order after the regular vocabulary
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
FULL_TOKENIZER_SIZE = 151_643  # Qwen3's regular tokens; its specials follow
QUICK_TOKENIZER_SIZE = 1_000
CORPUS_BYTES = 120_000_000  # local text the BPE is trained on (Python sources)

# The nested schema of the measurement in docs/structured-output-library.md, a little smaller:
# objects 3 deep, arrays of objects with maxItems, enums, bounded integers, strings with
# maxLength and a pattern, anyOf with null, required and additionalProperties false everywhere.
SCHEMA = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 10_000_000},
                "name": {"type": "string", "maxLength": 48},
                "email": {"anyOf": [{"type": "string", "maxLength": 64}, {"type": "null"}]},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 64},
                        "city": {"type": "string", "maxLength": 32},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["id", "name", "email", "tier", "address"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string", "maxLength": 16},
                    "status": {"enum": ["open", "shipped", "cancelled"]},
                    "lines": {
                        "type": "array",
                        "maxItems": 10,
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string", "maxLength": 24},
                                "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
                                "note": {"anyOf": [{"type": "string", "maxLength": 128}, {"type": "null"}]},
                            },
                            "required": ["sku", "quantity", "note"],
                            "additionalProperties": False,
                        },
                    },
                },
                "required": ["order_id", "status", "lines"],
                "additionalProperties": False,
            },
        },
        "summary": {"type": "string", "maxLength": 256},
    },
    "required": ["customer", "orders", "summary"],
    "additionalProperties": False,
}


def variant(k: int) -> dict:
    """The schema with one bound changed: a different grammar, so the engine compiles it anew."""
    schema = json.loads(json.dumps(SCHEMA))
    schema["properties"]["summary"]["maxLength"] = 100 + k
    return schema


# --------------------------------------------------------------------------------------------
# the tokenizer
# --------------------------------------------------------------------------------------------


def corpus(limit: int) -> list[str]:
    """Local Python sources, up to ``limit`` bytes, in a fixed order."""
    roots = sorted(glob.glob("/usr/lib/python3*")) + [os.path.dirname(os.__file__)]
    roots += [p for p in sys.path if p.endswith("site-packages")]
    texts, total, seen = [], 0, set()
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            try:
                text = Path(real).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            texts.append(text)
            total += len(text)
            if total >= limit:
                return texts
    return texts


def ensure_tokenizer(path: Path, regular: int, corpus_bytes: int) -> Path:
    """A Qwen2/3-style byte-level BPE (Qwen's split regex, NFC, Qwen3's specials after the
    regular tokens, EOS <|im_end|>) trained on local text, written once to ``path``."""
    if (path / "tokenizer.json").exists():
        return path
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    print(f"bench: training a {regular}-token byte-level BPE in {path} (once) ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    split = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=regular, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(corpus_bytes), trainer)
    tok.add_special_tokens(QWEN3_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tmp = path.with_name(path.name + ".partial")
    fast.save_pretrained(tmp)
    tmp.rename(path)
    print(f"bench: tokenizer of {len(fast)} tokens trained in {time.perf_counter() - t:.0f}s",
          file=sys.stderr, flush=True)
    return path


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# --------------------------------------------------------------------------------------------
# the runs
# --------------------------------------------------------------------------------------------


class MaskTimer:
    """Wall time of the grammar stage per step: the fill, and the whole stage."""

    def __init__(self, masks) -> None:
        self.fill: list[float] = []
        self.stage: list[float] = []
        fill, apply = masks._fill, masks.apply

        def timed_fill(*a, **k):
            t = time.perf_counter()
            out = fill(*a, **k)
            self.fill.append(time.perf_counter() - t)
            return out

        def timed_apply(*a, **k):
            t = time.perf_counter()
            out = apply(*a, **k)
            self.stage.append(time.perf_counter() - t)
            return out

        masks._fill, masks.apply = timed_fill, timed_apply

    def reset(self) -> None:
        self.fill.clear()
        self.stage.clear()


def run_batch(engine, prompts, lengths, constraint, steps: list[float]) -> dict:
    """Submit all at once, step to the end; output tok/s and each request's output length."""
    t0 = time.perf_counter()
    ids = []
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        extra = dict(constraint=constraint) if constraint is not None else dict(min_new_tokens=n)
        ids.append(engine.submit(prompt, max_new_tokens=n, temperature=1.0, seed=i, **extra))
    produced = {i: 0 for i in ids}
    done: dict[str, object] = {}
    while len(done) < len(ids):
        s = time.perf_counter()
        events = engine.step()
        steps.append(time.perf_counter() - s)
        for e in events:
            if e.error:
                raise RuntimeError(f"request {e.request_id} failed: {e.error}")
            if e.token_id is not None:
                produced[e.request_id] += 1
            if e.result is not None:
                done[e.request_id] = e.result
    wall = time.perf_counter() - t0
    for i in ids:
        engine.release(i)
    tokens = sum(produced.values())
    reasons = [done[i].finish_reason.value for i in ids]
    return {"wall": wall, "tokens": tokens, "tok_s": tokens / wall, "lengths": [produced[i] for i in ids],
            "stopped": reasons.count("stop"), "texts": [done[i].output_text for i in ids]}


def first_token_time(engine, prompt, **kwargs) -> float:
    """Submit one request (its compile included) and step until its first token is on the host."""
    t0 = time.perf_counter()
    rid = engine.submit(prompt, max_new_tokens=1, temperature=1.0, seed=0, **kwargs)
    while True:
        for e in engine.step():
            if e.request_id == rid and e.token_id is not None:
                ttft = time.perf_counter() - t0
                while not engine.idle:
                    engine.step()
                engine.release(rid)
                return ttft
            if e.request_id == rid and e.error:
                raise RuntimeError(e.error)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--tokenizer-dir", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64, help="max_new_tokens of the constrained requests")
    p.add_argument("--repeat", type=int, default=2, help="constrained/free run pairs (medians)")
    p.add_argument("--ttft-trials", type=int, default=5, help="new/cached schema pairs (medians)")
    p.add_argument("--compare-overlap", action="store_true",
                   help="also run the constrained requests with the masks filled on a helper thread "
                        "beside the forward (the engine's choice on CUDA; C, C-overlap, F interleaved)")
    p.add_argument("--quick", action="store_true", help="tiny model and tokenizer (smoke test)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from qil_worker import Engine, Qwen3, cpu_memory
    from qil_worker.structured import ConstraintSpec
    from qil_worker.text import load_tokenizer

    cpu_memory.configure_process("cpu")
    torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    cache = Path.home() / ".cache" / "qil"
    model_dir = ensure_model(args.model_dir or cache / ("bench-quick" if args.quick else "bench-qwen3-0.6b-shape"), shape)
    size = QUICK_TOKENIZER_SIZE if args.quick else FULL_TOKENIZER_SIZE
    tok_dir = ensure_tokenizer(
        args.tokenizer_dir or cache / f"bench-tokenizer-{size}", size,
        2_000_000 if args.quick else CORPUS_BYTES,
    )
    tokenizer = load_tokenizer(tok_dir)
    assert len(tokenizer) <= shape["vocab_size"], (len(tokenizer), shape["vocab_size"])
    model = Qwen3.from_directory(model_dir, dtype=args.dtype)
    page_size = 16
    pages = args.requests * -(-(args.prompt_len + args.new_tokens) // page_size) + 16  # all at once
    engine = Engine(model, num_pages=pages, page_size=page_size, tokenizer=tokenizer, max_active=64)
    print(f"model {'quick' if args.quick else 'Qwen3-0.6B shape'} {args.dtype}, {args.threads} threads; "
          f"tokenizer {len(tokenizer)} tokens (model vocabulary {shape['vocab_size']})")

    rss = rss_mb()
    t = time.perf_counter()
    engine.grammars.warm()
    setup = {"tokenizer_info_s": time.perf_counter() - t, "tokenizer_info_rss_mb": rss_mb() - rss}
    print(f"setup: llguidance tokenizer info {setup['tokenizer_info_s']:.2f} s, "
          f"+{setup['tokenizer_info_rss_mb']:.0f} MB RSS (once per engine)")

    rng = random.Random(0)
    regular = len(tokenizer) - len(QWEN3_SPECIALS)
    prompts = [[rng.randrange(regular) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    spec = ConstraintSpec.from_kwargs(json_schema=SCHEMA)
    t = time.perf_counter()
    constraint = engine.compile_constraint(spec)
    compile_s = time.perf_counter() - t
    timer = MaskTimer(engine.runner.sampler.grammar_masks)

    run_batch(engine, prompts[:2], [4, 4], constraint, [])  # warm-up, both paths
    run_batch(engine, prompts[:2], [4, 4], None, [])
    rows = {"constrained": [], "free": [], "other": []}
    fill_ms, stage_ms, step_ms = [], [], []
    masks = engine.runner.sampler.grammar_masks
    for _ in range(args.repeat):
        timer.reset()
        steps: list[float] = []
        c = run_batch(engine, prompts, [args.new_tokens] * args.requests, constraint, steps)
        fill_ms.append(1e3 * statistics.mean(timer.fill))
        stage_ms.append(1e3 * statistics.mean(timer.stage))
        step_ms.append(1e3 * statistics.mean(steps))
        rows["constrained"].append(c)
        if args.compare_overlap:
            default, masks.overlap = masks.overlap, not masks.overlap
            rows["other"].append(run_batch(engine, prompts, [args.new_tokens] * args.requests, constraint, []))
            masks.overlap = default
        rows["free"].append(run_batch(engine, prompts, c["lengths"], None, []))
    for r in rows["constrained"][-1]["texts"]:
        assert r is not None
    c_tok_s = statistics.median(r["tok_s"] for r in rows["constrained"])
    f_tok_s = statistics.median(r["tok_s"] for r in rows["free"])
    ratios = [c["tok_s"] / f["tok_s"] for c, f in zip(rows["constrained"], rows["free"])]
    last = rows["constrained"][-1]
    print(f"throughput: {args.requests} requests, {args.prompt_len}-token prompts, up to {args.new_tokens} "
          f"new tokens ({last['tokens']} made, {last['stopped']} complete), temperature 1, seeded")
    print(f"  constrained {c_tok_s:.1f} tok/s, free {f_tok_s:.1f} tok/s, ratio {statistics.median(ratios):.3f} "
          f"(per pair: {', '.join(f'{x:.3f}' for x in ratios)})")
    where = "beside the forward" if masks.overlap else "after the forward"
    if rows["other"]:
        other = [o["tok_s"] / f["tok_s"] for o, f in zip(rows["other"], rows["free"])]
        print(f"  masks filled {'after' if masks.overlap else 'beside'} the forward instead: "
              f"{statistics.median(r['tok_s'] for r in rows['other']):.1f} tok/s, ratio "
              f"{statistics.median(other):.3f} (per pair: {', '.join(f'{x:.3f}' for x in other)})")
    print(f"  grammar stage per step: fill {statistics.median(fill_ms):.2f} ms ({where}), "
          f"sampler stage {statistics.median(stage_ms):.2f} ms, of a {statistics.median(step_ms):.1f} ms step")
    print(f"  schema compile (first time) {1e3 * compile_s:.1f} ms")

    if args.ttft_trials < 1:
        return 0
    new, cached = [], []
    # a fresh prompt for every request: none may find its prompt in the prefix cache
    ttft_prompts = [[rng.randrange(regular) for _ in range(args.prompt_len)] for _ in range(3 * args.ttft_trials + 1)]
    first_token_time(engine, ttft_prompts[-1], json_schema=variant(-1))  # warm-up
    for k in range(args.ttft_trials):
        new.append(first_token_time(engine, ttft_prompts[2 * k], json_schema=variant(k)))
        cached.append(first_token_time(engine, ttft_prompts[2 * k + 1], json_schema=variant(k)))
    free_ttft = [first_token_time(engine, ttft_prompts[2 * args.ttft_trials + k]) for k in range(args.ttft_trials)]
    overhead = [n - c for n, c in zip(new, cached)]
    print(f"ttft ({args.prompt_len}-token prompt, idle engine, medians of {args.ttft_trials}): new schema "
          f"{1e3 * statistics.median(new):.1f} ms, cached {1e3 * statistics.median(cached):.1f} ms, free "
          f"{1e3 * statistics.median(free_ttft):.1f} ms; new-schema overhead {1e3 * statistics.median(overhead):.1f} ms")

    if args.json:
        report = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "tokenizer_size": len(tokenizer),
            "setup": setup,
            "compile_ms": 1e3 * compile_s,
            "constrained_tok_s": c_tok_s,
            "free_tok_s": f_tok_s,
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "fill_ms": statistics.median(fill_ms),
            "stage_ms": statistics.median(stage_ms),
            "step_ms": statistics.median(step_ms),
            "ttft_new_ms": 1e3 * statistics.median(new),
            "ttft_cached_ms": 1e3 * statistics.median(cached),
            "ttft_free_ms": 1e3 * statistics.median(free_ttft),
            "ttft_overhead_ms": 1e3 * statistics.median(overhead),
        }
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
