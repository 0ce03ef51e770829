"""The step's host fast paths give exactly what the general paths give.

Fast paths: one-token chunks in ``build_step_inputs`` (``_one_token_each`` beside
``flat_tokens``), the sampler's ``plain`` rows (``SamplingRow``), page tables kept as arrays
(``Request.page_ids``), token events made without the frozen ``__init__``
(``Event.of_token``), typed arrays into tensors (``transfer.host_tensor``), draws hashed from
each request's kept seed state (``sampler.draws_for``), the sampler's batch parameters kept
while a batch stays, rotated or not (``sampler.BatchRows``). Each is checked on
its own, and an engine with all of them is checked against one with each replaced by its
general path, event by event, over a mixed batch with greedy and seeded sampling, stop ids,
``max_new_tokens``, a cancel, preemptions, ``n`` samples and logprobs — and every KV page is
free at the end.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
import torch

from engine_helpers import assert_pool_free
from qil_worker import Engine
from qil_worker.engine.runner import batch as batch_module
from qil_worker.engine import sampler as sampler_module
from qil_worker.engine.outputs import Event, FinishReason, RequestMetrics
from qil_worker.engine.request import Request, SamplingRow
from qil_worker.engine.sampling_params import SamplingParams
from qil_worker.engine.scheduler import ScheduledChunk
from qil_worker.engine.transfer import host_tensor
from qil_worker.kv import PagePool, PageTable


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([3, 0, 2**40, -7], torch.long),
        (range(5, 9), torch.long),
        ((i * i for i in range(4)), torch.long),
        ([1, -2, 3], torch.int32),
        ([0.1, 1.0 / 3.0, 1e-30, 2.5e38, -0.0, math.pi], torch.float32),
        ([0.1, 1.0 / 3.0, 1e-300], torch.float64),
        ([True, False, True], torch.bool),
        ([], torch.long),
        ([], torch.float32),
        ([1.5, 2.0], None),
        ([1, 2], None),
        ([True], None),
    ],
)
def test_host_tensor_is_torch_tensor(values, dtype):
    values = list(values) if not isinstance(values, list) else values
    expected = torch.tensor(values, dtype=dtype)
    got = host_tensor(iter(values) if dtype is not None else values, dtype)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected)  # float32: rounded from the Python floats alike, bit for bit
    same_array = host_tensor(array("q", [4, 5]), torch.long)
    assert same_array.tolist() == [4, 5]


@pytest.mark.parametrize(
    "reason, logprob, top, text, stop, result",
    [
        (None, None, None, None, None, None),
        (FinishReason.STOP, -0.25, [(3, -0.25), (1, -2.0)], "ab", 7, "r"),
        (FinishReason.LENGTH, None, None, "", None, None),
        (FinishReason.STOP, 0.0, [], "", 0, None),  # falsy values are values
    ],
)
def test_token_events_equal_the_dataclass_init(reason, logprob, top, text, stop, result):
    made = Event.of_token("req", 5, 3, reason, logprob, top, text, stop, result)
    expected = Event("req", 5, 3, reason is not None, reason, None, logprob, top, text, stop, result)
    assert made == expected and repr(made) == repr(expected)
    assert list(vars(made).items()) == list(vars(expected).items())
    assert dataclasses.replace(made, sample_index=2) == dataclasses.replace(expected, sample_index=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.token_id = 1  # type: ignore[misc]


def _request(prompt_len: int, output: int = 0, **sampling) -> Request:
    r = Request(
        f"r{prompt_len}-{output}", list(range(prompt_len)), 100, frozenset(), PageTable(4), RequestMetrics(0.0),
        sampling=SamplingParams(**sampling),
    )
    r.output_token_ids.extend(range(90, 90 + output))
    return r


def test_page_ids_follow_the_page_table_through_growth_and_replacement():
    pool = PagePool(32)
    r = _request(3)
    assert list(r.page_ids()) == []
    for tokens in (3, 4, 5, 13, 13, 20):
        assert r.page_table.grow(tokens, pool)
        assert list(r.page_ids()) == r.page_table.pages
    r.page_table.release(pool)  # released: an empty list again, then growing anew
    assert list(r.page_ids()) == []
    assert r.page_table.grow(6, pool)
    assert list(r.page_ids()) == r.page_table.pages
    r.page_table.release(pool)
    r.page_table.pages = pool.allocate(3)  # replaced by a new list (a fork, a prefix-cache match)
    assert list(r.page_ids()) == r.page_table.pages
    r.page_table.pages = r.page_table.pages[:1]  # a shorter one
    assert list(r.page_ids()) == r.page_table.pages
    twin = copy.copy(r)  # a forked sample copies the request, then gets its own table
    twin.page_table = PageTable(4)
    twin.page_table.pages = [1, 2, 3]
    r.page_table.pages = [4]
    assert list(twin.page_ids()) == [1, 2, 3] and list(r.page_ids()) == [4]


def test_one_token_chunks_build_what_the_general_builder_builds():
    decodes = [_request(5 + 3 * i, output=i) for i in range(6)]
    # decodes of prompt + output, the last prompt token, and a lone recomputed token that samples nothing
    chunks = [ScheduledChunk(r, r.num_tokens - 1, 1) for r in decodes]
    chunks.append(ScheduledChunk(_request(9), 8, 1))
    recompute = _request(7, output=4)
    chunks.append(ScheduledChunk(recompute, 6, 1))
    fast = batch_module._one_token_each(chunks)
    general = batch_module.flat_tokens(chunks)
    assert fast.input_ids == general.input_ids
    assert fast.positions == general.positions
    assert torch.equal(fast.rows, general.rows)
    assert fast.logit_indices == general.logit_indices
    assert fast.sampled == general.sampled and len(fast.sampled) == len(chunks) - 1
    assert fast.prompt_rows == general.prompt_rows == []


@pytest.mark.parametrize(
    "params",
    [
        dict(),
        dict(temperature=0.8, seed=3),
        dict(temperature=1.2, top_p=0.9, seed=4),
        dict(temperature=0.7, top_k=5, min_p=0.05, seed=5),
    ],
)
def test_sampling_rows_read_as_the_params(params):
    p = SamplingParams(**params)
    row = SamplingRow.of(p)
    assert row.greedy is p.greedy and row.truncated is p.truncated and row.plain
    assert row.divisor == (1.0 if p.greedy else p.temperature)
    for extra in (dict(logprobs=True), dict(top_logprobs=2), dict(min_new_tokens=1), dict(presence_penalty=0.5),
                  dict(logit_bias={3: 1.0}), dict(repetition_penalty=1.1)):
        assert not SamplingRow.of(SamplingParams(**{**params, **extra})).plain


def _per_row_draws(requests, greedy_rows):
    """The draws as ``uniform_for`` gives them, one request at a time."""
    return [
        0.5 if greedy else sampler_module.uniform_for(r.seed, r.num_output_tokens)
        for r, greedy in zip(requests, greedy_rows)
    ]


def test_draws_from_kept_seed_states_are_uniform_for_of_each_row():
    requests = [_request(3, output=i % 5, temperature=0.5) for i in range(12)]
    for r, seed in zip(requests, [0, 1, 2**64 - 1, 2**63, 12345, 7, 7, 99, 2**40, 3, 4, 5]):
        r.seed = seed
    requests[4].in_flight_row = 0  # a token in flight counts in the draw's index
    greedy = [i % 3 == 0 for i in range(len(requests))]
    for _ in range(3):  # the kept states serve the next draws too
        got = sampler_module.draws_for(requests, greedy)
        assert got == _per_row_draws(requests, greedy)
        assert all(g == 0.5 for g, is_greedy in zip(got, greedy) if is_greedy)
        for r in requests:
            r.output_token_ids.append(1)
    twin = copy.copy(requests[1])  # a forked sample: the kept state came along, the seed is its own
    twin.seed = 424242
    assert sampler_module.draws_for([twin, requests[1]], [False, False]) == _per_row_draws([twin, requests[1]], [False, False])
    assert sampler_module.draws_for([], []) == []
    big = _request(2, temperature=1.0)
    big.output_token_ids.extend([0] * 5000)
    assert sampler_module.draws_for([big], [False]) == [sampler_module.uniform_for(big.seed, 5000)]


def test_a_sampler_keeping_its_batch_samples_as_a_fresh_one():
    """Steps over the same requests, in the same or a rotated order (the scheduler's), reuse the
    batch's parameters; a batch that changes (a request gone, one added, another order) gets
    its own; every step's tokens and log-probabilities equal those of a sampler made for that
    step alone."""
    kinds = [dict(), dict(temperature=0.8, seed=1), dict(temperature=1.1, top_p=0.8, seed=2),
             dict(temperature=0.9, top_k=3, min_p=0.1, seed=3), dict(temperature=0.7, seed=4, logprobs=True, top_logprobs=2)]
    requests = [_request(4 + i, **kinds[i % len(kinds)]) for i in range(10)]
    fewer = requests[1:]
    batches = [
        requests, requests, requests[3:] + requests[:3], requests[9:] + requests[:9],  # one ring
        fewer, fewer[4:] + fewer[:4],  # one ring
        requests[::-1], requests[:3], requests[:3] + [_request(3)],
    ]
    kept = sampler_module.Sampler()
    rings = []
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        logits = torch.randn(len(batch), 32, generator=gen)
        ours = kept.sample(logits, batch)
        rings.append(kept._ring)
        fresh = sampler_module.Sampler().sample(logits, batch)
        assert ours == fresh
        for r, token in zip(batch, ours.tokens):
            r.output_token_ids.append(token)
    assert rings[0] is rings[1] is rings[2] is rings[3] and rings[4] is rings[5]
    assert len({id(ring) for ring in rings}) == 5


def test_every_request_keeps_one_attribute_layout(model):
    """Requests of every kind carry the same attributes in the same order once sampled: CPython
    shares one layout among instances, and an attribute only some carry (set on first use)
    slows every attribute read of every request."""
    engine = Engine(model, num_pages=40, page_size=4, max_active=8)
    for kwargs in _workload(model.config.vocab_size)[:8]:
        engine.submit(**{k: v for k, v in kwargs.items() if k != "n"})
    for _ in range(4):
        engine.step()
    layouts = {tuple(vars(r)) for r in engine.scheduler.running + list(engine.scheduler.waiting)}
    assert len(layouts) == 1, layouts
    engine.close()


# -- the engine with its fast paths against the engine with the general ones ------------------


def _general_paths(monkeypatch) -> None:
    """Replace every fast path by its general counterpart."""
    monkeypatch.setattr(batch_module, "_one_token_each", batch_module.flat_tokens)
    of = SamplingRow.of.__func__
    monkeypatch.setattr(SamplingRow, "of", classmethod(lambda cls, p: dataclasses.replace(of(cls, p), plain=False)))
    monkeypatch.setattr(Request, "page_ids", lambda self: array("q", self.page_table.pages))

    def event_init(cls, request_id, token, index, reason, logprob, top, text, stop_reason, result):
        return Event(request_id, token, index, reason is not None, reason, None, logprob, top, text, stop_reason, result)

    monkeypatch.setattr(Event, "of_token", classmethod(event_init))
    monkeypatch.setattr(sampler_module, "draws_for", _per_row_draws)
    monkeypatch.setattr(sampler_module.BatchRows, "window_for", lambda self, requests, device: None)


def _workload(vocab: int) -> list[dict]:
    rng = random.Random(11)
    kinds = [
        dict(),  # greedy
        dict(temperature=0.9, seed=1),
        dict(temperature=1.1, top_p=0.9, seed=2),
        dict(temperature=0.8, top_k=7, seed=3, logprobs=True, top_logprobs=2),
        dict(logprobs=True),
        dict(temperature=1.0, seed=4, n=3),
        dict(temperature=0.7, seed=5, min_new_tokens=3),
    ]
    out = []
    for i in range(24):
        sampling = dict(kinds[i % len(kinds)])
        out.append(dict(
            token_ids=[rng.randrange(vocab) for _ in range(rng.randint(3, 30))],
            max_new_tokens=rng.randint(1, 24),
            stop_token_ids=[rng.randrange(vocab) for _ in range(2)] if i % 3 == 0 else None,
            request_id=f"q{i}",
            **sampling,
        ))
    return out


def _run(model, cuda_graphs: bool) -> tuple[list[tuple], list[tuple], int]:
    """Every event (as comparable fields), every result and the preemptions of one run."""
    engine = Engine(
        model, num_pages=40, page_size=4, token_budget=64, prefill_chunk=16, max_active=16, cuda_graphs=cuda_graphs,
    )
    requests = _workload(model.config.vocab_size)
    for kwargs in requests[:16]:
        engine.submit(**kwargs)
    events, step = [], 0
    while not engine.idle:
        events += engine.step()
        step += 1
        if step == 3:
            engine.cancel("q4")
        if step == 5:
            for kwargs in requests[16:]:  # arrivals while others decode
                engine.submit(**kwargs)
        assert step < 2000
    assert_pool_free(engine)
    results = [
        (r.request_id, r.sample_index, r.output_token_ids, r.finish_reason, r.stop_reason, r.num_preemptions)
        for e in events if e.result is not None for r in [e.result]
    ]
    fields = [
        (e.request_id, e.token_id, e.index, e.finished, e.finish_reason, e.error, e.logprob, e.top_logprobs,
         e.text, e.stop_reason, e.sample_index, e.samples_running)
        for e in events
    ]
    return fields, results, sum(r[-1] for r in results)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "padded"])
def test_fast_paths_give_the_general_paths_events(model, monkeypatch, cuda_graphs):
    fast_events, fast_results, preemptions = _run(model, cuda_graphs)
    with monkeypatch.context() as patched:
        _general_paths(patched)
        general_events, general_results, _ = _run(model, cuda_graphs)
    assert fast_events == general_events
    assert fast_results == general_results
    # the mix covered what it is meant to
    assert preemptions > 0
    reasons = {r[3] for r in fast_results}
    assert {FinishReason.STOP, FinishReason.LENGTH, FinishReason.CANCELLED} <= reasons
    assert any(r[1] == 2 for r in fast_results)  # a third sample of an n = 3 request
    assert any(e[6] is not None and e[7] for e in fast_events)  # logprobs with top alternatives


def test_the_host_step_benchmark_prints_every_phase_before_and_after():
    """``scripts/bench_host_step.py`` end to end at tiny sizes, A/B against this very commit."""
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [sys.executable, str(root / "scripts" / "bench_host_step.py"), "--before", "HEAD", "--rounds", "1",
         "--rows", "3", "--steps", "2", "--warmup", "1", "--variants", "plain", "--paths", "eager", "padded"],
        capture_output=True, text=True, timeout=600, cwd=root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "plain / eager / 3 rows" in out and "plain / padded / 3 rows" in out
    assert "before     after   ratio" in out and "load average" in out
    for phase in ("schedule", "build", "attn-meta", "prepare", "sample", "accept", "host", "forward"):
        assert out.count(f"\n  {phase} ") == 2, phase
