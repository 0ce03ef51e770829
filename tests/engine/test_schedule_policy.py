"""Admission order: fcfs keeps arrival order; shortest-first takes the least work left after the
cached prefix, never starves a request, and changes no output."""

from __future__ import annotations

import random

import pytest

from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from qil_worker import Engine
from qil_worker.engine.outputs import RequestMetrics
from qil_worker.engine.request import Request
from qil_worker.engine.scheduler import Scheduler
from qil_worker.kv import PagePool, PageTable, PrefixCache, page_hashes
from qil_worker.engine.schedule_policy import MAX_BYPASS

PAGE = 4


def _request(name: str, prompt: list[int]) -> Request:
    return Request(
        request_id=name, prompt_token_ids=prompt, max_new_tokens=4, stop_token_ids=frozenset(),
        page_table=PageTable(PAGE), metrics=RequestMetrics(arrival_time=0.0),
        page_hashes=page_hashes(prompt, PAGE),
    )


def _scheduler(policy: str, cache: bool = False, budget: int = 1000, num_pages: int = 200) -> Scheduler:
    pool = PagePool(num_pages)
    return Scheduler(pool, budget, prefill_chunk=1000, max_active=1,
                     prefix_cache=PrefixCache(pool, PAGE) if cache else None, policy=policy)


def _admitted(scheduler: Scheduler) -> list[str]:
    """Ids in the order ``schedule`` admits them, one per step (max_active=1), each finishing."""
    order = []
    while scheduler.waiting:
        (chunk,) = scheduler.schedule()
        scheduler.commit([chunk])
        order.append(chunk.request.request_id)
        scheduler.remove(chunk.request)
    return order


@pytest.mark.parametrize("policy, expected", [("fcfs", ["a", "b", "c"]), ("shortest-first", ["c", "a", "b"])])
def test_policy_orders_admission(policy, expected):
    scheduler = _scheduler(policy)
    for name, length in (("a", 30), ("b", 50), ("c", 10)):
        scheduler.add(_request(name, list(range(length))))
    assert _admitted(scheduler) == expected
    assert scheduler.pool.num_used == 0


def test_shortest_first_counts_only_work_the_cache_leaves():
    scheduler = _scheduler("shortest-first", cache=True)
    system = [7] * 40
    scheduler.add(_request("warm", system + [1]))
    assert _admitted(scheduler) == ["warm"]  # its 10 full pages stay cached
    cached_pages = scheduler.pool.num_idle_cached
    scheduler.add(_request("fresh", list(range(100, 125))))  # 25 tokens, none cached
    scheduler.add(_request("shared", system + list(range(9))))  # 49 tokens, 40 of them cached
    assert scheduler.prefix_cache.cached_tokens(scheduler.waiting[1].page_hashes, 12) == 40
    assert scheduler.pool.num_idle_cached == cached_pages, "ranking must not hold pages"
    assert _admitted(scheduler) == ["shared", "fresh"]


def test_preempted_requests_go_back_first():
    scheduler = _scheduler("shortest-first")
    long = _request("long", list(range(60)))
    long.admitted_seq = 0  # admitted once, then preempted: waiting again with nothing computed
    scheduler.add(long)
    scheduler.add(_request("short", list(range(5))))
    assert _admitted(scheduler) == ["long", "short"]


def test_an_overtaken_request_goes_next_after_max_bypass():
    scheduler = _scheduler("shortest-first")
    scheduler.add(_request("long", list(range(80))))
    order = []
    for i in range(MAX_BYPASS + 3):  # a short request keeps arriving
        scheduler.add(_request(f"s{i}", list(range(5))))
        (chunk,) = scheduler.schedule()
        scheduler.commit([chunk])
        order.append(chunk.request.request_id)
        scheduler.remove(chunk.request)
    assert order.index("long") == MAX_BYPASS
    assert all(name.startswith("s") for name in order[:MAX_BYPASS])


def test_unknown_policy_is_refused(model):
    with pytest.raises(ValueError, match="schedule policy"):
        Engine(model, num_pages=8, page_size=4, schedule_policy="random")


def test_shortest_first_outputs_match_transformers(model, ref):
    rng = random.Random(5)
    system = [rng.randrange(97) for _ in range(21)]
    prompts = [system + [rng.randrange(97) for _ in range(rng.randint(1, 30))] for _ in range(7)]
    engine = Engine(model, num_pages=64, page_size=PAGE, token_budget=24, prefill_chunk=16, max_active=4,
                    debug=True, schedule_policy="shortest-first")
    ids = [engine.submit(p, max_new_tokens=6) for p in prompts]
    run_to_completion(engine)
    for rid, prompt in zip(ids, prompts):
        assert engine.result(rid).output_token_ids == reference_greedy(ref, prompt, 6), rid
    assert engine.stats().schedule_policy == "shortest-first"
    assert_pool_free(engine)
