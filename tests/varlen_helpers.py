"""A slow stand-in for torch's varlen flash kernel (CUDA only), so the packed attention path
runs on any device in tests: same contract, one request at a time through SDPA."""

import torch
import torch.nn.functional as F

from qil_worker.model import varlen


def reference_kernel(q, k, v, meta):
    """What ``varlen_attn`` computes for packed keys, one request at a time."""
    cu_q, cu_k = meta.cu_seq_q.tolist(), meta.cu_seq_k.tolist()
    assert k.shape[0] >= cu_k[-1] and q.shape[0] == cu_q[-1]
    groups = q.shape[1] // k.shape[1]
    out = []
    for r in range(len(cu_q) - 1):
        n_q, n_k = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        assert n_q <= meta.max_q and n_k <= meta.max_k, "the kernel's maxima must bound every request"
        queries = q[cu_q[r] : cu_q[r + 1]].transpose(0, 1)
        keys = k[cu_k[r] : cu_k[r + 1]].repeat_interleave(groups, 1).transpose(0, 1)
        values = v[cu_k[r] : cu_k[r + 1]].repeat_interleave(groups, 1).transpose(0, 1)
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
        if not meta.causal:
            mask = torch.ones_like(mask)
        out.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask.to(q.device)).transpose(0, 1))
    return torch.cat(out)


def use_reference_packed_kernel(monkeypatch) -> None:
    """Make ``attention="varlen-packed"`` selectable here, computed by ``reference_kernel``
    (the paged kernel stays unavailable, so ``auto`` still means SDPA off CUDA)."""

    def probe(device, dtype, page_size, heads, kv_heads, dim, mode=varlen.PAGED):
        return None if mode == varlen.PACKED else "only the packed reference kernel here"

    monkeypatch.setattr(varlen, "packed_kernel", reference_kernel)
    monkeypatch.setattr(varlen, "probe_varlen", probe)
