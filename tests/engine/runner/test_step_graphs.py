"""Steps with prefill chunks through the padded static buffers behind CUDA graphs (``step_graphs``).

On CPU the buffers, pad requests and in-graph metadata run without capture, computed by the
plain-torch varlen reference kernel, which asserts that the fixed ``max_q`` / ``max_k`` bound
every request; tokens are checked against transformers.
"""

import random

import pytest

from engine_helpers import assert_pool_free, check_preemption_and_cancel, random_prompts, reference_greedy, run_to_completion
from qil_worker import Engine, FinishReason
from qil_worker.attention import PACKED, PAGED
from qil_worker.attention.reference import reference_backend
from qil_worker.engine.runner.graph_buckets import bucket_max_q, pad_requests, request_buckets, token_buckets


@pytest.fixture(params=[PAGED, PACKED])
def backend(request, device):
    """The varlen backends computed by the reference kernel. Not on CUDA: the kernel reads the
    offsets on the host, which a graph cannot capture; ``test_gpu.py`` replays torch's kernel."""
    if device == "cuda":
        pytest.skip("the reference kernel cannot be captured; test_gpu.py runs the real one in graphs")
    return reference_backend(request.param)


def _engine(model, backend, **kwargs):
    return Engine(model, cuda_graphs=True, attention=backend, **{"step_graphs": True, **kwargs})


def test_buckets():
    assert token_buckets(512, 65) == [16, 32, 64, 128, 256, 512, 577]
    assert token_buckets(100, 9) == [16, 32, 64, 100, 109]
    assert token_buckets(10, 3) == [10, 13]
    assert request_buckets(8) == [1, 2, 4, 8, 9]
    assert request_buckets(6) == [1, 2, 4, 7]  # a step of all 6 still has room for a pad request
    assert [bucket_max_q(t, 2048) for t in (16, 2048, 4096, 4353)] == [16, 2048, 2048, 2176]
    assert bucket_max_q(8192, 512) == 4096  # one pad request takes the spare of a step above 4096


@pytest.mark.parametrize(
    "budget, chunk, max_requests",
    [(4096, 2048, 256), (512, 512, 64), (24, 12, 6), (64, 32, 64), (8192, 512, 512), (100, 7, 30), (1000, 1000, 1)],
)
def test_every_step_the_scheduler_can_make_fits_a_bucket(budget, chunk, max_requests):
    """T tokens over R requests (each 1..chunk tokens, T within the budget): some bucket holds
    them with valid pad requests. Edges, then a seeded sample of the rest."""
    rng = random.Random(budget)
    requests = request_buckets(max_requests)
    tokens = token_buckets(budget, requests[-1])
    steps = [(min(budget, r * chunk), r) for r in (1, 2, max_requests)] + [(r, r) for r in (1, max_requests)]
    for _ in range(3000):
        r = rng.randint(1, max_requests)
        steps.append((rng.randint(r, min(budget, r * chunk)), r))
    for t, r in steps:
        if t > budget or t < r:
            continue
        assert any(
            pad_requests(t, r, tb, rb, bucket_max_q(tb, chunk)) is not None
            for tb in tokens if tb >= t for rb in requests if rb >= r
        ), (t, r)


def test_pad_requests_fill_the_bucket_with_one_to_max_q_tokens_each():
    for tokens in range(1, 40):
        for requests in range(1, 8):
            for token_bucket in (16, 32, 64):
                for request_bucket in (1, 2, 4, 8):
                    for max_q in (1, 4, 16):
                        pads = pad_requests(tokens, requests, token_bucket, request_bucket, max_q)
                        spare, count = token_bucket - tokens, request_bucket - requests
                        fits = (spare == count == 0) or (0 < count <= spare <= count * max_q)
                        assert (pads is not None) == fits, (tokens, requests, token_bucket, request_bucket, max_q)
                        if pads is not None:
                            assert len(pads) == count and sum(pads) == spare
                            assert all(1 <= p <= max_q for p in pads)
                            assert max(pads, default=0) - min(pads, default=0) <= 1


def test_the_engine_picks_the_smallest_bucket_that_holds_the_step(model, backend):
    engine = _engine(model, backend, num_pages=64, page_size=4, token_budget=64, prefill_chunk=32)
    graphs = engine.runner.step_graphs
    assert graphs is not None and graphs.tokens == [16, 32, 64, 129] and graphs.requests[-1] == 65
    ids = [engine.submit(p, max_new_tokens=3) for p in random_prompts([20, 5, 9])]
    chunks = engine.scheduler.schedule()
    assert sum(c.num_tokens for c in chunks) == 34  # 20 + 5 + 9
    bucket = graphs.bucket(chunks)
    # 34 tokens → 64; 3 requests → 4: one pad request of the 30 spare tokens (max_q is 32)
    assert (bucket.tokens, bucket.requests, bucket.pads) == (64, 4, (30,))
    if backend.packs_keys:
        assert bucket.keys == 1024 and bucket.keys >= 34 + 30
    engine.scheduler.commit(chunks)
    for i in ids:
        engine.cancel(i)
    run_to_completion(engine)
    assert_pool_free(engine)


def test_mixed_steps_match_transformers(model, ref, backend):
    """Prefill chunks beside decodes, arrivals while others decode, chunked prompts."""
    prompts = random_prompts([3, 30, 11, 45, 7, 19], seed=4)
    expected = [reference_greedy(ref, p, 10) for p in prompts]
    engine = _engine(model, backend, num_pages=96, page_size=4, token_budget=24, prefill_chunk=12)
    ids = []
    for step, prompt in enumerate(prompts):
        ids.append(engine.submit(prompt, max_new_tokens=10))
        engine.step()
        engine.step()
    run_to_completion(engine)
    results = [engine.result(i) for i in ids]
    assert [r.output_token_ids for r in results] == expected
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert engine.runner.step_graphs.steps >= 6 and engine.runner.decode_graphs.steps > 0
    assert engine.runner.step_graphs.misses == 0, "every step of these limits fits a bucket"
    assert_pool_free(engine)


def test_overlapped_mixed_steps_take_in_flight_tokens_into_the_static_inputs(model, ref, backend):
    prompts = random_prompts([5, 26, 13, 40], seed=8)
    expected = [reference_greedy(ref, p, 9) for p in prompts]
    engine = _engine(model, backend, num_pages=96, page_size=4, token_budget=16, prefill_chunk=8, overlap=True)
    ids = [engine.submit(prompts[0], max_new_tokens=9)]
    for prompt in prompts[1:]:
        engine.step()
        engine.step()
        ids.append(engine.submit(prompt, max_new_tokens=9))
    run_to_completion(engine)
    assert [engine.result(i).output_token_ids for i in ids] == expected
    assert engine.overlapped_steps > 0 and engine.runner.step_graphs.steps > 0
    assert_pool_free(engine)


def test_mixed_steps_with_preemption_and_cancel_free_every_page(model, ref, backend):
    engine = _engine(model, backend, num_pages=30, page_size=4, token_budget=32, prefill_chunk=16)
    check_preemption_and_cancel(engine, ref)
    assert engine.runner.step_graphs.steps > 0


def test_pad_tokens_only_touch_the_scratch_page(model, backend):
    """Pages no request owns keep their contents when a step is padded to its bucket."""
    engine = _engine(model, backend, num_pages=16, page_size=4, token_budget=64, prefill_chunk=64)
    marker = 7.0
    engine.runner.kv.k.fill_(marker)
    engine.runner.kv.v.fill_(marker)
    engine.generate(random_prompts([10, 7]), max_new_tokens=1)  # one step of 17 tokens → bucket 32
    assert engine.runner.step_graphs.steps == 1
    written = {
        page for page in range(engine.pool.total) if not bool((engine.runner.kv.k[:, page * 4 : (page + 1) * 4] == marker).all())
    }
    assert len(written) == 3 + 2, f"two prompts of 10 and 7 tokens wrote into pages {sorted(written)}"
    scratch = engine.runner.kv.scratch_page * engine.page_size
    assert not bool((engine.runner.kv.k[:, scratch : scratch + 4] == marker).all()), "padding wrote nowhere"


def test_steps_scoring_prompt_logprobs_run_eagerly(model, ref, backend):
    prompt = random_prompts([12], seed=9)[0]
    engine = _engine(model, backend, num_pages=32, page_size=4)
    result = engine.generate([prompt], max_new_tokens=4, prompt_logprobs=0)[0]
    assert result.output_token_ids == reference_greedy(ref, prompt, 4)
    assert len(result.prompt_logprobs) == len(prompt) - 1  # every token after the first
    assert engine.runner.step_graphs.steps == 0 and engine.runner.step_graphs.misses > 0 and engine.runner.decode_graphs.steps > 0
    assert_pool_free(engine)


def test_step_graphs_need_a_backend_that_builds_metadata_in_a_graph(model):
    assert Engine(model, num_pages=8, cuda_graphs=True).runner.step_graphs is None  # the CPU backend: no
    with pytest.raises(ValueError, match="step_graphs needs cuda_graphs"):
        Engine(model, num_pages=8, cuda_graphs=True, step_graphs=True)
    engine = Engine(model, num_pages=8, cuda_graphs=True, attention=reference_backend(PAGED), step_graphs=False)
    assert engine.runner.step_graphs is None and engine.runner.decode_graphs is not None


def test_sampling_options_through_step_graphs_match_eager_steps(model, backend):
    """Seeded draws, n > 1 forks, penalties, min_new_tokens, stop ids and logprobs arriving while
    others decode: with step graphs (and overlap) the same tokens as eager synchronous steps of the
    same backend, the log-probabilities within float rounding."""
    requests = [
        dict(temperature=0.9, seed=1, logprobs=True, top_logprobs=2),
        dict(temperature=1.1, seed=2, n=2),
        dict(temperature=0.8, top_k=5, seed=3, repetition_penalty=1.3, presence_penalty=0.4),
        dict(min_new_tokens=6, stop_token_ids=[5, 9, 11]),
        dict(logprobs=True),
    ]
    prompts = random_prompts([14, 30, 9, 21, 40], seed=12)
    outputs = {}
    for graphs in (True, False):
        engine = Engine(model, num_pages=96, page_size=4, token_budget=24, prefill_chunk=12, attention=backend,
                        cuda_graphs=graphs, step_graphs=graphs, overlap=graphs)
        ids, events = [], []
        for prompt, options in zip(prompts, requests):
            ids.append(engine.submit(prompt, max_new_tokens=10, **options))
            events += engine.step()
        events += run_to_completion(engine)
        logprobs: dict[tuple, list] = {}
        for e in events:
            if e.logprob is not None:
                logprobs.setdefault((e.request_id, e.sample_index), []).append(e.logprob)
        outputs[graphs] = [
            [(r.output_token_ids, r.finish_reason, logprobs.get((i, r.sample_index))) for r in engine.results(i)]
            for i in ids
        ]
        if graphs:
            assert engine.runner.step_graphs.steps >= 4 and engine.runner.step_graphs.misses == 0
        assert_pool_free(engine)
    assert len(outputs[True][1]) == 2 and len(outputs[True][0][0][2]) == 10  # two samples; logprobs came
    for with_graphs, eager in zip(outputs[True], outputs[False]):
        assert len(with_graphs) == len(eager)
        for (tokens, reason, logprobs), (eager_tokens, eager_reason, eager_logprobs) in zip(with_graphs, eager):
            assert (tokens, reason) == (eager_tokens, eager_reason)
            if logprobs is not None:
                assert logprobs == pytest.approx(eager_logprobs, rel=1e-5, abs=1e-6)
