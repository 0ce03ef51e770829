"""Sampling through the engine: seeds independent of the batch, logprobs from real logits."""

import json
import math
import random
import shutil

import pytest
import torch

from checkpoints import load_reference, make_checkpoint
from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from qil_worker import Engine, FinishReason, InvalidRequestError, Qwen3

SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.1, seed=1234)


def _noise_prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def test_seeded_request_is_the_same_alone_in_a_crowd_and_after_preemption(model):
    prompt = [11, 12, 13, 14, 15, 16, 17]
    (alone,) = Engine(model, num_pages=64, page_size=4).generate([prompt], max_new_tokens=20, **SAMPLED)

    crowded = Engine(model, num_pages=64, page_size=4, token_budget=32, prefill_chunk=8)
    others = [crowded.submit(p, max_new_tokens=15, temperature=1.0) for p in _noise_prompts(6, 1)]
    rid = crowded.submit(prompt, max_new_tokens=20, **SAMPLED)
    run_to_completion(crowded)
    assert crowded.result(rid).output_token_ids == alone.output_token_ids

    tight = Engine(model, num_pages=14, page_size=4, token_budget=32, prefill_chunk=8, debug=True)
    rid = tight.submit(prompt, max_new_tokens=20, **SAMPLED)
    noise = [tight.submit(p, max_new_tokens=12, temperature=0.7, seed=9) for p in _noise_prompts(5, 2)]
    run_to_completion(tight)
    res = tight.result(rid)
    assert res.output_token_ids == alone.output_token_ids
    preemptions = sum(tight.result(r).num_preemptions for r in noise + [rid])
    assert preemptions > 0, "the small pool was meant to force preemption"
    assert_pool_free(tight)
    assert all(crowded.result(o).finish_reason is FinishReason.LENGTH for o in others)


def test_different_seeds_differ_and_sampling_is_not_greedy(model):
    prompt = [3, 4, 5]
    engine = Engine(model, num_pages=64, page_size=4)
    a, b = engine.generate([prompt, prompt], max_new_tokens=16, temperature=1.5, seed=None)
    c, d = (engine.generate([prompt], max_new_tokens=16, temperature=1.5, seed=s)[0] for s in (1, 2))
    greedy = engine.generate([prompt], max_new_tokens=16)[0]
    assert len({tuple(x.output_token_ids) for x in (a, b, c, d, greedy)}) >= 4


def test_logprobs_equal_log_softmax_of_reference_logits(model, tiny_dir):
    ref = load_reference(tiny_dir)
    prompt = [7, 8, 9, 10]
    engine = Engine(model, num_pages=64, page_size=4)
    rid = engine.submit(prompt, max_new_tokens=6, logprobs=True, top_logprobs=5)
    events = run_to_completion(engine)
    tokens = engine.result(rid).output_token_ids
    assert tokens == reference_greedy(ref, prompt, 6)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    want = torch.log_softmax(logits.float(), dim=-1)
    for i, e in enumerate(events):
        assert e.logprob == pytest.approx(float(want[i, e.token_id]), abs=1e-4)
        top_ids = want[i].topk(5).indices.tolist()
        assert [t for t, _ in e.top_logprobs] == top_ids
        assert [v for _, v in e.top_logprobs] == pytest.approx(want[i, top_ids].tolist(), abs=1e-4)


def test_min_new_tokens_and_ignore_eos(model, tiny_dir, device):
    ref = load_reference(tiny_dir)
    prompt = [3, 1, 4, 1, 5]
    full = reference_greedy(ref, prompt, 10)
    j = next(i for i in range(1, 10) if full[i] not in full[:i])  # first fresh token after 0
    eos_model = Qwen3.from_directory(tiny_dir, device=device, dtype="float32")
    object.__setattr__(eos_model.config, "eos_token_ids", (full[j],))
    engine = Engine(eos_model, num_pages=32, page_size=8)
    (stopped,) = engine.generate([prompt], max_new_tokens=10)
    assert stopped.finish_reason is FinishReason.STOP and stopped.output_token_ids == full[: j + 1]
    (ignored,) = engine.generate([prompt], max_new_tokens=10, ignore_eos=True)
    assert ignored.output_token_ids == full and ignored.finish_reason is FinishReason.LENGTH
    (late,) = engine.generate([prompt], max_new_tokens=10, min_new_tokens=j + 2)
    assert len(late.output_token_ids) >= j + 2 and full[j] not in late.output_token_ids[: j + 1]


def test_sampling_values_rejected_at_submit(model):
    engine = Engine(model, num_pages=32, page_size=8)
    with pytest.raises(InvalidRequestError) as info:
        engine.submit([1], temperature=float("inf"))
    assert info.value.field == "temperature"
    with pytest.raises(InvalidRequestError) as info:
        engine.submit([1], tempreature=0.5)
    assert info.value.field == "tempreature"
    assert engine.idle


def test_extreme_temperatures_and_penalties_are_greedy_or_refused(model):
    """float32 sampling: a temperature under 1e-5 is greedy (1e-40 once drew NaN rows and the
    last token id), and values past the documented bounds are refused, naming the field."""
    engine = Engine(model, num_pages=32, page_size=8)
    prompt = [3, 1, 4, 1, 5]
    greedy = engine.generate([prompt], max_new_tokens=6, logprobs=True)[0]
    for temperature in (1e-40, 5e-6):
        rid = engine.submit(prompt, max_new_tokens=6, temperature=temperature, seed=1, logprobs=True)
        events = run_to_completion(engine)
        assert engine.result(rid).output_token_ids == greedy.output_token_ids
        assert all(math.isfinite(e.logprob) for e in events)
    # the hottest allowed temperature with a masked stop id still never draws it early
    stop = greedy.output_token_ids[0]
    (hot,) = engine.generate(
        [prompt], max_new_tokens=8, temperature=100.0, seed=3, min_new_tokens=8, stop_token_ids=[stop]
    )
    assert len(hot.output_token_ids) == 8 and stop not in hot.output_token_ids[:7]
    for field, value in (
        ("temperature", 100.5), ("temperature", 1e39),
        ("repetition_penalty", 1e-300), ("repetition_penalty", 0.005), ("repetition_penalty", 101.0),
    ):
        with pytest.raises(InvalidRequestError) as info:
            engine.submit([1], **{field: value})
        assert info.value.field == field
    assert engine.idle
    assert_pool_free(engine)


def test_top_logprobs_beyond_a_small_vocabulary_give_all_tokens(tmp_path):
    small = Qwen3.from_directory(make_checkpoint(tmp_path / "v10", vocab_size=10), dtype="float32")
    engine = Engine(small, num_pages=16, page_size=4)
    want = engine.submit([1, 2, 3], max_new_tokens=3, logprobs=True, top_logprobs=20)
    plain = engine.submit([4, 5], max_new_tokens=3)
    events = run_to_completion(engine)
    assert engine.result(plain).finish_reason is FinishReason.LENGTH
    mine = [e for e in events if e.request_id == want]
    assert engine.result(want).finish_reason is FinishReason.LENGTH and len(mine) == 3
    assert all(len(e.top_logprobs) == 10 for e in mine)


def test_eos_ids_of_generation_config_stop_as_in_transformers(tiny_dir, tmp_path, device):
    """Qwen3's instruct checkpoints list <|endoftext|> as EOS only in generation_config.json."""
    ref = load_reference(tiny_dir)
    prompt = [3, 1, 4, 1, 5]
    full = reference_greedy(ref, prompt, 10)
    j = next(i for i in range(1, 10) if full[i] not in full[:i])
    model_dir = tmp_path / "gen-eos"
    shutil.copytree(tiny_dir, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [96, full[j]]}))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        hf = load_reference(model_dir).generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False
        )[0, len(prompt):].tolist()
    engine = Engine(Qwen3.from_directory(model_dir, device=device, dtype="float32"), num_pages=32, page_size=8)
    (ours,) = engine.generate([prompt], max_new_tokens=10)
    assert ours.output_token_ids == hf == full[: j + 1] and ours.finish_reason is FinishReason.STOP


def test_seed_zero_is_a_seed(model):
    a, b = (Engine(model, num_pages=32, page_size=4).generate([[3, 4, 5]], 16, temperature=1.5, seed=0)[0]
            for _ in range(2))
    assert a.output_token_ids == b.output_token_ids


def test_unseeded_requests_draw_different_tokens(model):
    engine = Engine(model, num_pages=64, page_size=4)
    results = engine.generate([[3, 4, 5]] * 3, 16, temperature=1.5)
    assert len({tuple(r.output_token_ids) for r in results}) > 1
