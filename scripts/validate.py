#!/usr/bin/env python
"""Check qil against transformers' Qwen3ForCausalLM on one model directory.

Cases (all on random prompts drawn with a fixed seed from the model's vocabulary):

  prefill   every prompt prefilled in ONE step (a padded multi-request group); logits at every
            prompt position are compared with the reference's full-sequence forward.
  decode    token by token: each step feeds one token of every unfinished prompt (a decode
            group of requests with different context lengths); logits at each step compared.
  chunked   irregular chunked prefill: each prompt is fed in chunks of 3,1,7,5,2,11,... tokens
            (offset per prompt, so one step mixes single-token and multi-token chunks).
  generate  Engine.generate over all prompts at once (continuous batching, chunked prefill
            mixed with decodes) against transformers' greedy ``generate`` run per prompt.
            Sequences are compared up to and including the first EOS (qil's config EOS ids or
            the reference generation_config's, whichever comes first).

Pass criteria (exit status 0 when every case passes, 1 otherwise):

  logits    max |qil - reference| over all compared positions <= tolerance, where
              float32:           1e-4 for small models (hidden_size <= 256), 1e-3 otherwise
              bfloat16/float16:  --rel-tol (default 2e-2 bf16, 5e-3 fp16) x max(1, max |ref logit|)
            (``--atol`` replaces the default for every dtype).
  tokens    float32: argmax / greedy tokens must agree exactly.
            bfloat16/float16: a disagreement is accepted only at a near-tie, i.e. where qil's
            token is within the logits tolerance of the reference's best logit (for
            ``generate``, checked at the first divergence, after which sequences are not
            compared).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from qil_worker import Engine, Qwen3
from qil_worker.errors import QilError
from qil_worker.engine.probe import ForwardProbe

CASES = ("prefill", "decode", "chunked", "generate")
CHUNK_PATTERN = (3, 1, 7, 5, 2, 11, 1, 4, 9, 6)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


# --------------------------------------------------------------------------------------------
# qil, driven one step at a time with chosen chunks and logits at every position
# (ForwardProbe runs the engine's own batch building, paged KV writes and forward)
# --------------------------------------------------------------------------------------------


def run_schedule(probe: ForwardProbe, prompts: list[list[int]], chunk_sizes) -> list[torch.Tensor]:
    """Feed every prompt concurrently, ``chunk_sizes(i)`` yielding prompt ``i``'s chunk sizes;
    return each prompt's float32 logits [L, V] (on the host)."""
    requests = [probe.sequence(p) for p in prompts]
    sizes = [iter(chunk_sizes(i)) for i in range(len(prompts))]
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    try:
        while True:
            work = []
            for i, r in enumerate(requests):
                left = r.num_tokens - r.num_computed_tokens
                if left:
                    work.append((i, r, min(next(sizes[i]), left)))
            if not work:
                break
            outs = probe.forward([(r, n) for _, r, n in work])
            for (i, _, _), out in zip(work, outs):
                pieces[i].append(out.cpu())
    finally:
        for r in requests:
            probe.release(r)
    return [torch.cat(p) for p in pieces]


# --------------------------------------------------------------------------------------------
# the reference
# --------------------------------------------------------------------------------------------


def load_reference(path: str, dtype: torch.dtype, attn: str, device: str):
    import transformers
    from transformers import Qwen3ForCausalLM

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    try:
        model = Qwen3ForCausalLM.from_pretrained(path, **{key: dtype}, attn_implementation=attn)
    except TypeError:
        model = Qwen3ForCausalLM.from_pretrained(path, torch_dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


@torch.inference_mode()
def reference_logits(ref, prompt: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt], dtype=torch.long, device=ref.device)
    return ref(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float().cpu()


def reference_eos_ids(ref) -> set[int]:
    eos = getattr(getattr(ref, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(ref.config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


@torch.inference_mode()
def reference_generate(ref, prompt: list[int], max_new_tokens: int, pad_id: int):
    ids = torch.tensor([prompt], dtype=torch.long, device=ref.device)
    out = ref.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        return_dict_in_generate=True,
        output_logits=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = [step[0].float().cpu() for step in out.logits]
    return tokens, logits


# --------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------


@dataclass
class Tolerance:
    dtype: torch.dtype
    atol: float | None  # fixed absolute tolerance, or None for rel_tol x logit scale
    rel_tol: float | None
    exact_tokens: bool

    def for_scale(self, max_abs_ref: float) -> float:
        if self.atol is not None:
            return self.atol
        return self.rel_tol * max(1.0, max_abs_ref)

    def describe(self) -> str:
        if self.atol is not None:
            return f"max abs err <= {self.atol:g}"
        return f"max abs err <= {self.rel_tol:g} x max(1, max|ref logit|)"


def make_tolerance(args, dtype: torch.dtype, hidden_size: int) -> Tolerance:
    exact = dtype == torch.float32
    if args.atol is not None:
        return Tolerance(dtype, args.atol, None, exact)
    if dtype == torch.float32:
        return Tolerance(dtype, 1e-4 if hidden_size <= 256 else 1e-3, None, exact)
    rel = args.rel_tol if args.rel_tol is not None else DEFAULT_REL_TOL[dtype]
    return Tolerance(dtype, None, rel, exact)


def compare_logits(name: str, ours: list[torch.Tensor], refs: list[torch.Tensor], tol: Tolerance) -> dict:
    max_ref = max(float(r.abs().max()) for r in refs)
    limit = tol.for_scale(max_ref)
    per_prompt, errs, total, agree, bad = [], [], 0, 0, 0
    for i, (o, r) in enumerate(zip(ours, refs)):
        if o.shape != r.shape:
            raise RuntimeError(f"{name}: prompt {i}: logits shape {tuple(o.shape)} != reference {tuple(r.shape)}")
        err = float((o - r).abs().max())
        errs.append(err)
        ours_top, ref_top = o.argmax(-1), r.argmax(-1)
        same = ours_top == ref_top
        # a disagreement is a near-tie when our choice is within the tolerance of the ref's best
        gap = r.max(-1).values - r.gather(-1, ours_top[:, None])[:, 0]
        unacceptable = (~same) & (gap > (0.0 if tol.exact_tokens else limit))
        n_same = int(same.sum())
        total += len(same)
        agree += n_same
        bad += int(unacceptable.sum())
        per_prompt.append(
            {
                "prompt_index": i,
                "length": len(same),
                "max_abs_err": err,
                "mean_abs_err": float((o - r).abs().mean()),
                "argmax_agree": n_same,
                "first_disagreement": None if bool(same.all()) else int((~same).nonzero()[0, 0]),
            }
        )
    max_err = max(errs)
    return {
        "max_abs_err": max_err,
        "max_abs_ref_logit": max_ref,
        "tolerance": limit,
        "positions": total,
        "argmax_agree": agree,
        "token_agreement": agree / total,
        "unacceptable_disagreements": bad,
        "logits_ok": max_err <= limit,
        "tokens_ok": bad == 0,
        "passed": max_err <= limit and bad == 0,
        "per_prompt": per_prompt,
    }


def truncate_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def compare_generations(ours, refs, ref_logits, eos: set[int], tol: Tolerance) -> dict:
    per_prompt, all_ok, total, agree = [], True, 0, 0
    for i, (o, r, rl) in enumerate(zip(ours, refs, ref_logits)):
        o, r = truncate_at_eos(o, eos), truncate_at_eos(r, eos)
        n = min(len(o), len(r))
        first = next((j for j in range(n) if o[j] != r[j]), None)
        if first is None and len(o) != len(r):
            first = n  # one stopped (EOS) where the other did not
        compared = len(r) if first is None else first
        total += max(len(o), len(r))
        agree += compared
        ok = first is None
        note = None
        if not ok and not tol.exact_tokens and first < len(o) and first < len(rl):
            step = rl[first]
            gap = float(step.max() - step[o[first]])
            limit = tol.for_scale(float(step.abs().max()))
            ok = gap <= limit
            note = f"diverged at a {'near-tie' if ok else 'clear choice'}: ref logit gap {gap:.4g} (limit {limit:.4g})"
        all_ok &= ok
        per_prompt.append(
            {
                "prompt_index": i,
                "qil_tokens": o,
                "reference_tokens": r,
                "first_divergence": first,
                "passed": ok,
                **({"note": note} if note else {}),
            }
        )
    return {
        "tokens_compared": total,
        "tokens_agree": agree,
        "token_agreement": agree / total if total else 1.0,
        "passed": all_ok,
        "per_prompt": per_prompt,
    }


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="Qwen3 model directory (config.json + safetensors)")
    p.add_argument("--reference", help=argparse.SUPPRESS)  # testing: compare against another dir
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--output", help="write the JSON report here")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument(
        "--prompt-lengths", default="1,5,16,17,40,73",
        help="comma-separated prompt lengths (default %(default)s)",
    )
    p.add_argument("--max-new-tokens", type=int, default=16, help="for the generate case (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed (default %(default)s)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=0, help="KV pages (default: enough for all prompts)")
    p.add_argument("--token-budget", type=int, default=48, help="engine token budget in the generate case")
    p.add_argument("--prefill-chunk", type=int, default=24, help="engine prefill chunk in the generate case")
    p.add_argument("--atol", type=float, help="fixed absolute logits tolerance for any dtype")
    p.add_argument("--rel-tol", type=float, help="bf16/fp16 tolerance relative to max(1, max|ref logit|)")
    p.add_argument(
        "--attn-implementation", default="sdpa", choices=("sdpa", "eager"),
        help="transformers attention implementation of the reference (default %(default)s)",
    )
    p.add_argument("--threads", type=int, help="torch.set_num_threads")
    args = p.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not args.cases:
        p.error("--cases: need at least one case")
    for c in args.cases:
        if c not in CASES:
            p.error(f"--cases: unknown case {c!r}; choose from {', '.join(CASES)}")
    try:
        args.prompt_lengths = [int(x) for x in args.prompt_lengths.split(",") if x.strip()]
    except ValueError:
        p.error("--prompt-lengths: expected comma-separated integers")
    if not args.prompt_lengths or min(args.prompt_lengths) < 1:
        p.error("--prompt-lengths: need at least one length, each >= 1")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    return args


def make_prompts(lengths: list[int], vocab: int, avoid: set[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        prompts.append([t if t not in avoid else (t + 1) % vocab for t in ids])
    return prompts


def main(argv=None) -> int:
    args = parse_args(argv)
    from qil_worker import cpu_memory

    cpu_memory.configure_process(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    ref_dir = args.reference or args.model
    t0 = time.perf_counter()

    try:
        model = Qwen3.from_directory(args.model, device=args.device, dtype=dtype)
    except QilError as exc:  # a bad directory, config or device: one line, as the CLI does
        print(f"validate: {exc}", file=sys.stderr)
        return 2
    ref = load_reference(ref_dir, dtype, args.attn_implementation, args.device)
    c = model.config
    if max(args.prompt_lengths) + args.max_new_tokens > c.max_position_embeddings:
        print("validate: prompt length + max new tokens exceeds max_position_embeddings", file=sys.stderr)
        return 2
    tol = make_tolerance(args, dtype, c.hidden_size)
    qil_eos = set(c.eos_token_ids)
    eos = qil_eos | reference_eos_ids(ref)
    prompts = make_prompts(args.prompt_lengths, c.vocab_size, eos, args.seed)
    page = args.page_size
    num_pages = args.num_pages or sum(-(-(n + args.max_new_tokens) // page) for n in args.prompt_lengths) + 4

    report: dict = {
        "model": str(args.model),
        "reference": str(ref_dir),
        "device": args.device,
        "dtype": args.dtype,
        "reference_attn_implementation": args.attn_implementation,
        "prompt_lengths": args.prompt_lengths,
        "seed": args.seed,
        "tolerance_rule": tol.describe(),
        "token_rule": "exact" if tol.exact_tokens else "exact except at near-ties (gap <= tolerance)",
        "cases": {},
    }
    print(f"validate: {args.model} ({args.dtype}, {args.device}); tolerance: {tol.describe()}")

    refs = None
    if any(name in args.cases for name in ("prefill", "decode", "chunked")):
        refs = [reference_logits(ref, p) for p in prompts]
    probe = ForwardProbe(model, num_pages=num_pages, page_size=page)
    schedules = {
        "prefill": lambda i: itertools.repeat(10**9),
        "decode": lambda i: itertools.repeat(1),
        "chunked": lambda i: itertools.cycle(CHUNK_PATTERN[i % len(CHUNK_PATTERN) :] + CHUNK_PATTERN[: i % len(CHUNK_PATTERN)]),
    }
    for name in CASES:
        if name not in args.cases:
            continue
        t = time.perf_counter()
        if name == "generate":
            engine = Engine(
                model, num_pages=num_pages, page_size=page, token_budget=args.token_budget,
                prefill_chunk=args.prefill_chunk, max_active=len(prompts),
            )
            results = engine.generate(prompts, max_new_tokens=args.max_new_tokens)
            engine.close()
            pad = min(eos) if eos else 0
            ref_out = [reference_generate(ref, p, args.max_new_tokens, pad) for p in prompts]
            case = compare_generations(
                [r.output_token_ids for r in results], [t for t, _ in ref_out], [l for _, l in ref_out], eos, tol
            )
            case["max_new_tokens"] = args.max_new_tokens
            case["eos_ids"] = sorted(eos)
        else:
            ours = run_schedule(probe, prompts, schedules[name])
            case = compare_logits(name, ours, refs, tol)
        case["seconds"] = round(time.perf_counter() - t, 3)
        report["cases"][name] = case
        if "max_abs_err" in case:
            detail = (
                f"max abs err {case['max_abs_err']:.3g} (tol {case['tolerance']:.3g}), "
                f"argmax agreement {case['argmax_agree']}/{case['positions']}"
            )
        else:
            detail = f"greedy tokens agree {case['tokens_agree']}/{case['tokens_compared']}"
        print(f"  {name:9s} {'PASS' if case['passed'] else 'FAIL'}  {detail}  [{case['seconds']:.1f}s]")

    report["passed"] = all(case["passed"] for case in report["cases"].values())
    report["seconds"] = round(time.perf_counter() - t0, 3)
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"validate: {'PASS' if report['passed'] else 'FAIL'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
