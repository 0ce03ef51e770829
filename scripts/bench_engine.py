#!/usr/bin/env python
"""qil's Engine against transformers' ``generate`` on a random model with Qwen3-0.6B's shapes.

Scenarios (greedy, same prompt token ids and dtype for both systems, same thread count):

  (a) single   1 request, --prompt-len prompt, --new-tokens new tokens.
               TTFT: wall time from submitting the request (qil) / calling ``generate``
               (transformers) to the first generated token being available on the host.
               decode tok/s: (new_tokens - 1) / (time of last token - time of first token).
               transformers' token times come from a streamer (``put`` is called by
               ``generate`` right after each token is chosen), qil's from the engine's events,
               so both are measured the same way inside one run.
  (b) batch    --batch concurrent requests of --prompt-len tokens, --new-tokens each.
               total output tok/s = batch * new_tokens / wall time of the whole run
               (qil: submit all, step until all finish; transformers: one batched ``generate``
               of all prompts; equal lengths, so no padding).

EOS never stops either system early: the random model has no eos_token_id, and transformers
also gets ``min_new_tokens = max_new_tokens``.

Ratios are written so that > 1 means qil is better: throughput qil / transformers, and for
TTFT transformers / qil.

The model directory (--model-dir) is created once with random weights (normal, std 0.02; norms
1) and reused. Machines shared with other work give noisy numbers; use --repeat to take the
median of several runs.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

FULL_SHAPE = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)
QUICK_SHAPE = dict(
    FULL_SHAPE,
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------------------------
# the random model directory
# --------------------------------------------------------------------------------------------


def _engine_takes(engine_class: type, option: str) -> bool:
    """Whether this tree's Engine takes ``option`` (an EngineConfig field, or before the config,
    a keyword of its own): the script also runs against older engines."""
    try:
        from qil_worker.engine.config import FIELDS
    except ImportError:
        return option in inspect.signature(engine_class).parameters
    return option in FIELDS


def ensure_model(path: Path, shape: dict) -> Path:
    """Write a random Qwen3ForCausalLM with ``shape`` to ``path`` unless it is already there."""
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    from transformers import Qwen3Config, Qwen3ForCausalLM

    print(f"bench: creating random model in {path} (once) ...", file=sys.stderr, flush=True)
    t = time.perf_counter()
    torch.manual_seed(0)
    config = Qwen3Config(**shape, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device="cpu")  # no default init: draw the weights once, below
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    if shape["tie_word_embeddings"]:
        model.lm_head.weight = model.model.embed_tokens.weight
    tmp = path.with_name(path.name + ".partial")
    model.save_pretrained(tmp)
    tmp.rename(path)
    print(f"bench: model written in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    return path


# --------------------------------------------------------------------------------------------
# qil
# --------------------------------------------------------------------------------------------


def qil_run(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Submit all prompts at once, step to completion; per-request first/last token times."""
    t0 = time.perf_counter()
    # every request makes all its tokens, as transformers' run with min_new_tokens does (EOS masked)
    ids = [engine.submit(p, max_new_tokens=new_tokens, min_new_tokens=new_tokens) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    done = 0
    while done < len(ids):
        events = engine.step()
        now = time.perf_counter()
        for e in events:
            if e.error:
                raise RuntimeError(f"qil request {e.request_id} failed: {e.error}")
            if e.token_id is not None:
                first.setdefault(e.request_id, now)
                last[e.request_id] = now
                outputs[e.request_id].append(e.token_id)
            if e.finished:
                done += 1
    wall = time.perf_counter() - t0
    for i in ids:
        engine.release(i)
    return {
        "wall": wall,
        "ttft": [first[i] - t0 for i in ids],
        "decode": [last[i] - first[i] for i in ids],
        "tokens": [outputs[i] for i in ids],
    }


# --------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------


class TimingStreamer:
    """Records when ``generate`` hands over each new token (batch of one)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_run(model, prompts: list[list[int]], new_tokens: int) -> dict:
    ids = torch.tensor(prompts, dtype=torch.long)
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    streamer = TimingStreamer() if len(prompts) == 1 else None
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**kwargs, streamer=streamer)
    wall = time.perf_counter() - t0
    result = {"wall": wall, "tokens": out[:, ids.shape[1] :].tolist()}
    if streamer is not None:
        result["ttft"] = [streamer.times[0] - t0]
        result["decode"] = [streamer.times[-1] - streamer.times[0]]
    return result


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()


# --------------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------------


def median_run(fn, repeat: int) -> tuple[dict, list[dict]]:
    runs = [fn() for _ in range(repeat)]
    key = (lambda r: r["wall"])
    ordered = sorted(runs, key=key)
    return ordered[len(ordered) // 2], runs


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        same += n
        total += max(len(x), len(y))
    return same / total if total else 1.0


def bench_dtype(args, model_dir: Path, dtype_name: str, prompts: list[list[int]]) -> dict:
    from qil_worker import Engine, Qwen3

    dtype = DTYPES[dtype_name]
    n_new, batch = args.new_tokens, args.batch
    single, multi = prompts[:1], prompts[:batch]
    pages_needed = batch * -(-(args.prompt_len + n_new) // args.page_size)

    t = time.perf_counter()
    qil_model = Qwen3.from_directory(model_dir, device="cpu", dtype=dtype, quantize=args.quantize)
    hf_model = load_hf(model_dir, dtype)
    print(f"bench[{dtype_name}]: models loaded in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
    extra = {}
    if _engine_takes(Engine, "prefix_cache"):
        # the same prompts run several times (warm-up, single, batch, repeats): a prefix cache
        # would skip their prefill, which transformers cannot; measure the compute instead
        extra["prefix_cache"] = args.prefix_cache
    engine = Engine(
        qil_model, num_pages=pages_needed + 8, page_size=args.page_size, token_budget=args.token_budget,
        prefill_chunk=args.prefill_chunk, max_active=max(batch, 1), **extra,
    )

    for _ in range(args.warmup):  # small run through every code path of both systems
        warm = [p[: min(16, len(p))] for p in multi[:2]]
        qil_run(engine, warm[:1], 4)
        qil_run(engine, warm, 4)
        hf_run(hf_model, warm[:1], 4)
        hf_run(hf_model, warm, 4)

    out: dict = {"dtype": dtype_name if args.quantize == "none" else f"{dtype_name}+{args.quantize}"}

    def phase(label, fn):
        t = time.perf_counter()
        r, runs = median_run(fn, args.repeat)
        print(f"bench[{dtype_name}]: {label} {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
        return r, runs

    q1, _ = phase("qil single", lambda: qil_run(engine, single, n_new))
    h1, _ = phase("transformers single", lambda: hf_run(hf_model, single, n_new))
    qb, _ = phase("qil batch", lambda: qil_run(engine, multi, n_new))
    hb, _ = phase("transformers batch", lambda: hf_run(hf_model, multi, n_new))

    def decode_tps(r):
        return (n_new - 1) / r["decode"][0] if n_new > 1 and r["decode"][0] > 0 else float("nan")

    out["single"] = {
        "qil": {"ttft_s": q1["ttft"][0], "decode_tok_s": decode_tps(q1), "wall_s": q1["wall"]},
        "transformers": {"ttft_s": h1["ttft"][0], "decode_tok_s": decode_tps(h1), "wall_s": h1["wall"]},
        "token_agreement": agreement(q1["tokens"], h1["tokens"]),
    }
    s = out["single"]
    s["ratio_ttft"] = s["transformers"]["ttft_s"] / s["qil"]["ttft_s"]
    s["ratio_decode"] = s["qil"]["decode_tok_s"] / s["transformers"]["decode_tok_s"]
    out["batch"] = {
        "qil": {"output_tok_s": batch * n_new / qb["wall"], "wall_s": qb["wall"],
                "mean_ttft_s": statistics.mean(qb["ttft"])},
        "transformers": {"output_tok_s": batch * n_new / hb["wall"], "wall_s": hb["wall"]},
        "token_agreement": agreement(qb["tokens"], hb["tokens"]),
    }
    b = out["batch"]
    b["ratio_output_tok_s"] = b["qil"]["output_tok_s"] / b["transformers"]["output_tok_s"]
    out["qil_batch_vs_single_tokens_equal"] = qb["tokens"][0] == q1["tokens"][0]

    engine.close()
    del engine, qil_model, hf_model
    gc.collect()
    return out


def print_table(results: list[dict], args) -> None:
    print()
    print(f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, batch {args.batch}, "
          f"{torch.get_num_threads()} threads; ratio > 1 means qil is better")
    header = f"{'dtype':9s} {'metric':28s} {'qil':>12s} {'transformers':>13s} {'ratio':>7s}"
    print(header)
    print("-" * len(header))
    for r in results:
        s, b = r["single"], r["batch"]
        rows = [
            ("(a) TTFT [ms]", s["qil"]["ttft_s"] * 1e3, s["transformers"]["ttft_s"] * 1e3, s["ratio_ttft"]),
            ("(a) decode [tok/s]", s["qil"]["decode_tok_s"], s["transformers"]["decode_tok_s"], s["ratio_decode"]),
            (f"(b) x{args.batch} output [tok/s]", b["qil"]["output_tok_s"], b["transformers"]["output_tok_s"],
             b["ratio_output_tok_s"]),
        ]
        for name, q, h, ratio in rows:
            print(f"{r['dtype']:9s} {name:28s} {q:12.2f} {h:13.2f} {ratio:7.2f}")
        print(f"{r['dtype']:9s} {'greedy token agreement':28s} single {s['token_agreement']:.2f}, "
              f"batch {b['token_agreement']:.2f}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None,
                   help="random model cache (default ~/.cache/qil/bench-qwen3-0.6b-shape; "
                        "a temporary dir with --quick)")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPES))
    p.add_argument("--quick", action="store_true", help="tiny model and lengths: a smoke test")
    p.add_argument("--warmup", type=int, default=1, help="warm-up rounds per system (default %(default)s)")
    p.add_argument("--repeat", type=int, default=1, help="runs per measurement; the median is kept")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (16 with --quick)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (8 with --quick)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="qil's weights: int8 = quantized at load (transformers stays unquantized)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default %(default)s)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--token-budget", type=int, default=512, help="qil engine (default %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="qil engine (default %(default)s)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="leave qil's prefix cache on (off by default: prompts repeat across runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.prompt_len is None:
        args.prompt_len = 16 if args.quick else 128
    if args.new_tokens is None:
        args.new_tokens = 8 if args.quick else 64
    if min(args.prompt_len, args.new_tokens, args.batch, args.repeat) < 1 or args.warmup < 0:
        p.error("lengths, --batch and --repeat must be >= 1, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from qil_worker import cpu_memory

    cpu_memory.configure_process("cpu")
    torch.set_num_threads(args.threads)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    tmp = None
    if args.model_dir is None:
        if args.quick:
            tmp = tempfile.TemporaryDirectory(prefix="qil-bench-quick-")
            args.model_dir = Path(tmp.name) / "model"
        else:
            args.model_dir = Path(os.path.expanduser("~/.cache/qil/bench-qwen3-0.6b-shape"))
    args.model_dir.parent.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(args.model_dir, shape)

    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, shape["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    results = [bench_dtype(args, model_dir, d, prompts) for d in args.dtype]
    print_table(results, args)
    if args.json:
        meta = {
            "model_dir": str(model_dir), "shape": shape, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens, "batch": args.batch, "threads": torch.get_num_threads(),
            "warmup": args.warmup, "repeat": args.repeat, "torch": torch.__version__,
            "engine": {"page_size": args.page_size, "token_budget": args.token_budget,
                       "prefill_chunk": args.prefill_chunk, "prefix_cache": args.prefix_cache,
                       "quantize": args.quantize},
        }
        args.json.write_text(json.dumps({"config": meta, "results": results}, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
