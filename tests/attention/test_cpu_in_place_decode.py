"""A lone decode row whose pages are consecutive in the pool is attended where its keys lie
(``CpuAttention.key_run``, ``cpu._decode_in_place``) instead of being gathered first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine_helpers import assert_pool_free, random_prompts, reference_greedy, run_to_completion
from qil_worker import Engine, Qwen3
from qil_worker.attention import cpu
from qil_worker.kv import PagePool


def _members(*tables: list[int]) -> list[SimpleNamespace]:
    return [SimpleNamespace(pages=t) for t in tables]


def test_key_run_needs_one_row_whose_key_pages_are_consecutive():
    backend = cpu.CpuAttention()
    assert backend.key_run(_members([3, 4, 5]), 3, page_size=4) == 12
    assert backend.key_run(_members([7]), 1, page_size=4) == 28
    assert backend.key_run(_members([3, 4, 9]), 2, page_size=4) == 12  # only the pages with keys count
    assert backend.key_run(_members([3, 5, 6]), 3, page_size=4) is None
    assert backend.key_run(_members([5, 4]), 2, page_size=4) is None  # consecutive, but backwards
    assert backend.key_run(_members([3, 4], [5, 6]), 2, page_size=4) is None  # two rows: gathered


def test_freed_pages_come_back_in_the_order_they_were_held():
    pool = PagePool(8)
    held = pool.allocate(5)
    assert held == [0, 1, 2, 3, 4]
    pool.free(held)
    assert pool.allocate(3) == [0, 1, 2]


@pytest.fixture(scope="module")
def models(tiny_dir):
    return {d: Qwen3.from_directory(tiny_dir, dtype=d) for d in ("float32", "bfloat16")}


def _spy_kernels(monkeypatch) -> dict[str, list]:
    calls: dict[str, list] = {"in_place": [], "gathered": []}
    in_place, by_matmuls, by_sdpa = cpu._decode_in_place, cpu._decode_by_matmuls, cpu._decode_by_sdpa

    def spy_in_place(q, kv, layer, group):
        calls["in_place"].append((q.clone(), kv, layer, group))
        return in_place(q, kv, layer, group)

    def spy(kernel):
        def wrapped(*args):
            calls["gathered"].append(args)
            return kernel(*args)
        return wrapped

    monkeypatch.setattr(cpu, "_decode_in_place", spy_in_place)
    monkeypatch.setattr(cpu, "_decode_by_matmuls", spy(by_matmuls))
    monkeypatch.setattr(cpu, "_decode_by_sdpa", spy(by_sdpa))
    return calls


def test_requests_one_after_another_decode_in_place_and_match_transformers(models, ref, monkeypatch):
    """Each request alone on the engine holds consecutive pages (the second one too, beside the
    first one's pages, which the prefix cache keeps), so every decode step attends in place;
    tokens are transformers'."""
    calls = _spy_kernels(monkeypatch)
    engine = Engine(models["float32"], num_pages=32, page_size=4, token_budget=64, prefill_chunk=64)
    for prompt in random_prompts([9, 14], seed=21):
        rid = engine.submit(prompt, max_new_tokens=12)
        run_to_completion(engine)
        assert engine.result(rid).output_token_ids == reference_greedy(ref, prompt, 12)
    layers = len(models["float32"].layers)
    assert len(calls["in_place"]) == 2 * 11 * layers  # every decode step of both, every layer
    assert not calls["gathered"]
    assert_pool_free(engine)


def test_in_place_attention_equals_the_gathered_kernels(models, monkeypatch):
    """The same decode row's attention, in place and gathered (by matmuls for bf16, by SDPA for
    float32), across page boundaries and with the last page partly written."""
    gathered_kernels = {  # looked up after the spies are undone
        "float32": lambda *args: cpu._decode_by_sdpa(*args),
        "bfloat16": lambda *args: cpu._decode_by_matmuls(*args, None),
    }
    for dtype, tolerance in (("float32", 1e-5), ("bfloat16", 2e-2)):
        calls = _spy_kernels(monkeypatch)
        engine = Engine(models[dtype], num_pages=32, page_size=4, token_budget=64, prefill_chunk=64)
        engine.submit(random_prompts([13], seed=4)[0], max_new_tokens=8)
        run_to_completion(engine)
        assert calls["in_place"] and not calls["gathered"]
        monkeypatch.undo()
        for q, kv, layer, group in calls["in_place"][-len(models[dtype].layers):]:  # the last step (context 20)
            got = cpu._decode_in_place(q, kv, layer, group)
            want = gathered_kernels[dtype](q, kv, layer, group)
            assert got.dtype == want.dtype == q.dtype
            torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_decode_rows_side_by_side_are_gathered(models, ref, monkeypatch):
    """Two requests decoding together (one group of two rows, their pages interleaved as they
    grow) are gathered as before, and give transformers' tokens."""
    calls = _spy_kernels(monkeypatch)
    engine = Engine(models["float32"], num_pages=32, page_size=4, token_budget=64, prefill_chunk=64)
    prompts = random_prompts([3, 5], seed=8)
    ids = [engine.submit(p, max_new_tokens=14) for p in prompts]
    run_to_completion(engine)
    for rid, prompt in zip(ids, prompts):
        assert engine.result(rid).output_token_ids == reference_greedy(ref, prompt, 14)
    assert calls["gathered"] and not calls["in_place"]
    assert_pool_free(engine)


def test_a_growing_holder_gets_the_page_after_its_last_when_that_one_is_free():
    pool = PagePool(8)
    a = pool.allocate(2)
    b = pool.allocate(1)
    assert (a, b) == ([0, 1], [2])
    assert pool.allocate(1, after=a[-1]) == [3]  # 2 is held: the page freed last instead
    pool.free(a)
    assert pool.allocate(1, after=b[-1]) == [0]  # 3 is held too: the top of the stack
    assert pool.allocate(3) == [1, 4, 5]  # the top, then 2 is held: the top (4), then onwards
    assert pool.allocate(1, after=5) == [6]


def test_a_lone_request_after_concurrent_traffic_still_decodes_in_place(models, ref, monkeypatch):
    """Requests growing side by side interleave their pages; once they are gone, a request
    alone still gets consecutive pages (each page the one after its last), so it is attended in
    place, with transformers' tokens, and every page is free at the end."""
    engine = Engine(models["float32"], num_pages=40, page_size=4, token_budget=64, prefill_chunk=64,
                    prefix_cache=False)
    for prompt in random_prompts([3, 6, 5], seed=2):
        engine.submit(prompt, max_new_tokens=11)
    run_to_completion(engine)
    calls = _spy_kernels(monkeypatch)
    prompt = random_prompts([10], seed=12)[0]
    rid = engine.submit(prompt, max_new_tokens=15)
    run_to_completion(engine)
    assert engine.result(rid).output_token_ids == reference_greedy(ref, prompt, 15)
    assert len(calls["in_place"]) == 14 * len(models["float32"].layers) and not calls["gathered"]
    assert_pool_free(engine)
