"""Scheduling order, each rule pinned where the end-to-end tests would let a change pass:
prefill chunks capped, decodes first, FCFS head-of-line, preempted requests back at the head,
prefills taking turns, same-step sharing."""

from engine_helpers import reference_greedy, run_to_completion
from qil_worker import Engine
from qil_worker.engine.outputs import RequestMetrics
from qil_worker.engine.request import Request
from qil_worker.engine.scheduler import Scheduler
from qil_worker.kv import PagePool, PageTable


def test_prefill_chunk_caps_every_chunk_not_only_the_budget(model):
    engine = Engine(model, num_pages=64, page_size=4, token_budget=64, prefill_chunk=8)
    engine.submit(list(range(40)), max_new_tokens=2)
    engine.step()  # admission: first chunk
    assert engine.stats().num_pages_used == 2
    engine.step()  # running: second chunk
    assert engine.stats().num_pages_used == 4


def test_decodes_are_not_stalled_by_a_long_prefill(model):
    engine = Engine(model, num_pages=64, page_size=4, token_budget=8, prefill_chunk=8)
    a = engine.submit([1, 2, 3], max_new_tokens=20)
    engine.step()
    engine.submit(list(range(60)), max_new_tokens=2)
    for _ in range(8):  # the newcomer prefills 7-8 tokens a step; a still decodes every step
        assert a in {e.request_id for e in engine.step()}


def test_fcfs_does_not_let_a_later_request_overtake_one_that_does_not_fit(model):
    engine = Engine(model, num_pages=10, page_size=4, token_budget=64, prefill_chunk=64)
    engine.submit(list(range(28)), max_new_tokens=8)  # 7 pages now, up to 9 later
    engine.step()
    big = engine.submit(list(range(50, 66)), max_new_tokens=2)  # needs 4 pages: does not fit yet
    small = engine.submit([5, 6], max_new_tokens=2)  # needs 1 page
    engine.step()
    assert [r.request_id for r in engine.scheduler.waiting] == [big, small]


def test_a_preempted_request_goes_back_to_the_head_of_the_queue(model):
    engine = Engine(model, num_pages=6, page_size=4, token_budget=64, prefill_chunk=64)
    engine.submit(list(range(8)), max_new_tokens=12)
    engine.submit(list(range(8)), max_new_tokens=12)
    victim = engine.submit(list(range(8)), max_new_tokens=12)
    engine.step()  # all three admitted: 6 pages used
    later = engine.submit([1, 2], max_new_tokens=2)
    engine.step()  # the first decode needs a 7th page: the newest (victim) is preempted
    assert engine.result(victim).num_preemptions == 1
    assert [r.request_id for r in engine.scheduler.waiting][:2] == [victim, later]


def _req(name, n):
    return Request(request_id=name, prompt_token_ids=list(range(n)), max_new_tokens=4, stop_token_ids=frozenset(),
                   page_table=PageTable(4), metrics=RequestMetrics(arrival_time=0.0))


def test_running_prefills_take_turns_when_the_budget_is_short():
    s = Scheduler(PagePool(100), token_budget=8, prefill_chunk=6, max_active=4)
    s.add(_req("a", 60)); s.add(_req("b", 60))
    splits = []
    for _ in range(3):
        chunks = s.schedule()
        s.commit(chunks)
        splits.append({c.request.request_id: c.num_tokens for c in chunks})
    assert splits[0] == {"a": 6, "b": 2}
    assert {"a": 6, "b": 2} in splits[1:] and {"a": 2, "b": 6} in splits[1:], splits


def test_a_newcomer_shares_prefix_pages_a_running_prefill_fills_in_the_same_step(model, ref):
    prefix = [(7 * i) % 97 for i in range(36)]
    engine = Engine(model, num_pages=64, page_size=4, token_budget=16, prefill_chunk=8, debug=True)
    engine.submit(prefix + [1, 2, 3, 4], max_new_tokens=3)
    engine.step()  # a computes tokens 0-7; pages 0-1 indexed
    c = engine.submit(prefix + [5, 6], max_new_tokens=3)
    engine.step()  # a fills pages 2-3 this step; c is admitted into it and reads them
    assert engine.result(c).num_cached_tokens == 16
    run_to_completion(engine)
    assert engine.result(c).output_token_ids == reference_greedy(ref, prefix + [5, 6], 3)


def test_a_preempted_request_counts_once_for_the_hit_rate_and_its_cached_tokens(model):
    """Re-admitted after preemption, a request finds its own prompt pages in the cache; that is
    not a prefix hit (its prompt would count twice and the rate would rise with preemptions)."""
    engine = Engine(model, num_pages=8, page_size=4, token_budget=64, prefill_chunk=64)
    engine.submit([80 + i for i in range(8)], max_new_tokens=1)
    run_to_completion(engine)  # its cached pages are the oldest: evicted first
    engine.submit(list(range(8)), max_new_tokens=8)  # 4 pages at most, and it must finish first
    victim = engine.submit([40 + i for i in range(16)], max_new_tokens=6)  # 4 prompt pages
    while engine.result(victim).num_preemptions == 0:
        engine.step()  # the first one's 4th page: the victim is preempted, its prompt pages stay cached
    run_to_completion(engine)  # the first one finishes; the victim comes back onto its own prompt pages
    assert engine.result(victim).finish_reason.value == "length"
    assert engine.result(victim).num_cached_tokens == 0
    assert engine.stats().prefix_cache_hit_rate == 0.0
