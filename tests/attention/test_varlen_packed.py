"""The packed varlen path's bookkeeping, checked on any device.

The packed path gathers every request's keys back to back and hands them to torch's varlen flash
kernel (CUDA only). Here that kernel is replaced by a slow reference with the same contract —
per request, causal attention aligned to the end of its keys, GQA — so what qil computes around
it (the packed key slots, the offsets, the decode-graph buckets and scratch rows) is checked
against the SDPA path and transformers on CPU. The real kernel is checked against SDPA in
``test_gpu.py`` and at start-up by ``choice.probe_varlen``.
"""

import random

import pytest
import torch

from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from varlen_helpers import use_reference_packed_kernel
from qil_worker import Engine, FinishReason
from qil_worker.attention import PACKED, PAGED, choice, varlen
from qil_worker.attention.choice import choose_backend
from qil_worker.attention.reference import reference_backend, reference_varlen_attn
from qil_worker.attention.varlen import packed_key_slots
from qil_worker.engine.runner.graph_buckets import key_buckets
from qil_worker.engine.probe import ForwardProbe


@pytest.fixture
def packed_anywhere(monkeypatch):
    """The packed path selectable on this device, with the reference kernel."""
    use_reference_packed_kernel(monkeypatch)


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(n)] for n in lengths]


def test_packed_key_slots_follow_each_rows_pages():
    tables = torch.tensor([[7, 2, 0], [4, 0, 0], [1, 3, 5]])
    lengths = torch.tensor([5, 1, 9])
    cu = torch.tensor([0, 5, 6, 15])
    slots = packed_key_slots(tables, lengths, cu, 15, page_size=4)
    want = [28, 29, 30, 31, 8] + [16] + [4, 5, 6, 7, 12, 13, 14, 15, 20]
    assert slots.tolist() == want


def test_decode_metadata_packs_keys_and_sends_the_tail_to_scratch():
    tables = torch.tensor([[7, 2], [4, 9], [6, 6]])  # row 2: a padded row (scratch page 6)
    positions = torch.tensor([5, 2, 0])  # keys 0..5, 0..2, 0..0
    meta = reference_backend(PACKED).decode_metadata(tables, positions, 4, 8, 2, keys=16, scratch_slot=24)
    assert meta.cu_seq_k.tolist() == [0, 6, 9, 10] and meta.cu_seq_q.tolist() == [0, 1, 2, 3]
    assert meta.block_table is None and meta.max_q == 1 and meta.max_k == 8
    assert meta.mask == {"window_size": (-1, -1), "enable_gqa": True}  # not causal: one query sees all
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4 + 2, 6 * 4 + 0]
    assert meta.key_slots.tolist() == [28, 29, 30, 31, 8, 9] + [16, 17, 18] + [24] + [24] * 6


def test_key_buckets():
    assert key_buckets(5000) == [1024, 2048, 4096, 5000]
    assert key_buckets(1000) == [1000]


def test_packed_logits_equal_the_sdpa_path(model, packed_anywhere):
    """Prefill chunks of several lengths and single tokens in one forward, then more of each."""
    prompts = _prompts([1, 7, 40, 130], seed=4)
    outs = {}
    for mode in ("sdpa", PACKED):
        probe = ForwardProbe(model, num_pages=128, page_size=4, attention=mode)
        seqs = [probe.sequence(p) for p in prompts]
        first = probe.forward([(s, min(len(p), 5)) for s, p in zip(seqs, prompts)])
        rest = probe.forward([(s, len(p) - 5) for s, p in zip(seqs, prompts) if len(p) > 5])
        outs[mode] = torch.cat(first + rest)
    scale = outs["sdpa"].abs().max()
    tolerance = 1e-4 if model.dtype == torch.float32 else 3e-2
    assert (outs[PACKED] - outs["sdpa"]).abs().max() <= tolerance * scale


def test_packed_engine_matches_transformers_through_the_decode_graph_path(model, ref, packed_anywhere):
    """Decode steps take the padded graph path (key buckets, scratch rows) as requests finish."""
    prompts = _prompts([1, 6, 45, 200], seed=9)
    lengths = (14, 5, 14, 9)
    expected = [reference_greedy(ref, p, n) for p, n in zip(prompts, lengths)]
    engine = Engine(model, num_pages=160, page_size=4, cuda_graphs=True, attention="varlen-packed")
    assert engine.attention_backend == PACKED
    ids = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    run_to_completion(engine)
    results = [engine.result(i) for i in ids]
    assert [r.output_token_ids for r in results] == expected
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert engine.runner.decode_graphs.steps >= 10
    assert_pool_free(engine)


def test_attention_choice():
    cpu = torch.device("cpu")
    backend, why = choose_backend("auto", cpu, torch.float32, 16, 4, 2, 16)
    assert (backend.name, why) == ("sdpa", "not a CUDA device")
    backend, why = choose_backend("sdpa", cpu, torch.float32, 16, 4, 2, 16)
    assert (backend.name, why) == ("sdpa", None)
    with pytest.raises(ValueError, match="unavailable: not a CUDA device"):
        choose_backend("varlen-packed", cpu, torch.bfloat16, 16, 4, 2, 16)
    with pytest.raises(ValueError, match="attention must be one of"):
        choose_backend("flash", cpu, torch.float32, 16, 4, 2, 16)


def _fake_varlen_attn(aligned_to_end: bool):
    """``varlen_attn`` with torch 2.13's signature, computed by ``reference_varlen_attn``; with
    ``aligned_to_end=False`` the causal mask starts at each request's first key instead (the
    kind of semantic difference the start-up probe must refuse)."""

    def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1), enable_gqa=False,
             seqused_k=None, block_table=None):
        if aligned_to_end:
            return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window_size,
                                         enable_gqa=enable_gqa, seqused_k=seqused_k, block_table=block_table)
        if block_table is not None:  # paged: each request's keys through its pages
            page_size = key.shape[1]
            flat_k, flat_v = key.flatten(0, 1), value.flatten(0, 1)
            slots = [
                block_table[r, j // page_size].item() * page_size + j % page_size
                for r, used in enumerate(seqused_k.tolist())
                for j in range(used)
            ]
            key, value = flat_k[slots], flat_v[slots]
            cu_seq_k = torch.tensor([0] + seqused_k.cumsum(0).tolist())
        # drop the keys a top-left mask would hide from the last query
        q_lens = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
        keep = [list(range(s, s + n)) for s, n in zip(cu_seq_k[:-1].tolist(), q_lens)]
        key, value = key[sum(keep, [])], value[sum(keep, [])]
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_q, max_q, max_k, window_size=window_size,
                                     enable_gqa=enable_gqa)

    return fake


@pytest.mark.parametrize("mode", [PAGED, PACKED])
def test_startup_probe_accepts_a_kernel_that_agrees_and_refuses_one_that_does_not(monkeypatch, mode):
    cpu = torch.device("cpu")
    monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: _fake_varlen_attn(aligned_to_end=True))
    for q_lens, causal in (((2, 1), True), ((1, 1), False)):
        assert choice._check_against_sdpa(cpu, torch.float32, 4, 4, 2, 8, mode, q_lens, causal) is None
    monkeypatch.setattr(varlen, "torch_varlen_attn", lambda: _fake_varlen_attn(aligned_to_end=False))
    assert "(causal) differs from SDPA" in choice._check_against_sdpa(cpu, torch.float32, 4, 4, 2, 8, mode)


@pytest.mark.parametrize("mode", [PAGED, PACKED])
def test_a_backend_object_plugs_into_the_engine(model, ref, mode):
    """An engine takes a backend object as it takes a name: batches, decode graphs and the model
    run it without knowing which it is."""
    prompts = _prompts([3, 30], seed=2)
    engine = Engine(model, num_pages=64, page_size=4, cuda_graphs=True, attention=reference_backend(mode))
    assert engine.attention_backend == mode
    ids = [engine.submit(p, max_new_tokens=6) for p in prompts]
    run_to_completion(engine)
    assert [engine.result(i).output_token_ids for i in ids] == [reference_greedy(ref, p, 6) for p in prompts]
    assert engine.runner.decode_graphs.steps >= 4
