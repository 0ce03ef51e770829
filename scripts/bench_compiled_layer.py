"""Probe: one Qwen3-0.6B-shaped decoder layer's dense regions (the ops around attention), eager
vs ``torch.compile(backend="inductor")`` on CPU, with the packed projections left opaque
(a ``torch.library.custom_op``, so dynamo does not trace into oneDNN) and attention outside.

Regions timed (attention and the KV write are identical in both, so left out):
  pre:  input norm → q/k and v projections → q/k norm → rope
  post: o projection → residual → norm → gate/up → SiLU·mul → down → residual
Eager and compiled rounds are interleaved (order alternating); the fastest round of each and the
median of the per-round ratios are reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

QWEN3_06B = dict(
    model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
    intermediate_size=3072, num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True,
)


@torch.library.custom_op("qil_probe::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A packed oneDNN linear as one opaque op."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="decode rows (tokens) per step")
    parser.add_argument("--dtype", default="bfloat16", help="activation and weight dtype")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved A/B rounds")
    parser.add_argument("--iters", type=int, default=50, help="calls per round")
    parser.add_argument("--linear", choices=("custom", "mkldnn", "outside", "freezing"), default="custom",
                        help="the projections: in the graph as our opaque custom op, or as torch's mkldnn op (inductor lowers it); "
                             "or outside: the graphs are only the element-wise pieces between projections; "
                             "or freezing: the layer's plain weights frozen into the graph, inductor packing them itself")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from qil_worker.config import Qwen3Config
    from qil_worker.model.layers import apply_rope
    from qil_worker.model.qwen3 import DecoderLayer, Qwen3

    dtype = getattr(torch, args.dtype)
    config = Qwen3Config.from_dict(QWEN3_06B)
    torch.manual_seed(0)
    layer = DecoderLayer(0, config, dtype, torch.device("cpu"))
    for name, p in layer.named_parameters():
        p.data.fill_(1.0) if "norm" in name else p.data.normal_(0, 0.02)
    plain = DecoderLayer(0, config, dtype, torch.device("cpu"))
    plain.load_state_dict(layer.state_dict())
    assert layer.pack_weights(), "packing unsupported here"
    rope_table = Qwen3(Qwen3Config.from_dict(dict(QWEN3_06B, vocab_size=16)), dtype=dtype).rope
    nq, nkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    w = {n: getattr(layer, n).weight for n in ("qk_proj", "v_proj", "o_proj")}
    w.update(gate=layer.mlp.gate_proj.weight, up=layer.mlp.up_proj.weight, down=layer.mlp.down_proj.weight)
    lin = torch.ops.qil_probe.packed_linear
    if args.linear == "mkldnn":
        def lin(x, weight):
            return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")

    def pre(x, cos, sin):
        h = layer.input_norm(x)
        qk, v = lin(h, w["qk_proj"]), lin(h, w["v_proj"])
        qk = apply_rope(layer.qk_norm(qk.view(x.shape[0], nq + nkv, d)), cos, sin)
        return qk, v

    def post(x, attn):
        x = x + lin(attn, w["o_proj"])
        h = layer.post_attention_norm(x)
        g, u = lin(h, w["gate"]), lin(h, w["up"])
        return x + lin(torch.nn.functional.silu(g) * u, w["down"])

    def model_pre(layer, x, cos, sin):  # the model's own code path
        h = layer.input_norm(x)
        qk, v = layer.qk_proj(h), layer.v_proj(h)
        return apply_rope(layer.qk_norm(qk.view(x.shape[0], nq + nkv, d)), cos, sin), v

    def model_post(layer, x, attn):
        x = x + layer.o_proj(attn)
        return x + layer.mlp(layer.post_attention_norm(x))

    def eager_pre(x, cos, sin):
        return model_pre(layer, x, cos, sin)

    def eager_post(x, attn):
        return model_post(layer, x, attn)

    class Region(torch.nn.Module):
        """A region over the plain (unpacked) layer, for inductor's freezing to pack."""

        def __init__(self, fn) -> None:
            super().__init__()
            self.layer, self.fn = plain, fn

        def forward(self, *args):
            return self.fn(self.layer, *args)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, dtype {args.dtype}, linear {args.linear}")
    def compiled(fn):
        return torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)

    def regions_between_projections():
        """(pre, post) with the projections eager and only the pieces between them compiled."""
        norm_in = compiled(layer.input_norm.forward)
        qk_rope = compiled(lambda qk, cos, sin: apply_rope(layer.qk_norm(qk), cos, sin))
        residual_norm = compiled(lambda x, o: (lambda y: (y, layer.post_attention_norm(y)))(x + o))
        silu_mul = compiled(lambda g, u: torch.nn.functional.silu(g) * u)
        mlp = layer.mlp

        def pre_(x, cos, sin):
            h = norm_in(x)
            qk, v = layer.qk_proj(h), layer.v_proj(h)
            return qk_rope(qk.view(x.shape[0], nq + nkv, d), cos, sin), v

        def post_(x, attn):
            x, h = residual_norm(x, layer.o_proj(attn))
            return x + mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
        return pre_, post_

    for batch in args.batch:
        torch._dynamo.reset()
        if args.linear == "outside":
            c_pre, c_post = regions_between_projections()
        elif args.linear == "freezing":
            torch._inductor.config.freezing = True
            c_pre, c_post = compiled(Region(model_pre).eval()), compiled(Region(model_post).eval())
        else:
            c_pre, c_post = compiled(pre), compiled(post)
        x = torch.randn(batch, config.hidden_size, dtype=dtype)
        attn = torch.randn(batch, nq * d, dtype=dtype)
        cos, sin = rope_table.lookup(torch.arange(5, 5 + batch))
        with torch.no_grad() if args.linear == "freezing" else torch.inference_mode():
            t = time.perf_counter()
            c_pre(x, cos, sin), c_post(x, attn)
            compile_s = time.perf_counter() - t
            (qk_c, v_c), y_c = c_pre(x, cos, sin), c_post(x, attn)
            (qk_e, v_e), y_e = eager_pre(x, cos, sin), eager_post(x, attn)
            diff = max((qk_c.float() - qk_e.float()).abs().max().item(), (y_c.float() - y_e.float()).abs().max().item())

            def timed(fn_pre, fn_post) -> float:
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn_pre(x, cos, sin)
                    fn_post(x, attn)
                return (time.perf_counter() - t0) / args.iters * 1e6

            eager, comp = [], []
            for r in range(args.rounds):
                order = [(eager_pre, eager_post, eager), (c_pre, c_post, comp)]
                for fp, fq, out in order if r % 2 == 0 else order[::-1]:
                    out.append(timed(fp, fq))
        # the machine is shared: each round's ratio pairs arms timed back to back, and the fastest
        # round of each arm is the least disturbed one
        ratios = sorted(c / e for e, c in zip(eager, comp))
        print(f"batch {batch}: compile {compile_s:.1f} s; per layer fastest eager {min(eager):.0f} us, "
              f"compiled {min(comp):.0f} us; compiled/eager per round median {statistics.median(ratios):.3f} "
              f"({ratios[0]:.3f}-{ratios[-1]:.3f}); max |diff| {diff:.3g}; torch threads after {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
