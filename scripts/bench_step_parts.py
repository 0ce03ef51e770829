"""Where one decode step's time goes: the step as the engine runs it, against the same step with
one part of every layer taken out, interleaved step by step in one engine.

Timing only: a step with a part taken out computes wrong values, and nothing reads them. The
variants (each replaces one piece of ``qil_worker.model`` for its steps, and puts it back):

  full              the engine's step, unchanged
  no norms          every RMSNorm (the layers', the final one) and QK norm returns its input
  no rope           the rotary embedding returns its input
  no attention      the KV write and the attention skipped: the queries go to o_proj as they are
  projections only  each layer only its projections, chained by the residual adds, a slice and
                    the gate-up product; embedding, final norm, LM head, sampling and the host
                    work as in the full step. The floor of a step made of eager operators: what
                    the matmuls cost where they run, with caches as cold as the step leaves them

A part's cost is full − variant. At batch 1 every variant streams all the weights, so the
small operations after each matmul run on cold caches, as they do in the real step: a part
measured on its own, warm, costs several times less. Variants take turns in every round (the
order reversed in odd rounds), so drift of a shared machine and the growing context hit all of
them alike; the table gives medians over rounds.

    python scripts/bench_step_parts.py --dtype bfloat16 --threads 2
    python scripts/bench_step_parts.py --dtype bfloat16 --quantize int8 --threads 2
    python scripts/bench_step_parts.py --dtype float32 --batch 8
    python scripts/bench_step_parts.py --variants full "projections only"
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import FULL_SHAPE, QUICK_SHAPE, ensure_model  # noqa: E402


def no_norms():
    from qil_worker.model.layers import QKNorm, RMSNorm

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(RMSNorm, "forward", lambda self, x: x))
    stack.enter_context(mock.patch.object(QKNorm, "forward", lambda self, qk: qk))
    return stack


def no_rope():
    from qil_worker.model import qwen3

    return mock.patch.object(qwen3, "apply_rope", lambda x, cos, sin: x)


def _queries(layer, x, rope):
    """The layer's input norm, projections, QK norm and rope as the engine runs them: → the
    query heads as o_proj takes them, [T, q_size]."""
    from qil_worker.model import qwen3

    tokens = x.shape[0]
    h = layer.input_norm(x)
    if layer.fused:
        qk = layer.qkv_proj(h)[:, : layer.split[0]]  # queries and keys, not values
    else:
        qk, _ = layer.qk_proj(h), layer.v_proj(h)
    heads = qk.reshape(tokens, layer.num_heads + layer.num_kv_heads, layer.head_dim)
    q = qwen3.apply_rope(layer.qk_norm(heads), *rope)[:, : layer.num_heads]
    return q.reshape(tokens, layer.q_size)


def no_attention():
    from qil_worker.model.qwen3 import DecoderLayer

    def forward(self, x, rope, attention, kv):
        x = x + self.o_proj(_queries(self, x, rope))
        return x + self.mlp(self.post_attention_norm(x))

    return mock.patch.object(DecoderLayer, "forward", forward)


def projections_only():
    from qil_worker.model.qwen3 import DecoderLayer

    def forward(self, x, rope, attention, kv):
        if self.fused:
            q = self.qkv_proj(x)[:, : self.q_size]
        else:
            q = self.qk_proj(x)[:, : self.q_size]
            self.v_proj(x)
        x = x + self.o_proj(q)
        mlp = self.mlp
        if mlp.fused:
            gate, up = mlp.gate_up_proj(x).split(mlp.intermediate, dim=-1)
        else:
            gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        return x + mlp.down_proj(gate * up)

    return mock.patch.object(DecoderLayer, "forward", forward)


VARIANTS = {
    "full": contextlib.nullcontext,
    "no norms": no_norms,
    "no rope": no_rope,
    "no attention": no_attention,
    "projections only": projections_only,
}


def measure(model, batch: int, prompt_len: int, rounds: int, steps: int, page_size: int,
            names: list[str]) -> dict[str, list[float]]:
    """Seconds per step of each variant in ``names``, one sample per round."""
    from qil_worker import Engine

    new_tokens = rounds * len(names) * (steps + 1) + 8
    pages = batch * (-(-(prompt_len + new_tokens) // page_size)) + 8
    engine = Engine(model, num_pages=pages, page_size=page_size, token_budget=max(4096, batch * prompt_len),
                    prefill_chunk=prompt_len, max_active=batch, prefix_cache=False)
    vocab = model.config.vocab_size
    for b in range(batch):
        engine.submit([(b * 131 + i * 7) % vocab for i in range(prompt_len)], max_new_tokens=new_tokens,
                      ignore_eos=True)
    started: set[str] = set()
    while len(started) < batch:
        started.update(e.request_id for e in engine.step() if e.token_id is not None)
    engine.step()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            with VARIANTS[name]():
                engine.step()  # the first step after a switch pays for it
                t0 = time.perf_counter()
                for _ in range(steps):
                    events = engine.step()
                    assert len(events) == batch, f"expected {batch} decode events, got {len(events)}"
                samples[name].append((time.perf_counter() - t0) / steps)
    engine.close()
    return samples


def report(samples: dict[str, list[float]], batch: int) -> list[str]:
    full = statistics.median(samples["full"]) if "full" in samples else None
    lines = [f"{'variant':<18}{'ms/step':>9}{'tok/s':>8}{'part costs ms':>15}{'of the step':>13}"]
    for name, values in samples.items():
        ms = statistics.median(values)
        cost = "" if name == "full" or full is None else f"{1000 * (full - ms):>15.2f}{(full - ms) / full:>13.0%}"
        lines.append(f"{name:<18}{1000 * ms:>9.2f}{batch / ms:>8.1f}{cost}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantize", choices=("int8",), default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="the variants to time (default: all)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant and round")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    args = p.parse_args(argv)
    from qil_worker import cpu_memory

    cpu_memory.configure_process("cpu")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from qil_worker import Qwen3

    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    default = Path.home() / ".cache" / "qil" / ("bench-quick" if args.quick else "bench-qwen3-0.6b-shape")
    model = Qwen3.from_directory(ensure_model(args.model_dir or default, shape), dtype=args.dtype,
                                 quantize=args.quantize)
    samples = measure(model, args.batch, args.prompt_len, args.rounds, args.steps, args.page_size, args.variants)
    print(f"decode step parts, {model.dtype}{' int8' if args.quantize else ''} on cpu, batch {args.batch}, "
          f"prompt {args.prompt_len}, {torch.get_num_threads()} threads, {args.rounds} rounds x {args.steps} steps")
    print("\n".join(report(samples, args.batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
