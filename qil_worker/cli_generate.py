"""``python -m qil_worker generate``: run prompts through the in-process engine and print them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qil_worker.errors import QilError


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate tokens in-process (no server)")
    p.add_argument("--model", required=True, help="Qwen3 model directory (config.json + safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--token-ids", help="prompt as a JSON list of token ids, e.g. '[1,2,3]'")
    src.add_argument("--prompt", help="prompt text, tokenized with the model directory's tokenizer")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--stop-token-ids", default=None, help="JSON list of extra stop ids")
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    p.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16, float16, auto")
    p.add_argument("--num-pages", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run_generate)


def _token_list(text: str, flag: str) -> list[int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise SystemExit(f"{flag}: expected a JSON list of integers, got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise SystemExit(f"{flag}: expected a JSON list of integers, got {text!r}")
    return value


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _load_tokenizer(model_dir: str):
    if not any((Path(model_dir) / name).exists() for name in TOKENIZER_FILES):
        raise SystemExit(f"--prompt: {model_dir} has no tokenizer files; pass --token-ids instead")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise SystemExit(
            "--prompt needs a tokenizer: install the text extra (pip install 'qil[text]') "
            "or pass --token-ids"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - any loading problem is reported the same way
        raise SystemExit(f"--prompt: could not load a tokenizer from {model_dir}: {exc}") from None


def run_generate(args: argparse.Namespace) -> int:
    from qil_worker.engine import Engine
    from qil_worker.model import Qwen3

    tokenizer = _load_tokenizer(args.model) if args.prompt is not None else None
    prompt = (
        tokenizer.encode(args.prompt) if tokenizer else _token_list(args.token_ids, "--token-ids")
    )
    stops = _token_list(args.stop_token_ids, "--stop-token-ids") if args.stop_token_ids else None
    try:
        model = Qwen3.from_directory(args.model, device=args.device, dtype=args.dtype)
        engine = Engine(model, num_pages=args.num_pages, page_size=args.page_size)
        (result,) = engine.generate([prompt], max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
    except QilError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    metrics = {
        "finish_reason": result.finish_reason.value,
        "prompt_tokens": len(result.prompt_token_ids),
        "output_tokens": len(result.output_token_ids),
        "ttft_s": result.ttft,
        "completion_time_s": result.completion_time,
        "mean_inter_token_latency_s": result.mean_inter_token_latency,
    }
    if args.json:
        print(json.dumps({"output_token_ids": result.output_token_ids, **metrics}))
        return 0
    print("tokens:", result.output_token_ids)
    if tokenizer is not None:
        print("text:", tokenizer.decode(result.output_token_ids))
    print(
        "finish: {finish_reason}  prompt {prompt_tokens} / output {output_tokens} tokens  "
        "TTFT {ttft_s:.3f}s  total {completion_time_s:.3f}s".format(**metrics)
        + (
            f"  ITL {metrics['mean_inter_token_latency_s'] * 1000:.1f}ms"
            if metrics["mean_inter_token_latency_s"] is not None
            else ""
        )
    )
    return 0
