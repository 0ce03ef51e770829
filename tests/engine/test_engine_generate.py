"""Concurrent greedy generation must equal transformers' per-prompt greedy tokens; finish reasons
and the timing fields of the results."""

import itertools
import random
import types

import pytest

import qil_worker.engine.engine as engine_module
from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from qil_worker import Engine, FinishReason, Qwen3


def _prompts():
    rng = random.Random(7)
    lengths = [1, 1, 3, 9, 16, 17, 40, 70]  # 1-token prompts and prompts over several pages
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def expected(ref):
    return [reference_greedy(ref, p, 12) for p in _prompts()]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_pages=128, page_size=8, token_budget=512, prefill_chunk=512),
        dict(num_pages=128, page_size=4, token_budget=24, prefill_chunk=7),  # chunked, budget-bound
        dict(num_pages=128, page_size=16, token_budget=64, prefill_chunk=64, max_active=3),
    ],
    ids=["wide", "chunked", "few-active"],
)
def test_concurrent_greedy_matches_reference(model, expected, kwargs):
    engine = Engine(model, debug=True, **kwargs)
    results = engine.generate(_prompts(), max_new_tokens=12)
    assert [r.output_token_ids for r in results] == expected
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert_pool_free(engine)


def test_preemption_under_a_tiny_pool_loses_nothing(model, expected):
    """The pool holds about two requests: the scheduler must preempt and recompute."""
    prompts = _prompts()
    engine = Engine(model, num_pages=24, page_size=4, token_budget=64, prefill_chunk=16, debug=True)
    ids = [engine.submit(p, max_new_tokens=12) for p in prompts]
    events = run_to_completion(engine)
    results = [engine.result(i) for i in ids]
    assert [r.output_token_ids for r in results] == expected
    assert sum(r.num_preemptions for r in results) > 0, "the pool was meant to force preemption"
    # every token reported exactly once, in order
    for rid, want in zip(ids, expected):
        mine = [e for e in events if e.request_id == rid]
        assert [e.token_id for e in mine] == want
        assert [e.index for e in mine] == list(range(len(want)))
        assert [e.finished for e in mine] == [False] * (len(want) - 1) + [True]
    assert_pool_free(engine)


def test_requests_submitted_between_steps_join_the_batch(model, ref):
    engine = Engine(model, num_pages=64, page_size=8)
    first = engine.submit([5, 6, 7], max_new_tokens=10)
    for _ in range(4):
        engine.step()
    second = engine.submit([9, 8], max_new_tokens=6)
    batch_sizes = []
    while not engine.idle:
        before = {e.request_id for e in engine.step()}
        batch_sizes.append(len(before))
    assert 2 in batch_sizes, "the late request should have shared steps with the first"
    assert engine.result(first).output_token_ids == reference_greedy(ref, [5, 6, 7], 10)
    assert engine.result(second).output_token_ids == reference_greedy(ref, [9, 8], 6)


def test_stop_ids_and_model_eos(model, ref, tiny_dir, device):
    prompt = [3, 1, 4, 1, 5]
    full = reference_greedy(ref, prompt, 10)
    stop = full[4]
    engine = Engine(model, num_pages=32, page_size=8)
    (res,) = engine.generate([prompt], max_new_tokens=10, stop_token_ids=[stop])
    assert res.output_token_ids == full[: full.index(stop) + 1]
    assert res.finish_reason is FinishReason.STOP

    eos_model = Qwen3.from_directory(tiny_dir, device=device, dtype="float32")
    object.__setattr__(eos_model.config, "eos_token_ids", (full[2],))
    (res,) = Engine(eos_model, num_pages=32, page_size=8).generate([prompt], max_new_tokens=10)
    assert res.output_token_ids == full[: full.index(full[2]) + 1]
    assert res.finish_reason is FinishReason.STOP


def test_metrics_are_measured(model):
    engine = Engine(model, num_pages=32, page_size=8)
    (res,) = engine.generate([[1, 2, 3]], max_new_tokens=5)
    assert 0 <= res.queue_time <= res.ttft <= res.completion_time
    assert res.mean_inter_token_latency > 0 and res.max_inter_token_latency >= res.mean_inter_token_latency
    assert res.num_preemptions == 0


def test_a_stop_id_as_the_last_allowed_token_is_reason_stop(model, ref):
    prompt = [3, 1, 4, 1, 5]
    full = reference_greedy(ref, prompt, 10)
    k = 4
    stop = full[k]
    assert stop not in full[:k]
    (res,) = Engine(model, num_pages=32, page_size=8).generate([prompt], max_new_tokens=k + 1, stop_token_ids=[stop])
    assert res.output_token_ids == full[: k + 1]
    assert res.finish_reason is FinishReason.STOP and res.stop_reason == stop


def test_mean_inter_token_latency_over_gaps(model, monkeypatch):
    clock = itertools.count()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    # synchronous steps, so that each reads the clock the same number of times (overlap, the
    # CUDA default, reads it once less on the step that launches the first decode)
    engine = Engine(model, num_pages=32, page_size=4, overlap=False)
    (res,) = engine.generate([[1, 2, 3]], max_new_tokens=5)  # one token per step, steps evenly spaced
    assert res.mean_inter_token_latency == res.max_inter_token_latency == 2.0


def test_queue_time_ends_when_first_scheduled_not_at_first_token(model, monkeypatch):
    clock = itertools.count()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    engine = Engine(model, num_pages=32, page_size=4)
    (res,) = engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert res.queue_time < res.ttft
