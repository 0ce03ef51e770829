"""The fused layer pieces compute exactly what transformers' Qwen3 pieces compute.

``QKNorm`` norms query and key heads in one pass and ``apply_rope`` rotates them with a swap of
halves against a pre-signed sine table; both exist to cut operations (kernel launches on CUDA),
so they must not change a single bit of the result.
"""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, rotate_half

from qil_worker.model.layers import QKNorm, RotaryEmbedding, apply_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_equals_the_reference_norms_of_queries_and_keys(dtype):
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    qk = (torch.randn(5, heads + kv_heads, dim, generator=gen) * 3).to(dtype)
    norm = QKNorm(dim, heads, 1e-6, dtype, torch.device("cpu"))
    ref_q, ref_k = Qwen3RMSNorm(dim, eps=1e-6).to(dtype), Qwen3RMSNorm(dim, eps=1e-6).to(dtype)
    with torch.no_grad():
        for ours, ref in ((norm.q_weight, ref_q.weight), (norm.k_weight, ref_k.weight)):
            ours.copy_(torch.rand(dim, generator=gen) + 0.5)
            ref.copy_(ours)
        got = norm(qk)
    assert torch.equal(got[:, :heads], ref_q(qk[:, :heads]))
    assert torch.equal(got[:, heads:], ref_k(qk[:, heads:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_the_reference_rotation(dtype):
    dim, positions = 16, torch.tensor([0, 1, 7, 300])
    rope = RotaryEmbedding(dim, 1_000_000.0, 512, dtype, torch.device("cpu"))
    x = torch.randn(4, 3, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    cos, sin_signed = rope.lookup(positions)
    # the reference's tables: cos and sin of cat(freqs, freqs), cast to the activation dtype
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    ref_cos, ref_sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    assert torch.equal(cos, ref_cos)
    assert torch.equal(apply_rope(x, cos, sin_signed), x * ref_cos + rotate_half(x) * ref_sin)
