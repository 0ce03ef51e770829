#!/usr/bin/env python
"""Tool calls' cost in the engine: constrained calls vs the same requests free, and a new tool
set's TTFT (bench_structured.py's method and setup, with tools instead of a response format).

  required    --requests concurrent requests under ``tool_choice: required`` over four tools
              (one call, not parallel), sampled and seeded, then the same requests free with
              the output lengths the constrained run produced (EOS masked): output tok/s of
              each and the ratio, runs interleaved, medians of --repeat.
  auto        the same under ``tool_choice: auto``: a random model writes free text, so this
              is what the trigger costs text that opens no block.
  ttft        one request at a time on an idle engine: TTFT of a tool set the engine has not
              seen (its grammar compiled on submit) vs the same set again (cached) vs no
              constraint; the overhead is new minus cached.

The reference of every ratio is measured in the same run. Qwen3's tags (``<think>``,
``<tool_call>``...) are added to the bench tokenizer as tokens, as Qwen3's tokenizer has them.
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
from bench_engine import FULL_SHAPE, QUICK_SHAPE, ensure_model  # noqa: E402
from bench_structured import (  # noqa: E402
    CORPUS_BYTES, FULL_TOKENIZER_SIZE, QUICK_TOKENIZER_SIZE, QWEN3_SPECIALS, ensure_tokenizer,
    first_token_time, run_batch,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 32}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "description": "search the web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "maxLength": 64},
                                         "limit": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query"]}}},
    {"type": "function", "function": {"name": "book", "description": "book a table", "parameters": {
        "type": "object", "properties": {
            "guests": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False}},
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}, "vip": {"type": "boolean"}},
        "required": ["guests", "time", "vip"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


def tool_set(k: int) -> list[dict]:
    """The tools with one bound changed: another grammar, compiled anew."""
    tools = json.loads(json.dumps(TOOLS))
    tools[1]["function"]["parameters"]["properties"]["limit"]["maximum"] = 20 + k
    return tools


def constraint_text(tools: list[dict], choice: str) -> str:
    from qil_worker.structured.tool_grammar import tool_constraint
    from qil_worker.structured.tools import tool_request

    return tool_constraint(tool_request(tools, choice, False))


def pairs(engine, prompts, new_tokens: int, constraint, repeat: int) -> tuple[float, float, list[float], dict]:
    """(constrained tok/s, free tok/s, per-pair ratios, the last constrained run), interleaved."""
    cons, free = [], []
    for _ in range(repeat):
        c = run_batch(engine, prompts, [new_tokens] * len(prompts), constraint, [])
        cons.append(c)
        free.append(run_batch(engine, prompts, c["lengths"], None, []))
    ratios = [c["tok_s"] / f["tok_s"] for c, f in zip(cons, free)]
    return (statistics.median(r["tok_s"] for r in cons), statistics.median(r["tok_s"] for r in free), ratios,
            cons[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--tokenizer-dir", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--ttft-trials", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="tiny model and tokenizer (smoke test)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from qil_worker import Engine, Qwen3, cpu_memory
    from qil_worker.structured import ConstraintSpec
    from qil_worker.text import load_tokenizer

    if args.device == "cpu":
        cpu_memory.configure_process("cpu")
        torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    cache = Path.home() / ".cache" / "qil"
    model_dir = ensure_model(args.model_dir or cache / ("bench-quick" if args.quick else "bench-qwen3-0.6b-shape"), shape)
    size = QUICK_TOKENIZER_SIZE if args.quick else FULL_TOKENIZER_SIZE
    tok_dir = ensure_tokenizer(args.tokenizer_dir or cache / f"bench-tokenizer-{size}", size,
                               2_000_000 if args.quick else CORPUS_BYTES)
    tokenizer = load_tokenizer(tok_dir)
    tokenizer.add_tokens(TAGS)
    assert len(tokenizer) <= shape["vocab_size"], (len(tokenizer), shape["vocab_size"])
    model = Qwen3.from_directory(model_dir, dtype=args.dtype, device=args.device)
    page_size = 16
    pages = args.requests * -(-(args.prompt_len + args.new_tokens) // page_size) + 16
    engine = Engine(model, num_pages=pages, page_size=page_size, tokenizer=tokenizer, max_active=64)
    engine.grammars.warm()
    print(f"model {'quick' if args.quick else 'Qwen3-0.6B shape'} {args.dtype} on {args.device}; "
          f"tokenizer {len(tokenizer)} tokens with Qwen3's tags")

    rng = random.Random(0)
    regular = len(tokenizer) - len(QWEN3_SPECIALS) - len(TAGS)
    prompts = [[rng.randrange(regular) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    for choice in ("required", "auto"):
        spec = ConstraintSpec.from_kwargs(tool_calls=constraint_text(TOOLS, choice))
        t = time.perf_counter()
        constraint = engine.compile_constraint(spec)
        compile_ms = 1e3 * (time.perf_counter() - t)
        run_batch(engine, prompts[:2], [4, 4], constraint, [])  # warm-up
        run_batch(engine, prompts[:2], [4, 4], None, [])
        c_tok_s, f_tok_s, ratios, last = pairs(engine, prompts, args.new_tokens, constraint, args.repeat)
        calls = sum(1 for text in last["texts"] if text and "</tool_call>" in text)
        print(f"{choice}: {args.requests} requests, up to {args.new_tokens} new tokens ({last['tokens']} made, "
              f"{last['stopped']} complete, {calls} with a whole call); constrained {c_tok_s:.1f} tok/s, free "
              f"{f_tok_s:.1f} tok/s, ratio {statistics.median(ratios):.3f} "
              f"(per pair: {', '.join(f'{x:.3f}' for x in ratios)}); compile {compile_ms:.1f} ms")
        report[choice] = {"constrained_tok_s": c_tok_s, "free_tok_s": f_tok_s, "ratio": statistics.median(ratios),
                          "ratios": ratios, "compile_ms": compile_ms, "whole_calls": calls}

    if args.ttft_trials > 0:
        fresh = [[rng.randrange(regular) for _ in range(args.prompt_len)] for _ in range(3 * args.ttft_trials + 1)]
        first_token_time(engine, fresh[-1], tool_calls=constraint_text(tool_set(-1), "required"))  # warm-up
        new, cached = [], []
        for k in range(args.ttft_trials):
            text = constraint_text(tool_set(k), "required")
            new.append(first_token_time(engine, fresh[2 * k], tool_calls=text))
            cached.append(first_token_time(engine, fresh[2 * k + 1], tool_calls=text))
        free = [first_token_time(engine, fresh[2 * args.ttft_trials + k]) for k in range(args.ttft_trials)]
        overhead = [n - c for n, c in zip(new, cached)]
        print(f"ttft ({args.prompt_len}-token prompt, idle engine, medians of {args.ttft_trials}): new tool set "
              f"{1e3 * statistics.median(new):.1f} ms, cached {1e3 * statistics.median(cached):.1f} ms, free "
              f"{1e3 * statistics.median(free):.1f} ms; new-tool-set overhead {1e3 * statistics.median(overhead):.1f} ms")
        report["ttft"] = {"new_ms": 1e3 * statistics.median(new), "cached_ms": 1e3 * statistics.median(cached),
                          "free_ms": 1e3 * statistics.median(free), "overhead_ms": 1e3 * statistics.median(overhead)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
