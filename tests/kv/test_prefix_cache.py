"""Prefix caching: shared prompt pages, identical outputs, no corruption or leak under churn."""

import hashlib
import random
from array import array
from collections import Counter

import pytest

from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from varlen_helpers import use_reference_packed_kernel
from qil_worker import Engine, FinishReason, Qwen3
from qil_worker.kv import PagePool, PrefixCache, page_hashes


@pytest.fixture(scope="module")
def model(tiny_dir, device):
    return Qwen3.from_directory(tiny_dir, device=device, dtype="float32")


def test_hashes_chain_the_whole_prefix():
    a = page_hashes([1, 2, 3, 4, 5, 6, 7], 2)
    b = page_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and len(b) == 3
    assert a[1] != b[1] and a[2] != b[2], "same page tokens after a different prefix must differ"
    assert page_hashes([1, 2, 3, 4], 2) == a[:2]


def test_page_names_are_chained_cryptographic_digests():
    """128-bit BLAKE2b over (parent name, page tokens): two prefixes that share a name cannot
    be computed, so a hit that checks a page's own tokens cannot hand out KV of another prefix
    (with Python's 64-bit ``hash`` such pairs could be computed offline)."""
    def name(parent: bytes, tokens: list[int]) -> bytes:
        return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()

    first = name(bytes(16), [1, 2])
    second = name(first, [3, 4])
    assert page_hashes([1, 2, 3, 4, 5], 2) == [int.from_bytes(d, "little") for d in (first, second)]


def test_cache_hits_collisions_and_lru_eviction():
    pool = PagePool(3)
    cache = PrefixCache(pool, page_size=2)
    (p0,) = pool.allocate(1)
    cache.insert(111, [1, 2], p0)
    pool.free([p0])
    assert pool.num_free == 3 and pool.num_idle_cached == 1
    assert cache.match([1, 2, 3], [111], max_pages=1) == [p0] and pool.refs(p0) == 1
    pool.free([p0])
    assert cache.match([5, 6], [111], max_pages=1) == [], "tokens must be compared on a hit"
    assert cache.match([1, 2], [111], max_pages=0) == []
    others = pool.allocate(2)  # the free pages go first ...
    assert p0 not in others and cache.num_cached_pages == 1
    assert pool.allocate(1) == [p0]  # ... then the idle cached page is evicted
    assert cache.num_cached_pages == 0 and cache.match([1, 2], [111], 1) == []


def _shared_prompts(rng, n, prefix_len=37):
    prefix = [rng.randrange(97) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(97) for _ in range(rng.randint(0, 12))] for _ in range(n)]


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_p=0.9, seed=5)], ids=["greedy", "seeded"])
def test_outputs_identical_with_and_without_cache(model, sampling):
    prompts = _shared_prompts(random.Random(3), 6)
    plain = Engine(model, num_pages=96, page_size=4, prefix_cache=False).generate(prompts, 10, **sampling)
    cached_engine = Engine(model, num_pages=96, page_size=4, debug=True)
    first = cached_engine.generate(prompts[:1], 10, **sampling)
    rest = cached_engine.generate(prompts[1:], 10, **sampling)
    assert [r.output_token_ids for r in first + rest] == [r.output_token_ids for r in plain]
    assert first[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens == 36 for r in rest)  # 9 full pages of the 37-token prefix
    stats = cached_engine.stats()
    assert stats.prefix_cache_hit_rate > 0.5 and stats.num_pages_cached > 0
    assert_pool_free(cached_engine)


def test_requests_arriving_together_compute_a_shared_prefix_once(model, ref):
    prompts = _shared_prompts(random.Random(8), 4)  # 9 full pages of prefix, then their own tokens
    # synchronous, so that the step's own tokens come back from that step (with overlap, the CUDA
    # default, they come back from the next one)
    engine = Engine(model, num_pages=96, page_size=4, token_budget=256, prefill_chunk=256, debug=True, overlap=False)
    ids = [engine.submit(p, max_new_tokens=6) for p in prompts]
    # one step admits all four: the first fills the prefix pages, the rest read them in that step
    first_tokens = [e.request_id for e in engine.step() if e.token_id is not None]
    assert sorted(first_tokens) == sorted(ids)
    run_to_completion(engine)
    results = [engine.result(i) for i in ids]
    assert results[0].num_cached_tokens == 0
    assert all(r.num_cached_tokens == 36 for r in results[1:])
    assert engine.stats().prefix_cache_hit_rate > 0.5
    for p, r in zip(prompts, results):
        assert r.output_token_ids == reference_greedy(ref, p, 6)
    assert_pool_free(engine)
    # a later request still finds the prefix, indexed when that first step committed
    (later,) = engine.generate([prompts[0][:37] + [1, 2]], 2)
    assert later.num_cached_tokens == 36


def test_a_failed_step_leaves_no_shared_prefix_behind(model, ref, monkeypatch):
    """Requests that shared pages in a step whose forward failed all fail, free every page, and
    index nothing: the next burst computes the prefix again and gets the right tokens."""
    prompts = _shared_prompts(random.Random(9), 3)
    engine = Engine(model, num_pages=96, page_size=4, token_budget=256, prefill_chunk=256, debug=True)
    ids = [engine.submit(p, max_new_tokens=4) for p in prompts]
    real_forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    failed = [e for e in engine.step() if e.finished]
    monkeypatch.setattr(type(model), "forward", real_forward)
    assert sorted(e.request_id for e in failed) == sorted(ids) and all(e.error for e in failed)
    assert_pool_free(engine)
    assert engine.stats().num_pages_cached == 0
    results = engine.generate(prompts, 4)
    assert results[0].num_cached_tokens == 0 and all(r.num_cached_tokens == 36 for r in results[1:])
    for p, r in zip(prompts, results):
        assert r.output_token_ids == reference_greedy(ref, p, 4)
    assert_pool_free(engine)


def test_fully_cached_prompt_still_computes_its_last_token(model):
    prompt = list(range(16))
    engine = Engine(model, num_pages=32, page_size=4, debug=True)
    (a,) = engine.generate([prompt], 5)
    (b,) = engine.generate([prompt], 5)
    assert b.output_token_ids == a.output_token_ids and b.num_cached_tokens == 12


def _check_pool(engine):
    holders = Counter(p for r in engine.scheduler.running for p in r.page_table.pages)
    pool = engine.pool
    for page in range(pool.total):
        assert pool.refs(page) == holders.get(page, 0), f"page {page} refcount"
    assert pool.num_used == len(holders)
    assert all(not r.page_table.pages for r in engine.scheduler.waiting)


CHURN_CASES = pytest.mark.parametrize(
    "policy, attention", [("fcfs", "auto"), ("shortest-first", "auto"), ("fcfs", "varlen-packed")]
)


@CHURN_CASES
def test_random_sharing_preemption_cancel_and_eviction(model, policy, attention, monkeypatch):
    """``varlen-packed``: keys gathered back to back through shared and cached pages (with the
    reference kernel of ``varlen_helpers``: this model is float32, which flash does not take)."""
    _random_churn(model, policy, attention, monkeypatch, steps=250, submit_steps=180)


@pytest.mark.slow
@CHURN_CASES
def test_random_sharing_preemption_cancel_and_eviction_long(model, policy, attention, monkeypatch):
    """The same churn twice as long: more requests through the same small pool (opt-in, see the
    ``slow`` marker in pyproject.toml)."""
    _random_churn(model, policy, attention, monkeypatch, steps=500, submit_steps=350)


def _random_churn(model, policy, attention, monkeypatch, steps: int, submit_steps: int) -> None:
    """Random submits sharing four prefixes, and cancels, on a pool small enough to preempt and
    evict; every invariant of the pool after every step; outputs equal to an engine without a
    prefix cache."""
    if attention == "varlen-packed":
        use_reference_packed_kernel(monkeypatch)
    rng = random.Random(99)
    prefixes = [[rng.randrange(97) for _ in range(rng.randint(4, 30))] for _ in range(4)]
    engine = Engine(model, num_pages=24, page_size=4, token_budget=20, prefill_chunk=7, max_active=6, debug=True,
                    schedule_policy=policy, attention=attention)
    assert attention == "auto" or engine.attention_backend == attention
    reference = Engine(model, num_pages=64, page_size=4, prefix_cache=False)
    expected, submitted, live = {}, {}, set()
    for step in range(steps):
        if step < submit_steps and rng.random() < 0.35:
            prompt = rng.choice(prefixes) + [rng.randrange(97) for _ in range(rng.randint(0, 6))]
            n = rng.randint(1, 12)
            rid = engine.submit(prompt, max_new_tokens=n)
            submitted[rid] = (prompt, n)
            live.add(rid)
        if live and rng.random() < 0.07:
            engine.cancel(rng.choice(sorted(live)))
        for e in engine.step():
            if e.finished:
                live.discard(e.request_id)
        _check_pool(engine)
    run_to_completion(engine)
    assert not live
    assert_pool_free(engine)
    finished = [rid for rid in submitted if engine.result(rid).finish_reason is FinishReason.LENGTH]
    for rid in finished:
        prompt, n = submitted[rid]
        key = (tuple(prompt), n)
        if key not in expected:
            expected[key] = reference.generate([prompt], n)[0].output_token_ids
        assert engine.result(rid).output_token_ids == expected[key], rid
    results = [engine.result(r) for r in submitted]
    assert any(r.num_cached_tokens for r in results), "prefixes were meant to be shared"
    assert any(r.num_preemptions for r in results), "the pool was meant to force preemption"
    assert engine.stats().num_pages_cached > 0


# -- eviction order and in-flight hits: what end-to-end outputs alone would not reveal ------


def _two_cached_idle_pages():
    pool = PagePool(2)
    cache = PrefixCache(pool, page_size=2)
    p0, p1 = pool.allocate(2)
    cache.insert(100, [1, 2], p0)
    cache.insert(200, [3, 4], p1)
    pool.free([p0])  # p0 idles first: least recently used
    pool.free([p1])
    return pool, cache, p0, p1


def test_eviction_takes_the_least_recently_used_idle_page():
    pool, cache, p0, p1 = _two_cached_idle_pages()
    assert pool.allocate(1) == [p0]
    assert cache.match([3, 4], [200], 1) == [p1], "the recently used page must survive"


def test_a_hit_makes_a_page_recently_used_again():
    pool, cache, p0, p1 = _two_cached_idle_pages()
    assert cache.match([1, 2], [100], 1) == [p0]  # p0 used again ...
    pool.free([p0])  # ... and released: now the most recent
    assert pool.allocate(1) == [p1]
    assert cache.match([1, 2], [100], 1) == [p0]


def test_an_in_flight_hit_compares_tokens_too():
    pool = PagePool(2)
    cache = PrefixCache(pool, page_size=2)
    (p,) = pool.allocate(1)
    cache.begin_step()
    cache.announce(111, [1, 2], p)
    assert cache.match([5, 6], [111], 1) == []
    assert cache.match([1, 2], [111], 1) == [p] and pool.refs(p) == 2


def test_cached_page_count_is_idle_pages_only(model):
    engine = Engine(model, num_pages=64, page_size=4)
    prompt = list(range(1, 38))
    engine.generate([prompt], 2)
    assert engine.stats().num_pages_cached == 9
    engine.submit(prompt[:36] + [90], max_new_tokens=4)
    engine.step()  # the new request holds the 9 cached pages: no longer idle
    stats = engine.stats()
    assert stats.num_pages_cached == 0 and stats.num_pages_used == 10


def test_prefix_hit_rate_is_cached_over_prompt_tokens(model):
    engine = Engine(model, num_pages=64, page_size=4)
    a = list(range(1, 38))           # 37 tokens
    b = a[:16] + [90, 91, 92, 93, 94]  # 21 tokens: 4 full pages shared
    engine.generate([a], 2)
    (r,) = engine.generate([b], 2)
    assert r.num_cached_tokens == 16
    assert engine.stats().prefix_cache_hit_rate == pytest.approx(16 / (37 + 21))
