#!/usr/bin/env python
"""qil's Engine against transformers' ``generate`` on a random Qwen3-MoE (Qwen3MoeForCausalLM).

The shape keeps what decides MoE speed in Qwen3-30B-A3B — 128 experts, top-8 (renormalised),
expert width 768, hidden 2048, 32 query / 4 KV heads of 128 — and scales down what only
multiplies memory: 4 layers instead of 48 (one layer's experts are 1.2 GB in bfloat16, two
systems' copies of 48 layers would not fit a 24 GB machine), and a vocabulary of 16,384 instead
of 151,936, so that the LM head stays the same small share of a token's weight reads as in the
real model (about 1/8 here, 1/10 there) instead of dominating a 4-layer model.

Scenarios (greedy, same prompt token ids, bfloat16, same thread count), measured as
``bench_engine.py`` measures them and with its helpers: (a) one request: TTFT and decode tok/s;
(b) --batch concurrent requests: total output tok/s. Both models are loaded (about 10 GB) and
measured in interleaved rounds (--repeat, median kept), so that a busy moment of a shared
machine hits both alike; ``--sequential`` loads one at a time instead. Ratios > 1 mean qil is
better. transformers runs its default experts implementation (printed; ``--hf-experts``).

The model directory (--model-dir) is written once with random weights (normal, std 0.02; norms
1) and reused. ``--quick``: a tiny MoE shape and lengths, a smoke test of a few seconds.
``--paths``: instead, one MoE block of the shape through each of qil's expert wirings.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import agreement, hf_run, qil_run

FULL_SHAPE = dict(
    vocab_size=16384,
    hidden_size=2048,
    intermediate_size=6144,  # unused: every layer is sparse, as in Qwen3-30B-A3B
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
)
QUICK_SHAPE = dict(
    FULL_SHAPE,
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def ensure_moe_model(path: Path, shape: dict) -> Path:
    """Write a random bfloat16 Qwen3MoeForCausalLM with ``shape`` to ``path`` unless there."""
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    print(f"bench: creating random MoE model in {path} (once) ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    # bfloat16 while still on meta: allocated once, in the dtype it is saved in; no default init
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp)
    tmp.rename(path)
    print(f"bench: model written in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    return path


class System:
    """One side of the comparison: how to run prompts, and what to say about it."""

    def __init__(self, label: str, run, info: dict, close=None) -> None:
        self.label, self.run, self.info, self.close = label, run, info, close or (lambda: None)

    def warm_up(self, prompts: list[list[int]], rounds: int) -> None:
        for _ in range(rounds):  # every code path once: prefill, decode, a batch of two
            warm = [p[: min(16, len(p))] for p in prompts[:2]]
            self.run(warm[:1], 4)
            self.run(warm, 4)


def load_qil(args, model_dir: Path) -> System:
    from qil_worker import Engine, Qwen3

    t = time.perf_counter()
    model = Qwen3.from_directory(model_dir, device="cpu", dtype=torch.bfloat16, quantize=args.quantize,
                                 compile=not args.no_compile)
    print(f"bench: qil loaded in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    info = {"architecture": model.config.describe(), "weights": model.weight_summary()[0]}
    pages = args.batch * -(-(args.prompt_len + args.new_tokens) // args.page_size) + 8
    # the same prompts run in every round: a prefix cache would skip their prefill, which
    # transformers cannot; measure the compute instead
    engine = Engine(model, num_pages=pages, page_size=args.page_size, token_budget=args.token_budget,
                    prefill_chunk=args.prefill_chunk, max_active=max(args.batch, 1), prefix_cache=False)
    return System("qil", lambda p, n: qil_run(engine, p, n), info, engine.close)


def load_transformers(args, model_dir: Path) -> System:
    from transformers import Qwen3MoeForCausalLM

    t = time.perf_counter()
    kwargs = {} if args.hf_experts is None else {"experts_implementation": args.hf_experts}
    model = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                **kwargs).eval()
    print(f"bench: transformers loaded in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    experts = getattr(model.config, "_experts_implementation", None) or "eager"
    return System("transformers", lambda p, n: hf_run(model, p, n), {"experts_implementation": experts})


def summarize(single: dict, batch: dict, n_new: int, batch_size: int) -> dict:
    decode = (n_new - 1) / single["decode"][0] if n_new > 1 and single["decode"][0] > 0 else float("nan")
    return {"ttft_s": single["ttft"][0], "decode_tok_s": decode, "batch_output_tok_s": batch_size * n_new / batch["wall"],
            "tokens_single": single["tokens"], "tokens_batch": batch["tokens"]}


def run_rounds(systems: list[System], args, prompts: list[list[int]]) -> list[dict]:
    """``--repeat`` rounds of (a) then (b) for every system in turn, so a busy moment of the
    machine hits both alike; each system's median round (by wall time) per scenario."""
    runs: dict[str, dict[str, list[dict]]] = {s.label: {"single": [], "batch": []} for s in systems}
    for r in range(args.repeat):
        for name, chosen in (("single", prompts[:1]), ("batch", prompts[: args.batch])):
            for system in systems:
                t = time.perf_counter()
                runs[system.label][name].append(system.run(chosen, args.new_tokens))
                print(f"bench: round {r + 1} {system.label} {name} {time.perf_counter() - t:.1f}s",
                      file=sys.stderr, flush=True)
    out = []
    for system in systems:
        median = {name: sorted(rs, key=lambda x: x["wall"])[len(rs) // 2] for name, rs in runs[system.label].items()}
        out.append({**summarize(median["single"], median["batch"], args.new_tokens, args.batch), **system.info})
    return out


def measure_all(args, model_dir: Path, prompts: list[list[int]]) -> tuple[dict, dict]:
    """(qil's results, transformers'): both loaded and interleaved, or with ``--sequential`` one
    loaded, measured and freed before the other (half the memory, no interleaving)."""
    loaders = (load_qil, load_transformers)
    if not args.sequential:
        systems = [load(args, model_dir) for load in loaders]
        for system in systems:
            system.warm_up(prompts, args.warmup)
        results = run_rounds(systems, args, prompts)
        for system in systems:
            system.close()
        return results[0], results[1]
    results = []
    for load in loaders:
        system = load(args, model_dir)
        system.warm_up(prompts, args.warmup)
        results.extend(run_rounds([system], args, prompts))
        system.close()
        del system
        gc.collect()
    return results[0], results[1]


PATH_TOKENS = (1, 8, 64, 512)


def bench_paths(args) -> list[dict]:
    """One sparse MoE block of the benchmark's shape (random weights, no checkpoint) through
    each expert wiring qil has: the per-expert loop over the stacked weight ("plain"), over
    per-expert oneDNN-packed weights ("packed", the CPU default), ``torch._grouped_mm`` over the
    stacked weight ("grouped", the CUDA path), int8 experts through the loop ("int8") and, at up
    to ``routed_experts.MAX_TOKENS`` tokens, as one compiled call ("int8 routed"; the CPU
    default for int8 experts, where it compiles); ms per block call, best of
    interleaved rounds, each call on fresh activations (so other experts, as in a real step)."""
    from qil_worker.config import Qwen3Config
    from qil_worker.model.int8_experts import Int8ExpertLinear
    from qil_worker.model.int8_linear import choose_kernels
    from qil_worker.model.moe import SparseMoeBlock
    from qil_worker.model.routed_experts import MAX_TOKENS, compiled_int8_experts

    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    config = Qwen3Config(
        hidden_size=shape["hidden_size"], num_hidden_layers=1, num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"], head_dim=shape["head_dim"],
        intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"], architecture="qwen3_moe",
        num_experts=shape["num_experts"], num_experts_per_tok=shape["num_experts_per_tok"],
        moe_intermediate_size=shape["moe_intermediate_size"], norm_topk_prob=True)
    cpu = torch.device("cpu")
    rows = []
    for dtype_name in args.paths_dtype:
        dtype = getattr(torch, dtype_name)
        generator = torch.Generator().manual_seed(0)
        blocks = {}
        for name in ("plain", "packed", "grouped", "int8", "int8 routed"):
            block = SparseMoeBlock(config, dtype, cpu, grouped=name == "grouped")
            if not blocks:
                for param in (block.gate.weight, block.gate_up.weight, block.down.weight):
                    param.data.copy_(torch.randn(param.shape, generator=generator).mul_(0.02))
            else:
                first = next(iter(blocks.values()))
                block.load_state_dict(first.state_dict())
            if name == "packed":
                block.pack_weights()
            elif name.startswith("int8"):
                block.gate_up, block.down = (Int8ExpertLinear.from_experts(block.gate_up),
                                             Int8ExpertLinear.from_experts(block.down))
                with torch.inference_mode():
                    choose_kernels([block.gate_up.probe(), block.down.probe()])
                for stack in (block.gate_up, block.down):
                    stack.use_kernels(stack.probe().kernels)
                if name == "int8 routed":
                    block.use_routed(compiled_int8_experts(config.hidden_size, config.moe_intermediate_size,
                                                           config.num_experts, config.num_experts_per_tok, dtype))
            blocks[name] = block
        for tokens in PATH_TOKENS:
            inputs = [torch.randn(tokens, config.hidden_size, generator=generator).to(dtype) for _ in range(4)]
            best = dict.fromkeys(blocks, float("inf"))
            with torch.inference_mode():
                for block in blocks.values():
                    block(inputs[0])
                for r in range(args.repeat + 2):
                    for name, block in blocks.items():
                        x = inputs[(r + 1) % len(inputs)]
                        t = time.perf_counter()
                        block(x)
                        best[name] = min(best[name], time.perf_counter() - t)
            if tokens > MAX_TOKENS:  # the routed block runs its loop there: the int8 column again
                best["int8 routed"] = float("nan")
            rows.append({"dtype": dtype_name, "tokens": tokens, **{k: v * 1e3 for k, v in best.items()}})
            print(f"bench: paths {dtype_name} {tokens} tokens done", file=sys.stderr, flush=True)
        del blocks
        gc.collect()
    print()
    print(f"one MoE block ({config.num_experts} experts, top-{config.num_experts_per_tok}, hidden "
          f"{config.hidden_size}, expert width {config.moe_intermediate_size}), ms per call, "
          f"{torch.get_num_threads()} threads")
    names = ("plain", "packed", "grouped", "int8", "int8 routed")
    header = f"{'dtype':9s} {'tokens':>6s} " + " ".join(f"{name:>11s}" for name in names)
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['dtype']:9s} {row['tokens']:6d} " + " ".join(f"{row[name]:11.2f}" for name in names))
    return rows


def print_table(q: dict, h: dict, args) -> None:
    print()
    print(f"{q['architecture']}")
    print(f"qil weights: {q['weights']}; transformers experts: {h['experts_implementation']}")
    print(f"bfloat16, prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, batch {args.batch}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}; ratio > 1 means qil is better")
    header = f"{'metric':28s} {'qil':>12s} {'transformers':>13s} {'ratio':>7s}"
    print(header)
    print("-" * len(header))
    rows = [
        ("(a) TTFT [ms]", q["ttft_s"] * 1e3, h["ttft_s"] * 1e3, h["ttft_s"] / q["ttft_s"]),
        ("(a) decode [tok/s]", q["decode_tok_s"], h["decode_tok_s"], q["decode_tok_s"] / h["decode_tok_s"]),
        (f"(b) x{args.batch} output [tok/s]", q["batch_output_tok_s"], h["batch_output_tok_s"],
         q["batch_output_tok_s"] / h["batch_output_tok_s"]),
    ]
    for name, a, b, ratio in rows:
        print(f"{name:28s} {a:12.2f} {b:13.2f} {ratio:7.2f}")
    print(f"{'greedy token agreement':28s} single {agreement(q['tokens_single'], h['tokens_single']):.2f}, "
          f"batch {agreement(q['tokens_batch'], h['tokens_batch']):.2f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="random model cache (default ~/.cache/qil/bench-qwen3-moe-<layers>l; a temporary dir "
                        "with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny MoE and lengths: a smoke test")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; 2 with --quick)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds per system (default %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (interleaved); the median is kept")
    p.add_argument("--sequential", action="store_true",
                   help="load and measure one system at a time (half the memory; no interleaving)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --quick)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 32 (6 with --quick)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="qil's weights: int8 = quantized at load (transformers stays bfloat16)")
    p.add_argument("--no-compile", action="store_true",
                   help="qil: keep int8 experts' decode steps on the per-expert loop "
                   "(Qwen3.from_directory(compile=False))")
    p.add_argument("--hf-experts", default=None,
                   help="transformers' experts_implementation (default: its own choice, e.g. grouped_mm)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default %(default)s)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=512, help="qil engine (default %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="qil engine (default %(default)s)")
    p.add_argument("--paths", action="store_true",
                   help="instead: time one MoE block through each expert wiring (no transformers)")
    p.add_argument("--paths-dtype", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.prompt_len is None:
        args.prompt_len = 16 if args.quick else 128
    if args.new_tokens is None:
        args.new_tokens = 6 if args.quick else 32
    if args.layers is None:
        args.layers = QUICK_SHAPE["num_hidden_layers"] if args.quick else FULL_SHAPE["num_hidden_layers"]
    if min(args.prompt_len, args.new_tokens, args.batch, args.repeat, args.layers) < 1 or args.warmup < 0:
        p.error("lengths, --layers, --batch and --repeat must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from qil_worker import cpu_memory

    cpu_memory.configure_process("cpu")
    torch.set_num_threads(args.threads)
    if args.paths:
        rows = bench_paths(args)
        if args.json:
            args.json.write_text(json.dumps({"paths": rows, "threads": torch.get_num_threads()}, indent=2) + "\n")
        return 0
    shape = dict(QUICK_SHAPE if args.quick else FULL_SHAPE, num_hidden_layers=args.layers)
    tmp = None
    if args.model_dir is None:
        if args.quick:
            tmp = tempfile.TemporaryDirectory(prefix="qil-bench-moe-quick-")
            args.model_dir = Path(tmp.name) / "model"
        else:
            args.model_dir = Path(os.path.expanduser(f"~/.cache/qil/bench-qwen3-moe-{args.layers}l"))
    args.model_dir.parent.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_moe_model(args.model_dir, shape)

    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, shape["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    q, h = measure_all(args, model_dir, prompts)
    print_table(q, h, args)
    if args.json:
        ratios = {"ttft": h["ttft_s"] / q["ttft_s"], "decode": q["decode_tok_s"] / h["decode_tok_s"],
                  "batch_output": q["batch_output_tok_s"] / h["batch_output_tok_s"]}
        meta = {"model_dir": str(model_dir), "shape": shape, "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens, "batch": args.batch, "threads": torch.get_num_threads(),
                "warmup": args.warmup, "repeat": args.repeat, "quantize": args.quantize,
                "compile": not args.no_compile, "torch": torch.__version__}
        strip = ("tokens_single", "tokens_batch")
        result = {"qil": {k: v for k, v in q.items() if k not in strip},
                  "transformers": {k: v for k, v in h.items() if k not in strip}, "ratios": ratios,
                  "token_agreement": {"single": agreement(q["tokens_single"], h["tokens_single"]),
                                      "batch": agreement(q["tokens_batch"], h["tokens_batch"])}}
        args.json.write_text(json.dumps({"config": meta, "results": result}, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
