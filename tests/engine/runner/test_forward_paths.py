"""Forward paths the rest of the suite reaches only at its extremes or only on CUDA, pinned here
so that a fault in them fails on any machine: CPU prefill chunks holding several requests, the
CUDA wiring of the fused projections, the paged varlen path through a reference kernel,
decode-graph edge cases, and the shared-prefix merge at large score gaps."""

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from engine_helpers import reference_greedy, run_to_completion
from varlen_helpers import use_reference_packed_kernel, use_reference_varlen
from qil_worker import Engine, Qwen3
from qil_worker.engine.runner.decode_graphs import DecodeGraphs
from qil_worker.engine.runner.graph_capture import GraphCapture
from qil_worker.engine.probe import ForwardProbe
from qil_worker.kv import KVCache
from qil_worker.attention import PACKED, PAGED, choice, cpu
from qil_worker.attention import sdpa as gather_sdpa
from qil_worker.attention.reference import reference_backend
from qil_worker.model import linear
from qil_worker.model.dtypes import resolve_dtype
from qil_worker.model.layers import RMSNorm


@pytest.fixture(scope="module")
def cpu_model(tiny_dir):
    return Qwen3.from_directory(tiny_dir, dtype="float32")


def _prompts(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("chunk_bytes, several", [(4608, True), (1000, False)])
def test_prefill_chunks_holding_several_requests_match_transformers(cpu_model, ref, monkeypatch, chunk_bytes, several):
    """Between one request per chunk and no chunking: several requests per chunk, and blocks
    that do not divide the rows."""
    prompts = _prompts(6, (30, 26, 40))
    monkeypatch.setattr(cpu, "CPU_CHUNK_BYTES", chunk_bytes)
    widths = []
    row_chunks = cpu._row_chunks

    def spy(*args):
        chunks = row_chunks(*args)
        widths.append(max(j - i for i, j in chunks))
        return chunks

    monkeypatch.setattr(cpu, "_row_chunks", spy)
    probe = ForwardProbe(cpu_model, num_pages=64, page_size=4)
    got = probe.forward([(probe.sequence(p), 12) for p in prompts])
    assert not several or max(widths) >= 2, "no chunk held several requests"
    with torch.no_grad():
        want = [ref(torch.tensor([p])).logits[0, :12] for p in prompts]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_fused_projections_as_on_cuda_match_transformers(tiny_dir, ref):
    model = Qwen3.from_directory(tiny_dir, dtype="float32", pack_weights=False, fused_projections=True)
    assert all(layer.fused for layer in model.layers)
    ids = _prompts(1, (20,))[0]
    probe = ForwardProbe(model, num_pages=16, page_size=4)
    (got,) = probe.forward([(probe.sequence(ids), len(ids))])
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_the_cuda_attention_wiring_run_on_a_cpu_matches_transformers(tiny_dir, ref, monkeypatch, cuda_graphs):
    """What CUDA runs (fused projections; keys gathered by slot, no shared-prefix split, SDPA
    with the step's additive mask for prefill chunks and decode rows; with ``cuda_graphs`` the
    padded decode body that graphs capture), on a CPU: the CPU's own kernels never take it."""
    monkeypatch.setattr(choice, "cpu_kernels", lambda device: False)
    chosen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        chosen.append(q.shape[2])
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(gather_sdpa.F, "scaled_dot_product_attention", spy)
    for cpu_only in ("_decode_by_matmuls", "_decode_by_sdpa", "_prefill_by_matmuls", "_prefix_partial"):
        monkeypatch.setattr(cpu, cpu_only, None)  # (calling one would raise)
    model = Qwen3.from_directory(tiny_dir, dtype="float32", pack_weights=False, fused_projections=True)
    engine = Engine(model, num_pages=64, page_size=4, token_budget=40, prefill_chunk=24, cuda_graphs=cuda_graphs)
    assert type(engine.runner.attention) is gather_sdpa.GatherSdpa and engine.attention_backend == "sdpa"
    shared = _prompts(3, (13,))[0]  # a cached prefix: the CPU path would attend it apart
    prompts = _prompts(4, (5, 31, 17)) + [shared + [7, 8], shared + [9]]
    ids = [engine.submit(p, max_new_tokens=9) for p in prompts[:3]]
    engine.step()
    ids += [engine.submit(p, max_new_tokens=9) for p in prompts[3:]]
    run_to_completion(engine)
    assert any(rows > 2 for rows in chosen) and 2 in chosen, "prefill chunks and decode rows through SDPA"
    assert not cuda_graphs or engine.runner.decode_graphs.steps > 0
    for rid, prompt in zip(ids, prompts):
        assert engine.result(rid).output_token_ids == reference_greedy(ref, prompt, 9), prompt


def test_paged_varlen_through_decode_graphs_matches_transformers(cpu_model, ref, monkeypatch):
    use_reference_varlen(monkeypatch, (PAGED, PACKED))
    prompts, lengths = _prompts(2, (1, 6, 45, 30)), (8, 4, 8, 6)
    engine = Engine(cpu_model, num_pages=160, page_size=4, cuda_graphs=True, attention="varlen")
    assert engine.attention_backend == PAGED
    ids = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    run_to_completion(engine)
    assert [engine.result(i).output_token_ids for i in ids] == [
        reference_greedy(ref, p, n) for p, n in zip(prompts, lengths)
    ]
    assert engine.runner.decode_graphs.steps >= 5


def test_one_token_prompt_chunks_do_not_take_the_decode_graph_path(cpu_model, ref):
    """With prefill_chunk=1 every chunk is one token, but a prompt token samples nothing."""
    prompts = _prompts(3, (3, 6))
    engine = Engine(cpu_model, num_pages=64, page_size=4, prefill_chunk=1, token_budget=4, cuda_graphs=True)
    ids = [engine.submit(p, max_new_tokens=6) for p in prompts]
    run_to_completion(engine)
    assert [engine.result(i).output_token_ids for i in ids] == [reference_greedy(ref, p, 6) for p in prompts]
    assert engine.runner.decode_graphs.steps > 0


def test_packed_key_bucket_covers_the_padded_rows(cpu_model):
    """Each padded row reads one scratch key: a bucket without them lets the kernel read past
    the packed keys (out of bounds on CUDA). Real keys fill the 1,024-key bucket exactly."""
    c = cpu_model.config
    kv = KVCache(c.num_hidden_layers, 8, 4, c.num_key_value_heads, c.head_dim, cpu_model.dtype,
                 cpu_model.device, scratch_pages=1)
    graphs = DecodeGraphs(cpu_model, kv, page_size=4, max_batch=8, max_context=1024, attention=reference_backend(PACKED),
                          capture=GraphCapture(cpu_model.device))
    for ends in ([342, 341, 341], [1019, 1, 1, 1, 1]):
        batch, _, keys = graphs._shape([SimpleNamespace(end=e) for e in ends])
        assert keys >= sum(ends) + (batch - len(ends)), (ends, batch, keys)


def test_packed_decode_graph_with_a_row_beyond_half_the_largest_context(cpu_model, ref, monkeypatch):
    use_reference_packed_kernel(monkeypatch)  # its assertion checks that max_k bounds every row
    prompts = _prompts(1, (400, 3))
    engine = Engine(cpu_model, num_pages=160, page_size=4, cuda_graphs=True, attention="varlen-packed")
    ids = [engine.submit(p, max_new_tokens=4) for p in prompts]
    run_to_completion(engine)
    assert [engine.result(i).output_token_ids for i in ids] == [reference_greedy(ref, p, 4) for p in prompts]
    assert engine.runner.decode_graphs.steps >= 2


def test_shared_prefix_merge_stays_finite_at_large_score_gaps():
    """An attention sink: prefix scores ~100 above the row's own. Both parts must be rescaled
    to the joint maximum, or exp() of the difference overflows."""
    g = torch.Generator().manual_seed(0)
    b, h, grp, d, lp, ls = 2, 2, 2, 16, 8, 4
    q = 1 + 0.1 * torch.randn(b, h, grp, d, generator=g)
    kp = 30 + torch.randn(h, lp, d, generator=g)
    vp = torch.randn(h, lp, d, generator=g)
    ks, vs = torch.randn(b, h, ls, d, generator=g), torch.randn(b, h, ls, d, generator=g)
    scores_p = torch.einsum("bhgd,hld->bhgl", q, kp) * d**-0.5
    assert (scores_p.amax(-1) - torch.einsum("bhgd,bhld->bhgl", q, ks).amax(-1) * d**-0.5).min() > 100
    parts = cpu._softmax_parts(scores_p.clone(), vp[None].expand(b, -1, -1, -1), torch.float32)
    got = cpu._merge_with_prefix(parts, q, ks, vs, torch.zeros(b, 1, grp, ls))
    keys = torch.cat([kp[None].expand(b, -1, -1, -1), ks], 2)
    values = torch.cat([vp[None].expand(b, -1, -1, -1), vs], 2)
    want = torch.softmax(q @ keys.transpose(-1, -2) * d**-0.5, -1) @ values
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_identical_to_transformers(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 64, generator=gen) * 3).to(dtype)
    ours, theirs = RMSNorm(64, 1e-6, dtype, torch.device("cpu")), Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(64, generator=gen) + 0.5)
        theirs.weight.copy_(ours.weight)
        assert torch.equal(ours(x), theirs(x))


def test_default_dtype_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert resolve_dtype(None, torch.device("cuda")) is torch.bfloat16  # no GPU needed
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32


def test_packing_refuses_a_kernel_that_disagrees(monkeypatch):
    if not linear.packing_supported(torch.device("cpu"), torch.float32):
        pytest.skip("no packed oneDNN linear here")
    disagreeing = SimpleNamespace(linear=lambda x, w: F.linear(x, w) + 1)
    monkeypatch.setattr(linear, "F", disagreeing)  # the self-check's reference now differs
    lin = linear.Linear(8, 16, torch.float32, torch.device("cpu"))
    lin.weight.data.normal_()
    assert lin.pack() is False and not lin.packed and not lin.weight.is_mkldnn


@pytest.mark.parametrize("decode", [False, True])
def test_debug_mode_fails_a_step_that_would_read_unwritten_keys(cpu_model, decode):
    """The engine checks what the step's attention reads against what was written (its own
    tokens included) before the forward: a request whose earlier keys were lost fails."""
    engine = Engine(cpu_model, num_pages=16, page_size=4, prefill_chunk=6, debug=True)
    rid = engine.submit(_prompts(7, (10,))[0], max_new_tokens=4)
    engine.step()  # the first 6 prompt tokens: their own keys only, nothing unwritten
    if decode:
        engine.step()  # the rest of the prompt and the first token
        assert engine.result(rid).error is None
    request = engine._requests[rid]
    engine.runner.kv.forget_pages(request.page_table.pages[:1])
    engine.step()
    assert "unwritten KV slot" in engine.result(rid).error
