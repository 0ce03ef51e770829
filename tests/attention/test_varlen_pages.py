"""``varlen-pages``: decode rows attended page by page where the pages lie, merged by their
log-sum-exps (``attention.segments``), computed here by the plain-torch reference kernels
(the flash kernel is CUDA only): against SDPA, and in the engine against transformers."""

from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from qil_worker import Engine, FinishReason
from qil_worker.attention import choice
from qil_worker.attention.choice import choose_backend
from qil_worker.attention.names import SEGMENTS
from qil_worker.attention.reference import reference_segment_attn, reference_segments_backend
from qil_worker.attention.segments import lse_per_query, merge_pages, segment_metadata
from qil_worker.engine.probe import ForwardProbe

CPU = torch.device("cpu")


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_page_by_page_equals_sdpa_over_the_whole_context(page_size):
    """The start-up probe's check: rows over several pages out of order, a partial last page,
    table columns past a row's keys."""
    assert choice._check_segments_against_sdpa(CPU, torch.float32, page_size, 4, 2, 8, reference_segment_attn) is None


def test_a_kernel_that_reads_from_the_wrong_slot_is_refused():
    def from_slot_zero(q, k, v, cu_q, starts, max_q, max_k, used):
        return reference_segment_attn(q, k, v, cu_q, torch.zeros_like(starts), max_q, max_k, used)

    why = choice._check_segments_against_sdpa(CPU, torch.float32, 4, 4, 2, 8, from_slot_zero)
    assert why is not None and "varlen-pages attention (decode) differs from SDPA" in why


def test_segment_metadata_one_sequence_per_row_and_page():
    tables = torch.tensor([[7, 2, 5], [4, 5, 5]])  # row 1: its second and third pages unused
    meta = segment_metadata(torch.tensor([9, 17]), tables, torch.tensor([10, 3]), 4, reference_segment_attn)
    assert meta.starts.tolist() == [28, 8, 20, 16, 20, 20, 20]  # the last entry is never read
    assert meta.used.tolist() == [4, 4, 2, 3, 1, 1]  # an empty page reads one key, weighed 0
    assert meta.valid.tolist() == [[True, True, True], [True, False, False]]
    assert meta.cu_seq_q.tolist() == list(range(7)) and meta.pages == 3


def test_merging_ignores_what_an_empty_page_holds():
    out = torch.randn(4, 2, 3)
    lse = torch.randn(4, 2)
    valid = torch.tensor([[True, False], [True, True]])
    poisoned = out.clone()
    poisoned[1] = 1e6  # row 0's second page: not its keys
    merged = merge_pages(poisoned, lse, valid)
    assert torch.allclose(merged[0], out[0])
    weights = torch.softmax(lse[2:], dim=0)
    assert torch.allclose(merged[1], (weights[:, :, None] * out[2:]).sum(0))


def test_both_log_sum_exp_layouts_of_the_kernel():
    lse = torch.randn(5, 3)  # [queries, heads]
    assert torch.equal(lse_per_query(lse.t().contiguous(), 5, 3), lse)  # unpadded: [heads, queries]
    assert torch.equal(lse_per_query(lse[:, :, None], 5, 3), lse)  # padded: [sequences, heads, 1]
    with pytest.raises(ValueError, match="log-sum-exp shape"):
        lse_per_query(torch.randn(2, 2), 5, 3)


def test_decode_logits_equal_the_sdpa_path(model):
    prompts = _prompts([1, 7, 40, 130], seed=4)
    outs = {}
    for attention in ("sdpa", reference_segments_backend()):
        probe = ForwardProbe(model, num_pages=128, page_size=4, attention=attention)
        seqs = [probe.sequence(p) for p in prompts]
        probe.forward([(s, len(p) - 1) for s, p in zip(seqs, prompts) if len(p) > 1])
        outs[getattr(attention, "name", attention)] = torch.cat(probe.forward([(s, 1) for s in seqs]))
    scale = outs["sdpa"].abs().max()
    assert (outs[SEGMENTS] - outs["sdpa"]).abs().max() <= 1e-4 * scale


@pytest.mark.parametrize("graphs", [True, False])
def test_the_engine_gives_transformers_tokens(model, ref, graphs):
    """Prefill steps run packed, decode steps page by page: eagerly, or through the padded
    decode-graph path (context buckets, scratch rows) as requests finish."""
    prompts = _prompts([1, 6, 45, 200], seed=9)
    lengths = (14, 5, 14, 9)
    expected = [reference_greedy(ref, p, n) for p, n in zip(prompts, lengths)]
    backend = reference_segments_backend()
    calls = []
    backend.kernel = lambda *args: calls.append(args[0].shape[0]) or reference_segment_attn(*args)
    engine = Engine(model, num_pages=160, page_size=4, cuda_graphs=graphs, attention=backend)
    assert engine.attention_backend == SEGMENTS
    ids = [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts, lengths)]
    run_to_completion(engine)
    results = [engine.result(i) for i in ids]
    assert [r.output_token_ids for r in results] == expected
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    if graphs:
        assert engine.runner.decode_graphs.steps >= 10
    # the 13 decode steps of the longest request read page by page: one call per layer each
    assert len(calls) >= 13 * model.config.num_hidden_layers
    assert_pool_free(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernel is CUDA only")
@pytest.mark.parametrize("page_size", [16, 128])
def test_the_flash_kernel_page_by_page_agrees_with_sdpa_on_cuda(page_size):
    from qil_worker.attention.segments import torch_segment_attn

    kernel = torch_segment_attn()
    if kernel is None:
        pytest.skip(f"torch {torch.__version__}: no flash kernel taking seqused_k")
    cuda = torch.device("cuda")
    assert choice._check_segments_against_sdpa(cuda, torch.bfloat16, page_size, 16, 8, 128, kernel) is None
    assert choice.probe_varlen(cuda, torch.bfloat16, page_size, 16, 8, 128, SEGMENTS) is None


def test_refused_off_cuda():
    with pytest.raises(ValueError, match="'varlen-pages' is unavailable: not a CUDA device"):
        choose_backend(SEGMENTS, CPU, torch.bfloat16, 16, 4, 2, 16)
