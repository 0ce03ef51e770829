"""Random models built in memory, for benchmarks of shapes too large to write as a checkpoint
(Qwen3-30B-A3B's 61 GB in bf16 would not fit the GPU machine's disk beside anything else).

Only qil can run them (transformers reads checkpoints): the weights are drawn on the device, as
``bench_engine.ensure_model`` draws a checkpoint's (normal, std 0.02; norms 1; the router wider
so that routing is not decided by rounding).
"""

from __future__ import annotations

import torch

# Qwen3-30B-A3B's config.json (its 2507 and Coder variants share the shape)
MOE_30B_A3B = dict(
    model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
    intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[],
)
# the same ratios at a size a CPU test runs in seconds
MOE_QUICK = dict(
    MOE_30B_A3B, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32,
)
SHAPES = {"qwen3-30b-a3b": MOE_30B_A3B, "moe-quick": MOE_QUICK}
ROUTER_STD = 0.5


@torch.no_grad()
def random_model(shape: dict, device: str, dtype: torch.dtype):
    """A ``Qwen3`` of ``shape`` (a config.json's fields) with random weights, ready to run."""
    from qil_worker.config import Qwen3Config
    from qil_worker.model import Qwen3

    torch.manual_seed(0)
    model = Qwen3(Qwen3Config.from_dict(shape), device=device, dtype=dtype)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, ROUTER_STD if name.endswith("mlp.gate.weight") else 0.02)
    model.pack_weights()  # (CPU only: oneDNN)
    return model.eval()
