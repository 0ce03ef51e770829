"""Engine contracts a plausible bug would break silently (found by mutation testing): seeds,
finish reasons at the length boundary, ids, release, timing fields, stats, validation limits."""

import itertools
import types

import pytest

import qil_worker.engine.engine as engine_module
from engine_helpers import reference_greedy, run_to_completion
from qil_worker import DuplicateRequestError, Engine, FinishReason, UnknownRequestError


def test_a_stop_id_as_the_last_allowed_token_is_reason_stop(model, ref):
    prompt = [3, 1, 4, 1, 5]
    full = reference_greedy(ref, prompt, 10)
    k = 4
    stop = full[k]
    assert stop not in full[:k]
    (res,) = Engine(model, num_pages=32, page_size=8).generate([prompt], max_new_tokens=k + 1, stop_token_ids=[stop])
    assert res.output_token_ids == full[: k + 1]
    assert res.finish_reason is FinishReason.STOP and res.stop_reason == stop


def test_seed_zero_is_a_seed(model):
    a, b = (Engine(model, num_pages=32, page_size=4).generate([[3, 4, 5]], 16, temperature=1.5, seed=0)[0]
            for _ in range(2))
    assert a.output_token_ids == b.output_token_ids


def test_unseeded_requests_draw_different_tokens(model):
    engine = Engine(model, num_pages=64, page_size=4)
    results = engine.generate([[3, 4, 5]] * 3, 16, temperature=1.5)
    assert len({tuple(r.output_token_ids) for r in results}) > 1


def test_generated_ids_never_take_a_live_client_id(model):
    engine = Engine(model, num_pages=32, page_size=4)
    mine = engine.submit([1, 2], max_new_tokens=2, request_id="req-0")
    auto = engine.submit([3, 4, 5], max_new_tokens=2)
    assert auto != mine
    run_to_completion(engine)
    assert engine.result(mine).prompt_token_ids == [1, 2]
    assert engine.result(auto).prompt_token_ids == [3, 4, 5]


def test_release_refuses_an_active_request(model):
    engine = Engine(model, num_pages=32, page_size=4)
    rid = engine.submit([1, 2], max_new_tokens=4)
    with pytest.raises(ValueError, match="still active"):
        engine.release(rid)
    run_to_completion(engine)
    engine.release(rid)


def test_cached_page_count_is_idle_pages_only(model):
    engine = Engine(model, num_pages=64, page_size=4)
    prompt = list(range(1, 38))
    engine.generate([prompt], 2)
    assert engine.stats().num_pages_cached == 9
    engine.submit(prompt[:36] + [90], max_new_tokens=4)
    engine.step()  # the new request holds the 9 cached pages: no longer idle
    stats = engine.stats()
    assert stats.num_pages_cached == 0 and stats.num_pages_used == 10


def test_mean_inter_token_latency_over_gaps(model, monkeypatch):
    clock = itertools.count()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    engine = Engine(model, num_pages=32, page_size=4)
    (res,) = engine.generate([[1, 2, 3]], max_new_tokens=5)  # one token per step, steps evenly spaced
    assert res.mean_inter_token_latency == res.max_inter_token_latency == 2.0


def test_queue_time_ends_when_first_scheduled_not_at_first_token(model, monkeypatch):
    clock = itertools.count()
    monkeypatch.setattr(engine_module, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    engine = Engine(model, num_pages=32, page_size=4)
    (res,) = engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert res.queue_time < res.ttft


def test_a_failed_request_is_finished(model, monkeypatch):
    engine = Engine(model, num_pages=32, page_size=4)
    rid = engine.submit([1, 2, 3], max_new_tokens=4)
    monkeypatch.setattr(type(model), "forward", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.step()
    res = engine.result(rid)
    assert res.finish_reason is FinishReason.ERROR and res.finished


def test_prompt_plus_new_tokens_may_fill_every_position(model):
    engine = Engine(model, num_pages=256, page_size=4)
    n = model.config.max_position_embeddings
    rid = engine.submit([1] * (n - 12), max_new_tokens=12)  # exactly max_position_embeddings in all
    assert engine.cancel(rid)


def test_a_request_id_of_the_maximum_length_is_accepted(model):
    engine = Engine(model, num_pages=32, page_size=4)
    assert engine.submit([1], max_new_tokens=1, request_id="x" * 128) == "x" * 128


def test_prefix_hit_rate_is_cached_over_prompt_tokens(model):
    engine = Engine(model, num_pages=64, page_size=4)
    a = list(range(1, 38))           # 37 tokens
    b = a[:16] + [90, 91, 92, 93, 94]  # 21 tokens: 4 full pages shared
    engine.generate([a], 2)
    (r,) = engine.generate([b], 2)
    assert r.num_cached_tokens == 16
    assert engine.stats().prefix_cache_hit_rate == pytest.approx(16 / (37 + 21))


def test_an_id_is_free_again_once_its_cancel_event_is_out(model):
    """Reusing a cancelled id before its final event is handed out would interleave two requests'
    events under one id (and ``release`` would then meet the new one still active)."""
    engine = Engine(model, num_pages=32, page_size=4)
    engine.submit([1, 2, 3], max_new_tokens=4, request_id="a")
    engine.step()
    assert engine.cancel("a")
    with pytest.raises(DuplicateRequestError):
        engine.submit([4, 5], max_new_tokens=2, request_id="a")
    (final,) = engine.step()
    assert final.request_id == "a" and final.finish_reason is FinishReason.CANCELLED
    engine.submit([4, 5], max_new_tokens=2, request_id="a")
    run_to_completion(engine)
    assert engine.result("a").prompt_token_ids == [4, 5]


def test_the_final_event_carries_the_result_and_the_engine_retains_a_bounded_number(model):
    engine = Engine(model, num_pages=32, page_size=4, retained_results=2)
    ids = [engine.submit([1, 2, i], max_new_tokens=2) for i in range(3)]
    events = run_to_completion(engine)
    assert all(e.result is None for e in events if not e.finished)
    finals = {e.request_id: e.result for e in events if e.finished}
    assert [finals[i].prompt_token_ids for i in ids] == [[1, 2, 0], [1, 2, 1], [1, 2, 2]]
    assert all(finals[i].finish_reason is FinishReason.LENGTH and len(finals[i].output_token_ids) == 2
               for i in ids)
    with pytest.raises(UnknownRequestError):
        engine.result(ids[0])  # the oldest finished request is forgotten by the engine itself
    assert engine.result(ids[2]) == finals[ids[2]]
    engine.release(ids[2])
    engine.release(ids[2])  # already forgotten: nothing to do
    with pytest.raises(UnknownRequestError):
        engine.result(ids[2])
    with pytest.raises(ValueError, match="retained_results"):
        Engine(model, num_pages=32, page_size=4, retained_results=-1)
