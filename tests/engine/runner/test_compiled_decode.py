"""A lone decode row through the model's compiled forward (``compile_decode``, CPU) against the
eager step: float32 logits to 1e-4 of their scale and the same greedy tokens under chunking and
preemption with every page free; bfloat16 within the load probe's bound; the steps the graph
does not cover (several rows, keys spread over the pool, prompt logprobs) stay eager; a failed
compiled call falls back to the eager step with one warning; models it does not cover (MoE)
compile nothing.
"""

from __future__ import annotations

import logging

import pytest
import torch

from checkpoints import make_moe_checkpoint
from engine_helpers import assert_pool_free, random_prompts, run_to_completion
from qil_worker import Engine, Qwen3
from qil_worker.engine.runner.compiled_decode import CompiledDecode
from qil_worker.model.compiled_decode import PROBE_TOLERANCE, _DecodeForward, frozen_weights


@pytest.fixture(scope="module")
def model(tiny_dir):
    model = Qwen3.from_directory(tiny_dir, dtype="float32")
    assert model.compiled_decode() is not None
    return model


def _logits(model, start: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(compiled, eager) logits of one decode row over ``length`` random keys from slot ``start``
    of a 40-slot-per-layer cache."""
    heads, layers = model.heads, model.config.num_hidden_layers
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(layers * 40, heads.kv_heads, heads.head_dim, generator=generator).to(model.dtype)
    v = torch.randn(k.shape, generator=generator).to(model.dtype)
    args = (torch.tensor([seed % 90 + 1]), torch.tensor([length - 1]))
    slot = torch.tensor([start + length - 1])
    with frozen_weights():
        got = model.compiled_decode()(*args, k.clone(), v.clone(), slot, start, length)
    with torch.inference_mode():
        want = _DecodeForward(model)(*args, k, v, slot, start, length)
    return got.float(), want.float()


@pytest.mark.parametrize("start, length", [(0, 2), (0, 37), (5, 12), (24, 16)])
def test_float32_compiled_logits_are_the_eager_ones(model, start, length):
    got, want = _logits(model, start, length, seed=start + length)
    # inductor sums in another order: rounding only, far below any logit gap of the tests
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_bfloat16_compiled_logits_stay_within_the_probes_bound(tiny_dir):
    bf16 = Qwen3.from_directory(tiny_dir, dtype="bfloat16")
    for start, length in ((0, 9), (7, 30)):
        got, want = _logits(bf16, start, length, seed=length)
        assert (got - want).abs().max().item() <= PROBE_TOLERANCE[torch.bfloat16] * want.abs().max().item()


def _greedy(model, prompts, compile_decode: bool, **options) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of ``prompts`` (12 each) → tokens, preemptions, steps run compiled (pages
    checked free, the engine closed)."""
    config = dict(num_pages=24, page_size=4, token_budget=32, prefill_chunk=16, max_active=4)
    engine = Engine(model, **{**config, **options}, compile_decode=compile_decode)
    ids = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
    run_to_completion(engine)
    results = [engine.result(i) for i in ids]
    assert_pool_free(engine)
    compiled = engine.runner.compiled_decode
    steps = compiled.steps if compiled is not None else 0
    engine.close()
    assert engine.runner.compiled_decode is None  # its views of the KV tensors dropped too
    return [r.output_token_ids for r in results], sum(r.num_preemptions for r in results), steps


@pytest.mark.parametrize("lengths, pool", [([10, 23, 5, 31, 17, 2], {}), ([10, 23], dict(num_pages=12, max_active=2))])
def test_an_engine_gives_the_eager_tokens_under_chunking_and_preemption(model, lengths, pool):
    prompts = random_prompts(lengths)
    want, preempted, _ = _greedy(model, prompts, compile_decode=False, **pool)
    got, _, steps = _greedy(model, prompts, compile_decode=True, **pool)
    assert got == want and preempted > 0
    if pool:  # the preempted request decodes alone on consecutive pages once the other is done
        assert steps > 0


def test_every_decode_step_of_a_lone_request_is_compiled(model):
    for prompt in random_prompts([10, 23]):
        want, _, _ = _greedy(model, [prompt], compile_decode=False)
        got, _, steps = _greedy(model, [prompt], compile_decode=True)
        assert got == want and steps == 11


def test_steps_the_graph_does_not_cover_run_eagerly(model, monkeypatch):
    seen: list[tuple[int, bool, bool]] = []  # (chunks, consecutive pages of a lone decode, handled)
    handles = CompiledDecode.handles

    def spy(self, chunks):
        handled = handles(self, chunks)
        chunk = chunks[0]
        pages = chunk.pages[: chunk.start // self.page_size + 1]
        seen.append((len(chunks), pages == list(range(pages[0], pages[0] + len(pages))), handled))
        return handled

    monkeypatch.setattr(CompiledDecode, "handles", spy)
    # A's third page comes while B holds the pages after A's first two; then A decodes alone
    engine = Engine(model, num_pages=24, page_size=4, prefix_cache=False, compile_decode=True)
    a = engine.submit(random_prompts([7])[0], max_new_tokens=12, ignore_eos=True)
    b = engine.submit(random_prompts([14], seed=4)[0], max_new_tokens=4, ignore_eos=True)
    run_to_completion(engine)
    assert (1, False, False) in seen  # A alone on pages apart: eager
    assert all(not handled for n, _, handled in seen if n > 1)
    want, _, _ = _greedy(model, [random_prompts([7])[0], random_prompts([14], seed=4)[0]], compile_decode=False,
                         prefix_cache=False, num_pages=24, token_budget=512, prefill_chunk=512)
    assert [engine.result(a).output_token_ids, engine.result(b).output_token_ids[:4]] == [want[0], want[1][:4]]
    assert_pool_free(engine)
    steps = engine.runner.compiled_decode.steps
    engine.submit(random_prompts([6])[0], max_new_tokens=4, ignore_eos=True, prompt_logprobs=1)
    run_to_completion(engine)
    assert engine.runner.compiled_decode.steps == steps  # prompt logprobs asked for: eager
    engine.close()


def test_a_failed_compiled_call_runs_the_step_eagerly_with_one_warning(model, caplog):
    prompts = random_prompts([9])
    want, _, _ = _greedy(model, prompts, compile_decode=False)
    engine = Engine(model, num_pages=24, page_size=4, compile_decode=True)
    calls = []

    def fails(*args):
        calls.append(args)
        raise RuntimeError("InductorError: no C++ compiler found\nmore detail")

    engine.runner.compiled_decode.step = fails
    with caplog.at_level(logging.WARNING, logger="qil_worker.engine.runner.compiled_decode"):
        ids = [engine.submit(p, max_new_tokens=12, ignore_eos=True) for p in prompts]
        run_to_completion(engine)
    assert [engine.result(i).output_token_ids for i in ids] == want
    assert len(calls) == 1 and engine.runner.compiled_decode.steps == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "qil_worker.engine.runner.compiled_decode"]
    assert warnings == ["compiled decode step failed (RuntimeError: InductorError: no C++ compiler found); "
                        "decode steps run eagerly from now on"]
    assert_pool_free(engine)
    engine.close()


def test_models_it_does_not_cover_compile_nothing(tmp_path, model):
    moe = Qwen3.from_directory(make_moe_checkpoint(tmp_path, seed=1), dtype="float32")
    assert moe.compiled_decode() is None
    engine = Engine(moe, num_pages=16, page_size=4, compile_decode=True)
    assert engine.runner.compiled_decode is None
    engine.close()
    debug = Engine(model, num_pages=16, page_size=4, compile_decode=True, debug=True)
    assert debug.runner.compiled_decode is None  # debug checks read inside the forward
    debug.close()


def test_int8_weights_decode_compiled_to_the_eager_tokens(tiny_dir):
    int8 = Qwen3.from_directory(tiny_dir, dtype="float32", quantize="int8")
    assert int8.compiled_decode() is not None
    for prompt in random_prompts([10, 23]):
        want, _, _ = _greedy(int8, [prompt], compile_decode=False)
        got, _, steps = _greedy(int8, [prompt], compile_decode=True)
        assert got == want and steps == 11
