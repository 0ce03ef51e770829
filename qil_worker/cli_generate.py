"""``python -m qil_worker generate``: one prompt through the in-process engine, streamed."""

from __future__ import annotations

import argparse
import json
import sys

from qil_client import constraints, options
from qil_client.cli_help import DefaultsHelpFormatter
from qil_worker.cli_args import positive_int
from qil_worker.errors import QilError
from qil_worker.quantization import QUANTIZE_CHOICES


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The per-request generation flags, shared by every command that submits requests (the
    sampling flags, and the client CLI's, come from ``qil_client.options``)."""
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate at most")
    p.add_argument("--stop-token-ids", default=None, help="JSON list of extra stop ids (default: none)")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    options.add_flags(p, options.SAMPLING)
    options.add_logit_bias_flag(p)


def sampling_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """Only the flags the user gave, so the engine's defaults apply to the rest."""
    kwargs = options.given(args, options.SAMPLING)
    if args.logit_bias:
        kwargs["logit_bias"] = dict(args.logit_bias)
    return kwargs


def parse_token_list(text: str, flag: str) -> list[int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise SystemExit(f"{flag}: expected a JSON list of integers, got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise SystemExit(f"{flag}: expected a JSON list of integers, got {text!r}")
    return value


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="generate in-process (no server), streaming output",
        description="Generate from one prompt in this process (no server), streaming the output. "
        "Without --model, uses the embedded demo model (random weights, meaningless outputs), as "
        "serve does.",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None,
                   help="Qwen3 model directory (config.json + safetensors; default: the embedded demo)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--token-ids", help="prompt as a JSON list of token ids, e.g. '[1,2,3]'")
    src.add_argument("--prompt", help="prompt text, tokenized with the model directory's tokenizer")
    p.add_argument("--chat", action="store_true", help="send --prompt as a user chat message")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    add_sampling_arguments(p)
    constraints.add_flags(p)
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16, float16, auto")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                   help="int8: store the linear weights as per-channel int8 at load; int4 / int4-g32: "
                   "group-wise 4-bit (groups of 128 / 32 inputs); none: as loaded")
    p.add_argument("--no-compile", action="store_true",
                   help="do not compile the CPU kernels that measure faster compiled (int8 MoE experts)")
    p.add_argument("--compile-decode", action="store_true",
                   help="CPU: decode a lone request through the model's compiled forward (compiling "
                   "first takes minutes for a real model)")
    p.add_argument("--num-pages", type=positive_int, default=512, help="KV cache pages")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead")
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from qil_worker.cpu_memory import configure_process
    from qil_worker.engine import Engine
    from qil_worker.model import Qwen3
    from qil_worker.text import load_tokenizer
    from qil_worker.text.tokenizer import has_tokenizer_files

    if args.chat and args.prompt is None:
        print("error: --chat goes with --prompt (a text to send as a user message)", file=sys.stderr)
        return 2
    configure_process(args.device)
    try:
        if args.model is None:
            from qil_worker.model.demo import ensure_demo_model

            args.model = str(ensure_demo_model())
            print("qil: no --model: the embedded DEMO model (random weights, meaningless outputs)",
                  file=sys.stderr)
        tokenizer_dir = args.tokenizer or args.model
        tokenizer = None
        constraint = constraints.from_args(args)  # needs a tokenizer too
        if args.prompt is not None or args.stop or args.tokenizer or constraint:
            tokenizer = load_tokenizer(tokenizer_dir)
        elif has_tokenizer_files(tokenizer_dir):
            tokenizer = load_tokenizer(tokenizer_dir)
        model = Qwen3.from_directory(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize,
                                     compile=not args.no_compile)
        engine = Engine(model, num_pages=args.num_pages, page_size=args.page_size, tokenizer=tokenizer,
                        compile_decode=args.compile_decode)
        prompt: dict[str, object]
        if args.token_ids is not None:
            prompt = {"token_ids": parse_token_list(args.token_ids, "--token-ids")}
        elif args.chat:
            prompt = {"messages": [{"role": "user", "content": args.prompt}]}
        else:
            prompt = {"text": args.prompt}
        stops = parse_token_list(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids else None
        rid = engine.submit(
            **prompt, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
            stop_strings=args.stop, **sampling_kwargs(args), **constraint,
        )
        while not engine.idle:
            for event in engine.step():
                if args.json or event.sample_index:  # (more samples: printed after the first)
                    continue
                if event.text is not None:
                    print(event.text, end="", flush=True)
                elif event.token_id is not None:
                    print(event.token_id, end=" ", flush=True)
        results = engine.results(rid)
    except QilError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # as the client CLI: every sample must end by stop or length
    failed = 1 if any(r.finish_reason.value not in ("stop", "length") for r in results) else 0
    if args.json:
        out = _summary(results[0])
        if len(results) > 1:
            out["samples"] = [{"sample_index": i, **_summary(r)} for i, r in enumerate(results)]
        print(json.dumps(out))
        return failed
    for i, result in enumerate(results):
        if i:
            print(f"\n--- sample {i} ---")
            print(result.output_text if result.output_text is not None else "", end="")
        _print_summary(result)
    return failed


def _summary(result) -> dict[str, object]:
    """One engine ``Result`` as the JSON output's fields."""
    return {"output_token_ids": result.output_token_ids, "text": result.output_text, **_metrics(result)}


def _metrics(result) -> dict[str, object]:
    return {
        "finish_reason": result.finish_reason.value,
        "stop_reason": result.stop_reason,
        "prompt_tokens": len(result.prompt_token_ids),
        "output_tokens": len(result.output_token_ids),
        "ttft_s": result.ttft,
        "completion_time_s": result.completion_time,
        "mean_inter_token_latency_s": result.mean_inter_token_latency,
    }


def _print_summary(result) -> None:
    metrics = _metrics(result)
    itl = metrics["mean_inter_token_latency_s"]
    print()
    print(f"tokens: {result.output_token_ids}")
    print(
        f"finish: {metrics['finish_reason']}  prompt {metrics['prompt_tokens']} / output "
        f"{metrics['output_tokens']} tokens  TTFT {result.ttft:.3f}s  total {result.completion_time:.3f}s"
        + (f"  ITL {itl * 1000:.1f}ms" if itl is not None else "")
        + (f"  error: {result.error}" if result.error else "")
    )
