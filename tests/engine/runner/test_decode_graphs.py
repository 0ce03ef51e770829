"""The padded decode path behind CUDA graphs: buckets, scratch-page padding, exact tokens.

On CPU the same static buffers and in-graph metadata run without capture, so padding rows,
bucket choice and table staging are checked against transformers here; on CUDA
(``QIL_TEST_DEVICE=cuda``) the same tests replay real graphs.
"""

import pytest

from engine_helpers import assert_pool_free, check_preemption_and_cancel, random_prompts, reference_greedy, run_to_completion
from qil_worker import Engine, FinishReason
from qil_worker.engine.runner.graph_buckets import batch_buckets, context_buckets


def test_buckets_cover_every_size():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(1) == [1]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert context_buckets(1000, 16) == [256, 512, 1008]
    assert context_buckets(100, 16) == [112]
    assert context_buckets(700, 48) == [288, 528, 720]  # page-aligned, last covers 700


def test_graph_decode_matches_reference_across_buckets(model, ref, device):
    """3, then fewer requests (padded rows), contexts crossing the 256-token bucket."""
    prompts = random_prompts([1, 5, 250])
    expected = [reference_greedy(ref, p, 12) for p in prompts]
    engine = Engine(model, num_pages=128, page_size=4, cuda_graphs=True)
    results = [engine.result(i) for i in [engine.submit(p, max_new_tokens=n) for p, n in zip(prompts, (12, 5, 12))]]
    run_to_completion(engine)
    results = [engine.result(r.request_id) for r in results]
    assert results[0].output_token_ids == expected[0]
    assert results[1].output_token_ids == expected[1][:5]
    assert results[2].output_token_ids == expected[2]
    assert all(r.finish_reason is FinishReason.LENGTH for r in results)
    assert engine.runner.decode_graphs.steps >= 10, "decode steps should have taken the graph path"
    if device == "cuda":
        assert engine.runner.decode_graphs.num_graphs >= 2  # batch 4 and batch 2 (or context buckets)
    assert_pool_free(engine)


def test_graph_decode_with_preemption_and_cancel_frees_every_page(model, ref):
    engine = Engine(model, num_pages=30, page_size=4, token_budget=32, prefill_chunk=16, cuda_graphs=True)
    check_preemption_and_cancel(engine, ref)
    assert engine.runner.decode_graphs.steps > 0


def test_graphs_default_off_on_cpu_and_with_debug(model, device):
    assert (Engine(model, num_pages=8).runner.decode_graphs is not None) == (device == "cuda")
    assert Engine(model, num_pages=8, debug=True).runner.decode_graphs is None
    if device == "cuda":
        with pytest.raises(ValueError, match="captured"):
            Engine(model, num_pages=8, debug=True, cuda_graphs=True)


def test_padded_rows_only_touch_the_scratch_page(model):
    """Pages no request owns keep their contents when a small batch is padded to a bucket."""
    engine = Engine(model, num_pages=16, page_size=4, cuda_graphs=True)
    marker = 7.0
    engine.runner.kv.k.fill_(marker)
    engine.runner.kv.v.fill_(marker)
    engine.generate(random_prompts([3, 6, 2]), max_new_tokens=4)  # 3 decodes → bucket 4, one padded row
    scratch = engine.runner.kv.scratch_page * engine.page_size
    used = set()
    for pages in range(engine.pool.total):
        k = engine.runner.kv.k[:, pages * 4 : (pages + 1) * 4]
        if not bool((k == marker).all()):
            used.add(pages)
    # prompt + 4 outputs, minus the last (never fed back): 6, 9 and 5 positions = 2 + 3 + 2 pages
    assert len(used) <= 7, f"three short requests wrote into pages {sorted(used)}"
    assert not bool((engine.runner.kv.k[:, scratch : scratch + 4] == marker).all()), "padding wrote nowhere"


def test_a_failed_capture_falls_back_to_the_eager_padded_path(model, ref, monkeypatch):
    prompts = random_prompts([4, 9])
    expected = [reference_greedy(ref, p, 6) for p in prompts]
    engine = Engine(model, num_pages=32, page_size=4, cuda_graphs=True)
    graphs, capture = engine.runner.decode_graphs, engine.runner.graph_capture
    outcomes = []
    real_capture = capture.capture

    def refused(body, what):
        # a body that fails inside the real capture, on any device (on CPU the capture itself fails)
        def failing():
            raise RuntimeError("this build cannot capture the decode step")

        outcomes.append(real_capture(failing, what))
        return outcomes[-1]

    monkeypatch.setattr(capture, "capture", refused)
    capture.enabled = True
    results = engine.generate(prompts, max_new_tokens=6)
    assert outcomes == [None]  # the capture failed once, then was not tried again
    assert [r.output_token_ids for r in results] == expected
    assert all(r.error is None for r in results)
    assert capture.enabled is False and graphs.steps > 0 and graphs.num_graphs == 0
    assert_pool_free(engine)
