"""The CPU speed paths keep their contracts: grouping bounds padding, buffers hold right values."""

import sys
from types import SimpleNamespace

import pytest
import torch

from qil_worker import cpu_memory
from qil_worker.engine.runner.batch import MAX_PADDING, attention_groups
from qil_worker.kv import KVCache


def _chunk(num_tokens: int, end: int):
    return SimpleNamespace(num_tokens=num_tokens, end=end)


@pytest.mark.parametrize(
    "shapes",
    [
        [(250, 760), (60, 572)],
        [(100, 612), (95, 607), (90, 602)],
        [(1, 40), (1, 900), (1, 35), (1, 880), (1, 50)],
        [(512, 512)],
        [(7, 7), (300, 300), (8, 20), (299, 800), (2, 2)],
    ],
)
def test_attention_groups_cover_every_chunk_and_bound_padding(shapes):
    chunks = [_chunk(*s) for s in shapes]
    groups = attention_groups(chunks)
    flat = [c for g in groups for c in g]
    assert sorted(map(id, flat)) == sorted(map(id, chunks))
    for g in groups:
        padded = len(g) * max(c.num_tokens for c in g) * max(c.end for c in g)
        real = sum(c.num_tokens * c.end for c in g)
        assert padded <= MAX_PADDING * real or len(g) == 1


def test_a_short_chunk_is_not_padded_to_a_long_one():
    groups = attention_groups([_chunk(250, 760), _chunk(60, 572)])
    assert [len(g) for g in groups] == [1, 1]
    assert len(attention_groups([_chunk(100, 612), _chunk(95, 607)])) == 1


def test_huge_page_tensors_behave_like_empty_and_zeros():
    big = cpu_memory.zeros((3, 1024, 1024), torch.float32)
    assert big.shape == (3, 1024, 1024) and big.dtype == torch.float32 and big.is_contiguous()
    assert not bool(big.any())
    big[1, 2, 3] = 5.0
    assert float(big.sum()) == 5.0
    if sys.platform.startswith("linux"):
        assert big.data_ptr() % cpu_memory.HUGE_PAGE == 0
    small = cpu_memory.empty((4, 4), torch.bfloat16)
    assert small.shape == (4, 4) and small.dtype == torch.bfloat16
    assert isinstance(cpu_memory.keep_freed_memory(), bool)


def test_kv_gather_matches_index_select_and_reuses_its_buffers():
    kv = KVCache(2, 8, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.k.copy_(torch.randn_like(kv.k))
    kv.v.copy_(torch.randn_like(kv.v))
    slots = torch.tensor([5, 0, 31, 7, 7, 12])
    k, v = kv.gather(1, slots)
    assert torch.equal(k, kv.k[1].index_select(0, slots)) and torch.equal(v, kv.v[1].index_select(0, slots))
    first = k.data_ptr()
    k2, _ = kv.gather(0, slots[:4])
    assert k2.data_ptr() == first, "a smaller gather reuses the buffer"
    assert torch.equal(k2, kv.k[0].index_select(0, slots[:4]))
    k3, v3 = kv.gather(0, torch.arange(32))  # grows
    assert torch.equal(k3, kv.k[0]) and torch.equal(v3, kv.v[0])


def test_kv_gather_pages_equals_gathering_their_slots():
    kv = KVCache(2, 8, 4, 2, 8, torch.float32, torch.device("cpu"))
    kv.k.copy_(torch.randn_like(kv.k))
    kv.v.copy_(torch.randn_like(kv.v))
    pages = torch.tensor([[3, 0, 6], [7, 7, 1]])
    slots = (pages.view(-1, 1) * 4 + torch.arange(4)).view(-1)
    k, v = kv.gather_pages(1, pages.view(-1))
    assert k.shape == (24, 2, 8)
    assert torch.equal(k, kv.k[1].index_select(0, slots)) and torch.equal(v, kv.v[1].index_select(0, slots))
    k2, _ = kv.gather(0, slots[:5])  # the slot gather shares the buffers
    assert k2.data_ptr() == k.data_ptr() and torch.equal(k2, kv.k[0].index_select(0, slots[:5]))


def test_kv_gather_rows_gives_each_head_its_keys_contiguously():
    kv = KVCache(2, 8, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    kv.k.copy_(torch.randn_like(kv.k))
    kv.v.copy_(torch.randn_like(kv.v))
    slots = torch.tensor([[5, 0, 31], [7, 7, 12]])  # [batch, keys]
    rows = kv.head_rows(slots)
    assert rows.tolist() == [10, 0, 62, 11, 1, 63, 14, 14, 24, 15, 15, 25]  # slot * 2 + head
    k, v = kv.gather_rows(1, rows)
    assert k.shape == (12, 8) and k.is_contiguous()
    want_k = kv.k[1][slots].permute(0, 2, 1, 3).reshape(12, 8)  # [batch, key, head, D] → head-major
    want_v = kv.v[1][slots].permute(0, 2, 1, 3).reshape(12, 8)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_bf16_decodes_take_the_head_major_path_and_match_the_reference(tmp_path, monkeypatch):
    import qil_worker.attention.cpu as attention
    from checkpoints import load_reference, make_checkpoint
    from qil_worker import Qwen3
    from qil_worker.engine.probe import ForwardProbe

    path = make_checkpoint(tmp_path, seed=9)
    model = Qwen3.from_directory(path, dtype=torch.bfloat16)
    ref = load_reference(path, dtype=torch.bfloat16)
    calls = []
    rows = attention._head_major_rows
    monkeypatch.setattr(attention, "_head_major_rows", lambda *a: calls.append(1) or rows(*a))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (30, 17, 9)]
    probe = ForwardProbe(model, num_pages=48, page_size=4)
    seqs = [probe.sequence(p) for p in prompts]
    probe.forward([(s, len(p) - 3) for s, p in zip(seqs, prompts)])  # prefill all but 3 tokens
    assert not calls, "prefill chunks keep their own path"
    got = [[] for _ in prompts]
    for _ in range(3):  # three decode steps of all three sequences together
        for i, out in enumerate(probe.forward([(s, 1) for s in seqs])):
            got[i].append(out)
    assert calls, "bf16 decode rows on CPU should gather their keys head-major"
    for i, ids in enumerate(prompts):
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0, -3:].float()
        # as test_bfloat16_close_to_reference: bf16 keeps ~3 digits, both sides round differently
        assert (torch.cat(got[i]).float() - want).abs().max() < 0.05 * want.abs().max(), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_attended_in_chunks_equal_the_whole_group(tiny_dir, dtype, monkeypatch):
    """CPU decode rows are attended a few rows at a time (``CPU_CHUNK_BYTES``): float32
    by SDPA, bf16 by matmuls over head-major keys; one row per chunk gives the same logits."""
    import qil_worker.attention.cpu as attention
    from qil_worker import Qwen3
    from qil_worker.engine.probe import ForwardProbe

    model = Qwen3.from_directory(tiny_dir, dtype=dtype)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (30, 17, 9, 22)]
    chunks = []
    row_chunks = attention._row_chunks
    monkeypatch.setattr(attention, "_row_chunks", lambda *a: chunks.append(len(r := row_chunks(*a))) or r)
    outs = {}
    for chunk_bytes in (1 << 40, 1):
        monkeypatch.setattr(attention, "CPU_CHUNK_BYTES", 1 << 40)
        probe = ForwardProbe(model, num_pages=64, page_size=4)
        seqs = [probe.sequence(p) for p in prompts]
        probe.forward([(s, len(p) - 2) for s, p in zip(seqs, prompts)])
        chunks.clear()
        monkeypatch.setattr(attention, "CPU_CHUNK_BYTES", chunk_bytes)  # for the decode steps
        outs[chunk_bytes] = torch.cat([torch.cat(probe.forward([(s, 1) for s in seqs])) for _ in range(2)])
    assert max(chunks) >= 2, "one row per chunk: groups of several decode rows were split"
    assert torch.equal(outs[1], outs[1 << 40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attended_in_chunks_matches_the_whole_group(tiny_dir, ref, dtype, monkeypatch):
    """CPU prefill chunks are attended a few requests, or a block of one request's queries, at
    a time when their scores would be large; one query per block still gives the reference's
    logits (float32: to matmul rounding, the blocks change how it sums)."""
    import qil_worker.attention.cpu as attention
    from qil_worker import Qwen3
    from qil_worker.engine.probe import ForwardProbe

    model = Qwen3.from_directory(tiny_dir, dtype=dtype)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (30, 26, 40)]
    outs = {}
    for chunk_bytes in (1 << 40, 1):
        monkeypatch.setattr(attention, "CPU_CHUNK_BYTES", chunk_bytes)
        probe = ForwardProbe(model, num_pages=64, page_size=4)
        seqs = [probe.sequence(p) for p in prompts]
        first = probe.forward([(s, 12) for s in seqs])  # then chunks that attend over earlier keys
        outs[chunk_bytes] = torch.cat(first + probe.forward([(s, len(p) - 12) for s, p in zip(seqs, prompts)]))
    scale = outs[1 << 40].abs().max()
    assert (outs[1] - outs[1 << 40]).abs().max() <= (1e-5 if dtype == torch.float32 else 1e-2) * scale
    with torch.no_grad():
        want = torch.cat([ref(torch.tensor([p])).logits[0, :12] for p in prompts]
                         + [ref(torch.tensor([p])).logits[0, 12:] for p in prompts]).float()
    assert (outs[1].float() - want).abs().max() <= (1e-4 if dtype == torch.float32 else 0.05) * want.abs().max()


@pytest.mark.parametrize("chunk_bytes", [1 << 40, 1])
def test_decodes_sharing_prefix_pages_read_them_once_and_match_the_reference(tiny_dir, ref, monkeypatch, chunk_bytes):
    """With the prefix cache, decode rows share prompt pages; attention reads those keys once
    for the group (merged by log-sum-exp) and the tokens stay exactly transformers' greedy ones
    — also when the rows' own keys are attended one row at a time."""
    import random

    import qil_worker.attention.cpu as attention
    from engine_helpers import assert_pool_free, reference_greedy
    from qil_worker import Engine, Qwen3

    monkeypatch.setattr(attention, "CPU_CHUNK_BYTES", chunk_bytes)

    model = Qwen3.from_directory(tiny_dir, dtype="float32")  # the CPU path, whatever the test device
    rng = random.Random(4)
    prefix = [rng.randrange(1, 97) for _ in range(80)]
    prompts = [prefix + [rng.randrange(1, 97) for _ in range(n)] for n in (3, 9, 1, 14)]
    expected = [reference_greedy(ref, p, 8) for p in prompts]
    calls = []
    partial = attention._prefix_partial
    monkeypatch.setattr(attention, "_prefix_partial", lambda *a: calls.append(1) or partial(*a))
    engine = Engine(model, num_pages=128, page_size=4, debug=True)
    engine.generate(prompts[:1], max_new_tokens=1)  # leaves the prefix pages cached
    results = engine.generate(prompts, max_new_tokens=8)
    assert [r.output_token_ids for r in results] == expected
    assert calls, "decodes of requests sharing 80 prompt tokens should take the shared-prefix path"
    assert_pool_free(engine)


def _logits(model, tokens: list[int]) -> torch.Tensor:
    from qil_worker.engine.probe import ForwardProbe

    probe = ForwardProbe(model, num_pages=8, page_size=4)
    (logits,) = probe.forward([(probe.sequence(tokens), len(tokens))])
    return logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("untied", [False, True])
def test_packed_weights_give_the_plain_logits_and_release_the_parameters(tiny_dir, tiny_untied_sharded_dir, dtype, untied):
    from qil_worker import Qwen3
    from qil_worker.model.linear import packing_supported

    path = tiny_untied_sharded_dir if untied else tiny_dir
    if not packing_supported(torch.device("cpu"), dtype):
        pytest.skip("this torch/CPU has no packed oneDNN linear for " + str(dtype))
    plain = Qwen3.from_directory(path, dtype=dtype, pack_weights=False)
    packed = Qwen3.from_directory(path, dtype=dtype)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    want, got = _logits(plain, tokens), _logits(packed, tokens)
    if dtype == torch.bfloat16:  # same kernels on the same blocked data: bit-identical
        assert torch.equal(got, want)
    else:  # only the summation order differs
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # what state_dict() shows is what runs: every projection holds its packed weight only
    state = packed.state_dict()
    projections = {name: t for name, t in state.items() if name.endswith(("_proj.weight", "head.weight"))}
    assert len(projections) == 6 * len(packed.layers) + 1  # qk, v, o, gate, up, down; the LM head
    assert all(t.is_mkldnn for t in projections.values()), [n for n, t in projections.items() if not t.is_mkldnn]
    assert all(not t.is_mkldnn for name, t in state.items() if name not in projections)  # norms, embedding
    for layer in packed.layers:
        assert all(p.packed for p in [*layer.projections(), layer.o_proj, *layer.mlp.projections(), layer.mlp.down_proj])
    assert packed.head.packed
    if untied:
        assert packed.lm_head is packed.head.weight
    else:  # the tied table still serves embedding lookups; the head is its packed copy
        assert packed.lm_head is None and torch.equal(packed.embed, plain.embed)
    # no doubled memory: the plain weights are gone, only the tied head's copy is extra
    plain_bytes = sum(t.nbytes for t in plain.state_dict().values() if not t.is_mkldnn)
    extra = 0 if untied else plain.embed.nbytes
    assert sum(p.numel() for p in packed.parameters()) * packed.embed.element_size() <= plain_bytes + extra


def test_a_failed_pack_leaves_the_layer_plain(tiny_dir, monkeypatch):
    from qil_worker import Qwen3
    from qil_worker.model.linear import Linear

    model = Qwen3.from_directory(tiny_dir, pack_weights=False)
    tokens = [5, 6, 7, 8]
    want = _logits(model, tokens)
    layer = model.layers[0]
    monkeypatch.setattr(layer.v_proj, "packed_weight", lambda: None)
    assert not layer.pack_weights()
    # attention stays plain, all of it (the MLP may pack)
    assert all(not p.packed and not p.weight.is_mkldnn for p in [*layer.projections(), layer.o_proj])
    torch.testing.assert_close(_logits(model, tokens), want, rtol=1e-5, atol=1e-5)
    assert Linear(2, 3, torch.float32, torch.device("meta")).pack() is False  # no oneDNN on meta tensors


def test_packing_is_only_offered_on_cpu():
    from qil_worker.model.linear import packing_supported

    assert not packing_supported(torch.device("meta"), torch.float32)
    assert not packing_supported(torch.device("cpu"), torch.int8)
