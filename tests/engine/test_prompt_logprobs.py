"""prompt_logprobs: every prompt token's log-probability after the first (and the top-N there)
equal to log_softmax of transformers' logits, float32 — in one chunk or many, with a prefix-cache
hit available (recomputed), after preemptions (each position once), beside requests that do not
ask (their tokens unchanged, their steps computing no extra logits)."""

import pytest
import torch

from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from qil_worker import Engine, InvalidRequestError
from qil_worker.engine import prompt_logprobs as prompt_logprobs_module
from qil_worker.engine.runner.batch import build_step_inputs
from qil_worker.engine.outputs import RequestMetrics
from qil_worker.engine.prompt_logprobs import PromptLogprobs
from qil_worker.engine.request import Request, RequestStatus
from qil_worker.engine.sampling_params import SamplingParams
from qil_worker.engine.scheduler import ScheduledChunk, Scheduler
from qil_worker.kv import PagePool, PageTable, PrefixCache

ATOL = 1e-4  # as tests/model/test_model_logits.py
PROMPT = [(5 * i + 3) % 97 for i in range(30)]


def _reference(ref, prompt, n_top):
    """transformers' log-probabilities of prompt[1:] and the n_top best at each position."""
    with torch.no_grad():
        logprobs = torch.log_softmax(ref(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    own = logprobs.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    return own, logprobs.topk(n_top, dim=-1) if n_top else None


def _assert_matches(ref, prompt, n_top, logprobs, top):
    own, best = _reference(ref, prompt, n_top)
    assert len(logprobs) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor(logprobs), own, atol=ATOL, rtol=0)
    if not n_top:
        assert top is None
        return
    assert len(top) == len(prompt) - 1 and all(len(t) == n_top for t in top)
    assert [[i for i, _ in t] for t in top] == best.indices.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in t] for t in top]), best.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("prefill_chunk, n_top", [(64, 0), (64, 5), (7, 3), (4, 20)],
                         ids=["one-chunk-N0", "one-chunk-N5", "chunks-of-7", "chunks-of-page-N20"])
def test_prompt_logprobs_equal_log_softmax_of_reference_logits(model, ref, prefill_chunk, n_top):
    engine = Engine(model, num_pages=64, page_size=4, token_budget=64, prefill_chunk=prefill_chunk)
    rid = engine.submit(PROMPT, max_new_tokens=4, prompt_logprobs=n_top)
    events = run_to_completion(engine)
    first = events[0]
    assert first.request_id == rid and first.index == 0
    _assert_matches(ref, PROMPT, n_top, first.prompt_logprobs, first.prompt_top_logprobs)
    assert all(e.prompt_logprobs is None and e.prompt_top_logprobs is None for e in events[1:])
    result = engine.result(rid)
    assert result.prompt_logprobs == first.prompt_logprobs
    assert result.prompt_top_logprobs == first.prompt_top_logprobs
    assert result.output_token_ids == reference_greedy(ref, PROMPT, 4)  # sampling is unaffected
    assert_pool_free(engine)


def test_they_are_of_the_raw_model_not_of_bias_penalties_or_temperature(model, ref):
    engine = Engine(model, num_pages=64, page_size=4, prefill_chunk=8)
    rid = engine.submit(PROMPT, max_new_tokens=3, prompt_logprobs=2, temperature=2.0, seed=1,
                        repetition_penalty=1.5, logit_bias={PROMPT[5]: 100.0, PROMPT[9]: -100.0})
    run_to_completion(engine)
    res = engine.result(rid)
    _assert_matches(ref, PROMPT, 2, res.prompt_logprobs, res.prompt_top_logprobs)


def test_a_prefix_cache_hit_is_recomputed_and_the_pages_are_still_published(model, ref):
    engine = Engine(model, num_pages=64, page_size=4, prefill_chunk=64)
    engine.generate([PROMPT], max_new_tokens=2)  # the prompt's pages are now cached
    rid = engine.submit(PROMPT, max_new_tokens=2, prompt_logprobs=4)
    run_to_completion(engine)
    res = engine.result(rid)
    assert res.num_cached_tokens == 0
    _assert_matches(ref, PROMPT, 4, res.prompt_logprobs, res.prompt_top_logprobs)
    # and it published its own pages: a fresh cache sees them after a prompt_logprobs request
    fresh = Engine(model, num_pages=64, page_size=4, prefill_chunk=64)
    fresh.generate([PROMPT], max_new_tokens=2, prompt_logprobs=0)
    (plain,) = fresh.generate([PROMPT], max_new_tokens=2)
    assert plain.num_cached_tokens == 28 and plain.prompt_logprobs is None


def test_requests_admitted_into_one_step_do_not_share_pages_they_must_score(model, ref):
    engine = Engine(model, num_pages=64, page_size=4, token_budget=64, prefill_chunk=16)
    a = engine.submit(PROMPT, max_new_tokens=2)
    b = engine.submit(PROMPT, max_new_tokens=2, prompt_logprobs=1)
    run_to_completion(engine)
    assert engine.result(b).num_cached_tokens == 0
    _assert_matches(ref, PROMPT, 1, engine.result(b).prompt_logprobs, engine.result(b).prompt_top_logprobs)
    assert engine.result(a).output_token_ids == engine.result(b).output_token_ids


def _collector(prompt_len: int, scored: int) -> Request:
    r = Request(request_id="r", prompt_token_ids=list(range(prompt_len)), max_new_tokens=2,
                stop_token_ids=frozenset(), page_table=PageTable(4), metrics=RequestMetrics(0.0),
                sampling=SamplingParams(prompt_logprobs=0))
    r.prompt_logprobs = PromptLogprobs.asked(0, prompt_len)
    r.prompt_logprobs.logprobs.extend([-1.0] * scored)
    return r


@pytest.mark.parametrize("scored, pages", [(0, 0), (3, 0), (4, 1), (11, 2), (19, 4)])
def test_cached_pages_are_shared_only_up_to_the_positions_already_scored(scored, pages):
    pool = PagePool(32)
    scheduler = Scheduler(pool, 64, 64, 4, prefix_cache=PrefixCache(pool, 4))
    assert scheduler._shareable_pages(_collector(20, scored)) == pages


def test_after_preemptions_every_prompt_position_is_scored_once(model, ref):
    """A tiny pool preempts the prompt_logprobs request in the middle of its prefill, again and
    again; its recomputes score nothing twice and nothing is missing."""
    engine = Engine(model, num_pages=10, page_size=4, token_budget=64, prefill_chunk=4, debug=True)
    first = engine.submit([1, 2, 3, 4], max_new_tokens=30)
    prompt = [(5 * i + 3) % 97 for i in range(32)]
    rid = engine.submit(prompt, max_new_tokens=3, prompt_logprobs=2)
    request = engine._requests[rid]
    preempted_mid_prefill = 0
    while not engine.idle:
        before = request.metrics.num_preemptions
        engine.step()
        if request.metrics.num_preemptions > before and not request.prompt_logprobs.complete:
            preempted_mid_prefill += 1
    assert preempted_mid_prefill > 0, "the pool was meant to preempt it while it prefills"
    res = engine.result(rid)
    _assert_matches(ref, prompt, 2, res.prompt_logprobs, res.prompt_top_logprobs)
    assert res.output_token_ids == reference_greedy(ref, prompt, 3)
    assert engine.result(first).output_token_ids == reference_greedy(ref, [1, 2, 3, 4], 30)
    assert_pool_free(engine)


def test_preempted_after_its_first_token_it_delivers_them_once(model, ref):
    engine = Engine(model, num_pages=6, page_size=4, token_budget=64, prefill_chunk=64)
    engine.submit(list(range(8)), max_new_tokens=12)
    engine.submit(list(range(8)), max_new_tokens=12)
    victim = engine.submit(PROMPT[:8], max_new_tokens=12, prompt_logprobs=3)
    events = run_to_completion(engine)
    assert engine.result(victim).num_preemptions >= 1
    mine = [e for e in events if e.request_id == victim]
    assert [e.prompt_logprobs is not None for e in mine] == [True] + [False] * (len(mine) - 1)
    _assert_matches(ref, PROMPT[:8], 3, mine[0].prompt_logprobs, mine[0].prompt_top_logprobs)
    assert_pool_free(engine)


def test_batched_with_requests_that_do_not_ask(model, ref):
    others = [[3, 1, 4, 1, 5], list(range(20, 45)), [9]]
    engine = Engine(model, num_pages=64, page_size=4, token_budget=24, prefill_chunk=8)
    plain = [engine.submit(p, max_new_tokens=8) for p in others]
    rid = engine.submit(PROMPT, max_new_tokens=8, prompt_logprobs=5)
    events = run_to_completion(engine)
    for p, r in zip(others, plain):
        res = engine.result(r)
        assert res.output_token_ids == reference_greedy(ref, p, 8) and res.prompt_logprobs is None
    assert all(e.prompt_logprobs is None for e in events if e.request_id != rid)
    res = engine.result(rid)
    _assert_matches(ref, PROMPT, 5, res.prompt_logprobs, res.prompt_top_logprobs)


def test_logits_only_at_sampled_positions_for_requests_that_do_not_ask(model):
    """The step batch asks the LM head for one row per sampled chunk, plus exactly the prompt
    positions still to score of the requests that asked."""
    engine = Engine(model, num_pages=64, page_size=4)

    def request(rid, n, top_n=None):
        sampling = SamplingParams(prompt_logprobs=top_n)
        r = Request(rid, list(range(n)), 4, frozenset(), PageTable(4), RequestMetrics(0.0), sampling)
        r.prompt_logprobs = PromptLogprobs.asked(top_n, n)
        r.page_table.grow(n, engine.pool)
        return r

    plain, asking = request("a", 12), request("b", 10, top_n=1)
    chunks = [ScheduledChunk(plain, 0, 12), ScheduledChunk(asking, 0, 6)]
    batch = build_step_inputs(chunks, engine.runner.attention, 4, model.config.num_query_groups, model.device)
    assert [c.request for c in batch.sampled] == [plain]
    assert [(r.collector, r.start, r.count) for r in batch.prompt_rows] == [(asking.prompt_logprobs, 0, 6)]
    flat = {id(c.request): sum(x.num_tokens for x in batch.chunks[: batch.chunks.index(c)]) for c in batch.chunks}
    assert batch.logit_indices.tolist() == [flat[id(plain)] + 11] + [flat[id(asking)] + p for p in range(6)]
    # the last chunk of the prompt: its last position is the sampled one, not scored again
    asking.prompt_logprobs.logprobs.extend([0.0] * 6)
    batch = build_step_inputs([ScheduledChunk(asking, 6, 4)], engine.runner.attention, 4, 2, model.device)
    assert [(r.start, r.count) for r in batch.prompt_rows] == [(6, 3)]
    assert batch.logit_indices.tolist() == [3, 0, 1, 2]
    alone = build_step_inputs([ScheduledChunk(plain, 0, 12)], engine.runner.attention, 4, 2, model.device)
    assert alone.logit_indices.tolist() == [11] and alone.prompt_rows == []
    plain.page_table.release(engine.pool)
    asking.page_table.release(engine.pool)


def test_through_the_padded_decode_path(model, ref):
    """Decode-only steps (replayed from graphs on CUDA) never hold prompt positions: with that
    path on, the prompt logprobs are still exact."""
    engine = Engine(model, num_pages=64, page_size=4, prefill_chunk=8, cuda_graphs=True)
    rid = engine.submit(PROMPT, max_new_tokens=6, prompt_logprobs=2)
    run_to_completion(engine)
    assert engine.runner.decode_graphs.steps > 0
    res = engine.result(rid)
    _assert_matches(ref, PROMPT, 2, res.prompt_logprobs, res.prompt_top_logprobs)


def test_edge_cases_one_token_prompt_first_token_final_and_cancel(model, ref):
    engine = Engine(model, num_pages=64, page_size=4, prefill_chunk=8)
    one = engine.submit([5], max_new_tokens=2, prompt_logprobs=3)
    final_first = engine.submit(PROMPT, max_new_tokens=1, prompt_logprobs=0)
    cancelled = engine.submit(PROMPT, max_new_tokens=4, prompt_logprobs=1)
    events = engine.step()  # every prompt's first chunk: the one-token prompt samples already
    engine.cancel(cancelled)
    events += run_to_completion(engine)
    by_id = {}
    for e in events:
        by_id.setdefault(e.request_id, []).append(e)
    assert by_id[one][0].prompt_logprobs == [] and by_id[one][0].prompt_top_logprobs == []
    (ev,) = by_id[final_first]
    assert ev.finished and ev.result.prompt_logprobs == ev.prompt_logprobs
    _assert_matches(ref, PROMPT, 0, ev.prompt_logprobs, ev.prompt_top_logprobs)
    assert all(e.prompt_logprobs is None for e in by_id[cancelled])
    assert engine.result(cancelled).prompt_logprobs is None
    assert_pool_free(engine)


@pytest.mark.parametrize("value", [-1, 21, True, 2.0, "3"])
def test_bad_prompt_logprobs_is_invalid_naming_the_field(model, value):
    engine = Engine(model, num_pages=16, page_size=4)
    with pytest.raises(InvalidRequestError) as exc:
        engine.submit([1, 2], max_new_tokens=2, prompt_logprobs=value)
    assert exc.value.field == "prompt_logprobs"


def test_a_prompt_whose_logprobs_would_be_too_many_is_refused(model, monkeypatch):
    monkeypatch.setattr(prompt_logprobs_module, "MAX_PROMPT_LOGPROB_ENTRIES", 100)
    engine = Engine(model, num_pages=64, page_size=4)
    with pytest.raises(InvalidRequestError) as exc:
        engine.submit(PROMPT, max_new_tokens=2, prompt_logprobs=3)  # 29 x 4 = 116
    assert exc.value.field == "prompt_logprobs" and "116" in str(exc.value)
    engine.submit(PROMPT, max_new_tokens=2, prompt_logprobs=2)  # 29 x 3 = 87
    engine.submit(PROMPT * 4, max_new_tokens=2)  # not asked: no bound
    run_to_completion(engine)
    assert_pool_free(engine)
    assert prompt_logprobs_module.MAX_PROMPT_LOGPROB_ENTRIES == 100
    monkeypatch.undo()
    assert prompt_logprobs_module.MAX_PROMPT_LOGPROB_ENTRIES == 1 << 18


def test_a_waiting_requests_collector_is_untouched_by_steps_it_is_not_in(model):
    engine = Engine(model, num_pages=8, page_size=4, token_budget=8, prefill_chunk=8, max_active=1)
    engine.submit(list(range(8)), max_new_tokens=4)
    rid = engine.submit(PROMPT[:12], max_new_tokens=2, prompt_logprobs=1)
    engine.step()
    request = engine._requests[rid]
    assert request.status is RequestStatus.WAITING and request.prompt_logprobs.num_scored == 0
    run_to_completion(engine)
    assert len(engine.result(rid).prompt_logprobs) == 11
