"""int8 experts' few-token steps as one compiled call (``routed_experts.py``) against the
per-expert loop they replace there: the eager definition computes what the loop computes
(float32 to 1e-5), the compiled call what the eager one does (float32 to 1e-5, bfloat16 within
the load-time probe's bound), steps above ``MAX_TOKENS`` keep the loop, an engine gives the
loop's greedy tokens under chunking and preemption with every page free, and a failed compile
leaves the loop with one warning.
"""

from __future__ import annotations

import logging

import pytest
import torch

from checkpoints import make_moe_checkpoint
from engine_helpers import assert_pool_free, random_prompts, run_to_completion
from qil_worker import Engine, Qwen3
from qil_worker.model import routed_experts
from qil_worker.model.moe import SparseMoeBlock
from qil_worker.model.routed_experts import MAX_TOKENS, PROBE_TOLERANCE, routed_int8_experts

ATOL = 1e-5


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    # layers 1 and 3 sparse, renormalised top-2 of 8 experts, untied head
    return make_moe_checkpoint(tmp_path_factory.mktemp("routed"), seed=2, norm_topk_prob=True, decoder_sparse_step=2,
                               mlp_only_layers=[], num_hidden_layers=4, tie_word_embeddings=False)


def _sparse(model) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def _loop(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The block's output through its per-expert loop, whatever it is set to use."""
    routed, block.routed = block.routed, None
    try:
        return block(x)
    finally:
        block.routed = routed


def _inputs(tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_the_eager_definition_computes_what_the_loop_does(moe_dir):
    model = Qwen3.from_directory(moe_dir, dtype="float32", quantize="int8", compile=False)
    for block in _sparse(model):
        assert block.routed is None and block.int8_experts
        for tokens in (1, 3, MAX_TOKENS, 20):
            x = _inputs(tokens, block.gate_up.in_features, torch.float32, tokens)
            with torch.inference_mode():
                weights, ids = block.gate.route(x)
                got = routed_int8_experts(x, ids, weights, block.gate_up.weight, block.gate_up.scales,
                                          block.down.weight, block.down.scales)
                want = block(x)
            assert want.abs().max() > 0.1  # the experts contribute
            torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def test_an_int8_moe_runs_steps_of_up_to_max_tokens_compiled(moe_dir):
    model = Qwen3.from_directory(moe_dir, dtype="float32", quantize="int8")
    blocks = _sparse(model)
    assert blocks and all(b.routed is not None for b in blocks)
    calls = []
    for block in blocks:
        compiled = block.routed
        block.routed = lambda *args, _compiled=compiled: calls.append(args[0].shape[0]) or _compiled(*args)
    for tokens in (1, 2, 5, MAX_TOKENS, MAX_TOKENS + 1):
        for block in blocks:
            x = _inputs(tokens, block.gate_up.in_features, torch.float32, 10 + tokens)
            with torch.inference_mode():
                got, want = block(x), _loop(block, x)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)
    assert calls == [t for t in (1, 2, 5, MAX_TOKENS) for _ in blocks]  # never above MAX_TOKENS


def test_bfloat16_compiled_experts_stay_within_the_probes_bound(moe_dir):
    model = Qwen3.from_directory(moe_dir, dtype="bfloat16", quantize="int8")
    for block in _sparse(model):
        assert block.routed is not None
        for tokens in (1, 4, MAX_TOKENS):
            x = _inputs(tokens, block.gate_up.in_features, torch.bfloat16, 20 + tokens)
            with torch.inference_mode():
                got, want = block(x).float(), _loop(block, x).float()
            assert got.dtype == want.dtype
            assert (got - want).abs().max() <= PROBE_TOLERANCE[torch.bfloat16] * want.abs().max()


def _greedy(model, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``prompts`` on an engine whose pool is too small for them all (chunked
    prefill, decode steps of 1 to 4 rows, preemption); → tokens, preemptions (pages checked free)."""
    engine = Engine(model, num_pages=24, page_size=4, token_budget=32, prefill_chunk=16, max_active=4)
    ids = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
    run_to_completion(engine)
    results = [engine.result(i) for i in ids]
    assert_pool_free(engine)
    engine.close()
    return [r.output_token_ids for r in results], sum(r.num_preemptions for r in results)


def test_an_engine_gives_the_loops_tokens_with_compiled_experts(moe_dir):
    prompts = random_prompts([10, 23, 5, 31, 17, 2])
    loop = Qwen3.from_directory(moe_dir, dtype="float32", quantize="int8", compile=False)
    compiled = Qwen3.from_directory(moe_dir, dtype="float32", quantize="int8")
    steps = []
    for block in _sparse(compiled):
        routed = block.routed
        block.routed = lambda *args, _routed=routed: steps.append(args[0].shape[0]) or _routed(*args)
    want, preempted = _greedy(loop, prompts)
    got, _ = _greedy(compiled, prompts)
    assert got == want and preempted > 0
    assert steps and max(steps) <= MAX_TOKENS  # decode steps went through the compiled call


def test_a_failed_compile_leaves_the_loop_with_one_warning(moe_dir, monkeypatch, caplog):
    def no_compiler(fn, **kwargs):
        def fails(*args):
            raise RuntimeError("InductorError: no C++ compiler found\nmore detail")
        return fails

    monkeypatch.setattr(routed_experts.torch, "compile", no_compiler)
    with caplog.at_level(logging.WARNING, logger="qil_worker.model.routed_experts"):
        model = Qwen3.from_directory(moe_dir, dtype="float32", quantize="int8")
    warnings = [r.getMessage() for r in caplog.records if r.name == "qil_worker.model.routed_experts"]
    assert warnings == ["routed int8 experts not compiled (RuntimeError: InductorError: no C++ compiler found); "
                        "few-token steps keep the per-expert loop"]
    assert all(block.routed is None for block in _sparse(model))
    reference = Qwen3.from_directory(moe_dir, dtype="float32", quantize="int8", compile=False)
    assert _greedy(model, random_prompts([7, 12]))[0] == _greedy(reference, random_prompts([7, 12]))[0]


def test_nothing_is_compiled_without_int8_experts(moe_dir, tiny_dir):
    unquantized = Qwen3.from_directory(moe_dir, dtype="float32")
    assert unquantized.compile_cpu_kernels() == 0
    assert all(block.routed is None for block in _sparse(unquantized))
    assert Qwen3.from_directory(tiny_dir, dtype="float32", quantize="int8").compile_cpu_kernels() == 0  # dense
    with pytest.raises(ValueError, match="int8 codes"):
        _sparse(unquantized)[0].use_routed(routed_int8_experts)
