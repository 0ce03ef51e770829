"""Cancel, bad input, capacity, failures and preemption: pages always come back."""

import random

import pytest

from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
import torch

from qil_worker import (
    CapacityError,
    DeviceFailedError,
    DuplicateRequestError,
    Engine,
    FinishReason,
    InvalidRequestError,
    UnknownRequestError,
)


def test_cancel_mid_prefill_frees_pages_at_once(model):
    engine = Engine(model, num_pages=64, page_size=4, token_budget=8, prefill_chunk=8)
    rid = engine.submit(list(range(40)), max_new_tokens=5)
    engine.step()
    assert engine.stats().num_pages_used == 2  # only the computed chunk holds pages
    assert engine.cancel(rid) is True
    assert engine.stats().num_pages_used == 0
    (event,) = engine.step()
    assert (event.request_id, event.finished, event.finish_reason, event.token_id) == (
        rid, True, FinishReason.CANCELLED, None)
    assert engine.result(rid).output_token_ids == []
    assert engine.cancel(rid) is False and engine.cancel("nope") is False
    assert engine.idle
    assert_pool_free(engine)


def test_cancel_mid_decode_keeps_tokens_so_far(model, ref):
    engine = Engine(model, num_pages=64, page_size=4)
    rid = engine.submit([4, 5, 6], max_new_tokens=20)
    other = engine.submit([7, 8], max_new_tokens=6)
    for _ in range(4):
        engine.step()
    engine.cancel(rid)
    events = run_to_completion(engine)
    final = [e for e in events if e.request_id == rid]
    assert len(final) == 1 and final[0].finish_reason is FinishReason.CANCELLED
    assert engine.result(rid).output_token_ids == reference_greedy(ref, [4, 5, 6], 4)
    assert engine.result(other).output_token_ids == reference_greedy(ref, [7, 8], 6)
    assert_pool_free(engine)


def test_cancel_while_waiting(model):
    engine = Engine(model, num_pages=64, page_size=4, max_active=1)
    first = engine.submit([1, 2], max_new_tokens=3)
    queued = engine.submit([3, 4], max_new_tokens=3)
    engine.step()
    assert engine.stats().num_waiting == 1
    assert engine.cancel(queued)
    run_to_completion(engine)
    assert engine.result(first).finish_reason is FinishReason.LENGTH
    assert engine.result(queued).finish_reason is FinishReason.CANCELLED
    assert_pool_free(engine)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(token_ids=[]), "token_ids"),
        (dict(token_ids=[1, 97]), "token_ids"),
        (dict(token_ids=[-1]), "token_ids"),
        (dict(token_ids=[1.5]), "token_ids"),
        (dict(token_ids="abc"), "token_ids"),
        (dict(token_ids=[1], max_new_tokens=0), "max_new_tokens"),
        (dict(token_ids=[1], max_new_tokens=-3), "max_new_tokens"),
        (dict(token_ids=[1], stop_token_ids=[1000]), "stop_token_ids"),
        (dict(token_ids=[1], request_id="x" * 129), "request_id"),
        (dict(token_ids=[1], request_id=""), "request_id"),
        (dict(token_ids=[1] * 500, max_new_tokens=13), "max_new_tokens"),  # > 512 positions
    ],
)
def test_bad_requests_are_rejected_with_the_field(model, kwargs, field):
    engine = Engine(model, num_pages=256, page_size=4)
    with pytest.raises(InvalidRequestError) as info:
        engine.submit(**kwargs)
    assert info.value.field == field
    assert engine.idle


def test_over_capacity_rejected_and_engine_still_serves(model, ref):
    engine = Engine(model, num_pages=4, page_size=4)  # 16 token slots in all
    with pytest.raises(CapacityError, match="KV pages"):
        engine.submit(list(range(10)), max_new_tokens=8)  # needs 17 slots
    rid = engine.submit(list(range(10)), max_new_tokens=7)  # needs exactly 16
    run_to_completion(engine)
    assert engine.result(rid).output_token_ids == reference_greedy(ref, list(range(10)), 7)
    assert_pool_free(engine)


def test_duplicate_and_reused_ids(model):
    engine = Engine(model, num_pages=32, page_size=4)
    engine.submit([1], max_new_tokens=2, request_id="a")
    with pytest.raises(DuplicateRequestError):
        engine.submit([2], max_new_tokens=2, request_id="a")
    run_to_completion(engine)
    engine.submit([2], max_new_tokens=2, request_id="a")  # finished ids may be reused
    run_to_completion(engine)
    assert engine.result("a").prompt_token_ids == [2]
    engine.release("a")
    with pytest.raises(UnknownRequestError):
        engine.result("a")


def test_failed_forward_fails_that_step_only(model, ref, monkeypatch):
    engine = Engine(model, num_pages=64, page_size=4)
    a = engine.submit([1, 2, 3], max_new_tokens=4)
    engine.step()
    real_forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    events = engine.step()
    monkeypatch.setattr(type(model), "forward", real_forward)
    assert [(e.request_id, e.finish_reason) for e in events] == [(a, FinishReason.ERROR)]
    assert "boom" in events[0].error and "boom" in engine.result(a).error
    assert_pool_free(engine)
    b = engine.submit([1, 2, 3], max_new_tokens=4)
    run_to_completion(engine)
    assert engine.result(b).output_token_ids == reference_greedy(ref, [1, 2, 3], 4)


def _raising(exc):
    def forward(*args, **kwargs):
        raise exc
    return forward


def _accelerator_error(message):
    return getattr(torch, "AcceleratorError", RuntimeError)(message)


@pytest.mark.parametrize("error", [
    lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    lambda: _accelerator_error("CUDA error: out of memory"),
    lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
])
def test_a_passing_device_error_fails_that_step_only(model, monkeypatch, error):
    """Memory pressure is not a dead device: the next step may fit."""
    engine = Engine(model, num_pages=64, page_size=4, max_active=1)
    a, b = engine.submit([1, 2, 3], max_new_tokens=4), engine.submit([4, 5], max_new_tokens=4)
    monkeypatch.setattr(model, "forward", _raising(error()))
    events = engine.step()
    monkeypatch.undo()
    assert [(e.request_id, e.finish_reason) for e in events] == [(a, FinishReason.ERROR)]
    run_to_completion(engine)
    assert engine.result(b).finish_reason == FinishReason.LENGTH and engine.device_failure is None


@pytest.mark.parametrize("error", ["AcceleratorError", "RuntimeError"])
def test_a_sticky_device_error_ends_every_request_and_refuses_more(model, monkeypatch, error):
    """After an illegal memory access every CUDA call fails: the engine ends all its requests
    (running, waiting) with the error instead of failing them one step at a time, forever.
    (torch raises AcceleratorError; versions before it, a RuntimeError.)"""
    cls = RuntimeError if error == "RuntimeError" else getattr(torch, error, None)
    if cls is None:
        pytest.skip(f"torch {torch.__version__} has no {error}")
    engine = Engine(model, num_pages=64, page_size=4, max_active=2)
    ids = [engine.submit([1, 2, 3 + i], max_new_tokens=8) for i in range(3)]  # the third waits
    engine.step()
    message = "CUDA error: an illegal memory access was encountered"
    monkeypatch.setattr(model, "forward", _raising(cls(message)))
    events = engine.step()
    monkeypatch.undo()
    assert sorted(e.request_id for e in events) == sorted(ids)
    assert all(e.finished and e.finish_reason == FinishReason.ERROR and message in e.error for e in events)
    assert message in engine.device_failure and engine.idle
    assert_pool_free(engine)
    with pytest.raises(DeviceFailedError, match="illegal memory access"):
        engine.submit([1, 2], max_new_tokens=2)
    with pytest.raises(DeviceFailedError):
        engine.step()
    assert engine.result(ids[2]).finish_reason == FinishReason.ERROR


def test_short_budget_round_robin_starves_nobody(model):
    engine = Engine(model, num_pages=128, page_size=4, token_budget=2, prefill_chunk=2)
    ids = [engine.submit([i + 1], max_new_tokens=6) for i in range(5)]
    progress_at = {}
    for step in range(200):
        if engine.idle:
            break
        for e in engine.step():
            progress_at.setdefault(e.request_id, []).append(step)
    assert all(engine.result(i).finish_reason is FinishReason.LENGTH for i in ids)
    # with 5 decoders sharing 2 tokens a step, nobody waits more than 3 steps between tokens
    for steps in progress_at.values():
        assert max(b - a for a, b in zip(steps, steps[1:])) <= 3
    assert_pool_free(engine)


def test_random_mix_of_everything_keeps_the_pool_consistent(model):
    """Random submits, cancels, tiny pool (preemption), short budgets; invariants every step."""
    rng = random.Random(1234)
    engine = Engine(model, num_pages=20, page_size=4, token_budget=16, prefill_chunk=6, max_active=5, debug=True)
    live, seen_final, last_index = set(), set(), {}
    for step in range(400):
        if step < 300 and rng.random() < 0.3:
            prompt = [rng.randrange(97) for _ in range(rng.randint(1, 30))]
            live.add(engine.submit(prompt, max_new_tokens=rng.randint(1, 20)))
        if live and rng.random() < 0.08:
            engine.cancel(rng.choice(sorted(live)))
        for e in engine.step():
            assert e.request_id not in seen_final, "event after the final one"
            if e.token_id is not None:
                assert e.index == last_index.get(e.request_id, -1) + 1, "gap or repeat"
                last_index[e.request_id] = e.index
            if e.finished:
                seen_final.add(e.request_id)
                live.discard(e.request_id)
        held = sum(len(r.page_table.pages) for r in engine.scheduler.running)
        stats = engine.stats()
        assert held == stats.num_pages_used and stats.num_pages_used + stats.num_pages_free == 20
        assert all(not r.page_table.pages for r in engine.scheduler.waiting)
    run_to_completion(engine)
    assert not live
    assert_pool_free(engine)
    assert any(engine.result(r).num_preemptions for r in seen_final)


def test_close_cancels_and_refuses_more(model):
    engine = Engine(model, num_pages=16, page_size=4)
    rid = engine.submit([1, 2], max_new_tokens=5)
    cancelled = engine.submit([3, 4], max_new_tokens=5)
    engine.step()
    engine.cancel(cancelled)  # its final event waits for a step that will not come
    engine.close()
    assert engine.result(rid).finish_reason is FinishReason.CANCELLED
    assert engine.pool.num_free == 16
    assert engine.idle, "a closed engine has nothing left to step"
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1], max_new_tokens=1)


def test_engine_arguments_are_checked(model):
    with pytest.raises(ValueError, match="num_pages"):
        Engine(model, num_pages=0)
    with pytest.raises(ValueError, match="token_budget"):
        Engine(model, token_budget=-1)


def test_generate_is_all_or_nothing(model, ref):
    engine = Engine(model, num_pages=16, page_size=4)
    with pytest.raises(InvalidRequestError) as info:
        engine.generate([[1, 2], [3, 500]], max_new_tokens=3)
    assert info.value.field == "token_ids"
    assert engine.idle and engine.stats().num_waiting == 0
    with pytest.raises(UnknownRequestError):
        engine.result("req-0")  # the valid prompt before the refused one was withdrawn
    assert_pool_free(engine)
    (result,) = engine.generate([[1, 2]], max_new_tokens=3)
    assert result.output_token_ids == reference_greedy(ref, [1, 2], 3)


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
