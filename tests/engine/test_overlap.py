"""Overlapped scheduling (``qil_worker.engine.in_flight``) on the CPU: an engine that launches
step N+1 before reading step N gives exactly the tokens and events of one that steps
synchronously — and, greedy, of transformers — with requests arriving at different steps,
finishes (EOS, stop ids, max_new_tokens, stop strings) and cancels at every step boundary,
preemption, chunked prefill, seeded sampling with logprobs, requests that make it step
synchronously (constraints, penalties, min_new_tokens, prompt logprobs) or fork (n > 1),
failed steps, and the decode-graph padded path. Every KV page is free after every scenario,
and the overlapped engine is seen to read each step only after launching the next. With
``QIL_TEST_DEVICE=cuda`` the same run on the GPU (pinned readout, captured graphs).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable

import pytest

from checkpoints import make_checkpoint, make_text_checkpoint
from engine_helpers import assert_pool_free, reference_greedy
from qil_worker import Engine, FinishReason, Qwen3
from qil_worker.engine.outputs import Event
from qil_worker.text import load_tokenizer

MAX_STEPS = 2000


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("overlap-text"))


@pytest.fixture(scope="module")
def tokenizer(text_dir):
    return load_tokenizer(text_dir)


@pytest.fixture(scope="module")
def text_model(text_dir, device):
    return Qwen3.from_directory(text_dir, device=device, dtype="float32")


def engine_for(model, overlap: bool, graphs: bool = False, **kwargs) -> Engine:
    settings = dict(num_pages=96, page_size=4, token_budget=40, prefill_chunk=16, max_active=8)
    return Engine(model, overlap=overlap, cuda_graphs=graphs, **{**settings, **kwargs})


def prompts(count: int, seed: int = 0, low: int = 2, high: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(rng.randint(low, high))] for _ in range(count)]


def drive(
    engine: Engine,
    arrivals: dict[int, list[dict]],
    after_step: Callable[[Engine, list[Event]], None] | None = None,
) -> tuple[list[Event], dict[str, str]]:
    """Submit ``arrivals[k]`` (submit kwargs, each with a ``name``) before step k, step until
    idle, calling ``after_step(engine, events so far)`` after each; then check every page free.
    Returns the events and the request ids by name."""
    events: list[Event] = []
    ids: dict[str, str] = {}
    last = max(arrivals, default=0)
    for k in range(MAX_STEPS):
        for spec in arrivals.get(k, []):
            spec = dict(spec)
            name = spec.pop("name")
            ids[name] = engine.submit(**spec)
        if k > last and engine.idle:
            break
        events += one_event_each(engine.step())
        if after_step is not None:
            after_step(engine, events)
    else:
        raise AssertionError("engine did not become idle")
    assert_pool_free(engine)
    return events, ids


class Close(float):
    """A log-probability that equals another within 1e-5 relative: the overlapped engine's steps
    may hold rows (dropped later) that the synchronous engine's had not, and a batch of another
    shape may round differently in the last bits. Tokens always compare exactly."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, float) and math.isclose(self, other, rel_tol=1e-5, abs_tol=1e-6)

    __hash__ = float.__hash__


def one_event_each(events: list[Event]) -> list[Event]:
    """A step's events, checked to hold at most one per request (sample) — what the worker's
    ``StepBatch`` assumes."""
    keys = [(e.request_id, e.sample_index) for e in events]
    assert len(keys) == len(set(keys)), keys
    return events


def by_request(events: list[Event], ids: dict[str, str], float_tol: bool = False) -> dict[str, list[tuple]]:
    """Each request's events, as comparable tuples (the result's tokens and reasons, not its
    timings); with ``float_tol`` log-probabilities compare as ``Close``."""
    names = {rid: name for name, rid in ids.items()}
    out: dict[str, list[tuple]] = {}
    for e in events:
        result = None
        if e.result is not None:
            r = e.result
            result = (r.prompt_token_ids, r.output_token_ids, r.finish_reason, r.error, r.output_text,
                      r.stop_reason, r.prompt_logprobs is not None, r.sample_index, r.finished)
        logprob = e.logprob
        top = e.top_logprobs
        if float_tol and logprob is not None:
            logprob = Close(logprob)
            top = [(i, Close(v)) for i, v in top] if top is not None else None
        out.setdefault(names[e.request_id], []).append((
            e.token_id, e.index, e.finished, e.finish_reason, e.error, logprob, top, e.text,
            e.stop_reason, e.prompt_logprobs is not None, e.sample_index, e.samples_running, result,
        ))
    return out


def both(model, arrivals, after_step=None, float_tol=False, **kwargs):
    """The per-request events of a synchronous and an overlapped engine on the same workload,
    and the overlapped engine (to check it did overlap)."""
    sync = engine_for(model, overlap=False, **kwargs)
    sync_events, sync_ids = drive(sync, arrivals, after_step)
    assert sync.overlapped_steps == 0
    overlapped = engine_for(model, overlap=True, **kwargs)
    over_events, over_ids = drive(overlapped, arrivals, after_step)
    return by_request(sync_events, sync_ids, float_tol), by_request(over_events, over_ids, float_tol), overlapped


def outputs(per_request: dict[str, list[tuple]]) -> dict[str, list[int]]:
    return {name: evs[-1][-1][1] for name, evs in per_request.items()}


def first_position(tokens: list[int], j: int) -> int | None:
    """A token whose first occurrence in ``tokens`` is at ``j`` (None if ``tokens[j]`` came earlier)."""
    return tokens[j] if j < len(tokens) and tokens[j] not in tokens[:j] else None


@pytest.mark.parametrize("graphs", [False, True])
def test_arrivals_stop_ids_and_lengths_at_every_boundary_match_sync_and_transformers(model, ref, graphs):
    ps = prompts(12, seed=1)
    free_runs = {i: reference_greedy(ref, p, 12) for i, p in enumerate(ps)}
    arrivals: dict[int, list[dict]] = {}
    expected = {}
    for i, p in enumerate(ps):
        spec = dict(name=f"r{i}", token_ids=p)
        if i % 2 == 0:  # ends by length after 1 .. 6 tokens
            spec["max_new_tokens"] = i // 2 + 1
            expected[f"r{i}"] = free_runs[i][: i // 2 + 1]
        else:  # ends on a stop id at output position 0 .. 5 (or by length if none fits)
            stop = first_position(free_runs[i], i // 2)
            spec.update(max_new_tokens=12, stop_token_ids=[stop] if stop is not None else None)
            expected[f"r{i}"] = reference_greedy(ref, p, 12, stop_ids={stop} if stop is not None else ())
        arrivals.setdefault(i % 5, []).append(spec)  # arriving over the first five steps
    sync, over, engine = both(model, arrivals, graphs=graphs)
    assert over == sync
    assert outputs(over) == expected
    assert engine.overlapped_steps > 0
    if graphs:
        assert engine.runner.decode_graphs.steps > 0
    reasons = {evs[-1][3] for evs in over.values()}
    assert reasons == {FinishReason.LENGTH, FinishReason.STOP}


def test_eos_at_every_boundary_matches_sync_and_transformers(tmp_path, ref, device):
    """EOS from the model's config (the same weights, with an EOS id that greedy outputs hit)."""
    ps = prompts(8, seed=2)
    free_runs = [reference_greedy(ref, p, 10) for p in ps]
    eos = Counter(t for run in free_runs for t in run).most_common(1)[0][0]
    eos_model = Qwen3.from_directory(make_checkpoint(tmp_path, seed=0, eos_token_id=eos), device=device, dtype="float32")
    arrivals = {0: [dict(name=f"r{i}", token_ids=p, max_new_tokens=10) for i, p in enumerate(ps)]}
    with_eos = next(i for i, run in enumerate(free_runs) if eos in run)
    arrivals[0].append(dict(name="ignoring", token_ids=ps[with_eos], max_new_tokens=10, ignore_eos=True))
    sync, over, engine = both(eos_model, arrivals)
    assert over == sync and engine.overlapped_steps > 0
    expected = {f"r{i}": reference_greedy(ref, p, 10, stop_ids={eos}) for i, p in enumerate(ps)}
    expected["ignoring"] = free_runs[with_eos]
    assert outputs(over) == expected
    assert sum(1 for evs in over.values() if evs[-1][8] == eos) >= 2  # stop_reason: EOS ended some


def test_stop_strings_at_every_boundary_match_sync(text_model, tokenizer):
    base = dict(text="the quick brown", max_new_tokens=24, temperature=1.0, ignore_eos=True)
    probe = Engine(text_model, num_pages=64, page_size=8, tokenizer=tokenizer, overlap=False)
    full = {}
    for seed in range(6):
        rid = probe.submit(**base, seed=seed)
        while not probe.idle:
            probe.step()
        full[seed] = probe.result(rid)
    arrivals: dict[int, list[dict]] = {0: [], 2: []}
    for seed, result in full.items():
        pieces = [tokenizer.decode([t]) for t in result.output_token_ids]
        j = 1 + seed * 3  # the stop string is the text of output token j, when it appears first there
        text_before = "".join(pieces[:j])
        stop = pieces[j] if j < len(pieces) and pieces[j].strip() and pieces[j] not in text_before else None
        stops = [stop] if stop else ["<<never>>"]
        arrivals[0 if seed % 2 else 2].append(dict(name=f"s{seed}", **base, seed=seed, stop_strings=stops))
    kw = dict(num_pages=64, page_size=8, tokenizer=tokenizer)
    sync, over, engine = both(text_model, arrivals, **kw)
    assert over == sync and engine.overlapped_steps > 0
    stopped = [evs for evs in over.values() if evs[-1][8] is not None and isinstance(evs[-1][8], str)]
    assert len(stopped) >= 2, "few stop strings were hit: the test would mean little"
    for evs in over.values():  # the streamed text is the result's
        assert "".join(e[7] for e in evs) == evs[-1][-1][4]


@pytest.mark.parametrize("graphs", [False, True])
def test_cancel_at_every_step_boundary_matches_sync(model, ref, graphs):
    """Cancel r1 right after the step that handed out its k-th token, for every k."""
    ps = prompts(4, seed=3, low=5, high=30)
    for k in range(1, 10):
        runs = []
        for overlap in (False, True):
            engine = engine_for(model, overlap=overlap, graphs=graphs)
            ids = {f"r{i}": engine.submit(p, max_new_tokens=10) for i, p in enumerate(ps)}
            events: list[Event] = []
            in_flight_at_cancel = None
            for _ in range(MAX_STEPS):
                if engine.idle:
                    break
                events += one_event_each(engine.step())
                received = [e for e in events if e.request_id == ids["r1"]]
                if in_flight_at_cancel is None and len(received) == k and not received[-1].finished:
                    in_flight_at_cancel = engine._requests[ids["r1"]].in_flight_row >= 0
                    assert engine.cancel(ids["r1"])
            assert_pool_free(engine)
            runs.append(by_request(events, ids))
            assert in_flight_at_cancel is overlap  # overlapped: its next token was on the device
        sync, over = runs
        assert over == sync, k
        r1 = over["r1"]
        assert r1[-1][3] is FinishReason.CANCELLED and len(r1[-1][-1][1]) == k
        assert [e[0] for e in r1[:-1]] == reference_greedy(ref, ps[1], 10)[:k]
        for i in (0, 2, 3):  # the others are untouched
            assert over[f"r{i}"][-1][-1][1] == reference_greedy(ref, ps[i], 10)


@pytest.mark.parametrize("graphs", [False, True])
def test_preemption_matches_sync_and_transformers(model, ref, graphs):
    ps = prompts(5, seed=4, low=8, high=14)
    arrivals = {0: [dict(name=f"r{i}", token_ids=p, max_new_tokens=18) for i, p in enumerate(ps)]}
    preemptions = {False: 0, True: 0}

    def count_preemptions(engine, events):
        done = sum(e.result.num_preemptions for e in events if e.result is not None)
        running = sum(r.metrics.num_preemptions for r in engine._requests.values() if not r.finished)
        preemptions[engine.overlap] = max(preemptions[engine.overlap], done + running)

    sync, over, engine = both(model, arrivals, count_preemptions, graphs=graphs, num_pages=16, max_active=5)
    assert over == sync and engine.overlapped_steps > 0
    assert outputs(over) == {f"r{i}": reference_greedy(ref, p, 18) for i, p in enumerate(ps)}
    assert preemptions[False] > 0 and preemptions[True] > 0


def test_scheduling_beside_a_step_in_flight_gives_up_instead_of_preempting(model):
    """``schedule(preempt=False)``, what an overlapped engine schedules with while a step is in
    flight: where a chunk would need a preemption it returns None and preempts nobody, and the
    same state scheduled with preemption then preempts."""
    engine = engine_for(model, overlap=False, num_pages=14, max_active=6)
    for p in prompts(6, seed=11, low=6, high=16):
        engine.submit(p, max_new_tokens=16)
    scheduler = engine.scheduler

    def preemptions():
        return sum(r.metrics.num_preemptions for r in engine._requests.values())

    outcomes = set()
    while not engine.idle:
        running, before = list(scheduler.running), preemptions()
        chosen = scheduler.schedule(preempt=False)
        assert preemptions() == before, "giving up must not preempt"
        if chosen is None:
            assert scheduler.running == running
            engine.step()
            assert preemptions() > before, "the same state scheduled with preemption preempts"
        else:
            engine.step()
        outcomes.add(chosen is None)
    assert outcomes == {True, False}
    assert_pool_free(engine)


def test_chunked_prefill_beside_decodes_matches_sync_and_transformers(model, ref):
    ps = prompts(6, seed=5, low=20, high=60)
    arrivals = {2 * i: [dict(name=f"r{i}", token_ids=p, max_new_tokens=8)] for i, p in enumerate(ps)}
    sync, over, engine = both(model, arrivals, token_budget=12, prefill_chunk=6)
    assert over == sync and engine.overlapped_steps > 0
    assert outputs(over) == {f"r{i}": reference_greedy(ref, p, 8) for i, p in enumerate(ps)}


@pytest.mark.parametrize("graphs", [False, True])
def test_seeded_sampling_and_logprobs_match_sync(model, graphs):
    ps = prompts(8, seed=6)
    drawn = [
        dict(temperature=0.9, seed=1), dict(temperature=1.2, top_p=0.8, seed=2), dict(temperature=0.7, top_k=5, seed=3),
        dict(temperature=1.0, min_p=0.05, seed=4, logprobs=True, top_logprobs=3), dict(), dict(logprobs=True),
        dict(temperature=0.9, seed=7, top_logprobs=2), dict(temperature=1.1, seed=8),
    ]
    arrivals = {i % 3: [] for i in range(3)}
    for i, (p, s) in enumerate(zip(ps, drawn)):
        arrivals[i % 3].append(dict(name=f"r{i}", token_ids=p, max_new_tokens=12, **s))
    sync, over, engine = both(model, arrivals, float_tol=True, graphs=graphs)
    assert over == sync and engine.overlapped_steps > 0
    assert any(e[6] for evs in over.values() for e in evs)  # top logprobs came along


def test_requests_that_step_synchronously_mixed_in_match_sync(model, ref):
    """Penalties, min_new_tokens, prompt logprobs: the steps sampling them are read at once;
    the plain requests (and the forked samples of n > 1) beside them still overlap."""
    ps = prompts(8, seed=7)
    # penalties and stop ids where they change these prompts' greedy runs (which repeat tokens)
    specs = [
        dict(frequency_penalty=0.8, presence_penalty=0.4, temperature=0.8, seed=2), dict(repetition_penalty=3.0),
        dict(min_new_tokens=5, stop_token_ids=[36, 44, 64]), dict(n=3, temperature=1.0, seed=4),
        dict(prompt_logprobs=2), dict(), dict(temperature=0.8, seed=6), dict(),
    ]
    arrivals = {0: [], 3: [], 9: []}
    for i, (p, s) in enumerate(zip(ps, specs)):
        arrivals[(0, 3, 9)[i % 3]].append(dict(name=f"r{i}", token_ids=p, max_new_tokens=10, **s))
    arrivals[0].append(dict(name="long", token_ids=ps[7], max_new_tokens=40))  # outlives the others
    # arriving beside "long" alone, which overlaps: the step after one that overlaps is synchronous
    arrivals[25] = [dict(name="late", token_ids=ps[0], max_new_tokens=4, repetition_penalty=2.0)]
    arrivals[31] = [dict(name="late-fork", token_ids=ps[1], max_new_tokens=4, n=2, temperature=1.0, seed=9)]
    sync, over, engine = both(model, arrivals, float_tol=True, max_active=12)
    assert over == sync and engine.overlapped_steps > 0
    assert over["r5"][-1][-1][1] == reference_greedy(ref, ps[5], 10)
    assert {e[10] for e in over["r3"]} == {0, 1, 2}
    assert over["r1"][-1][-1][1].count(64) == 1  # the penalty is felt: without it, 64 repeats


def test_constrained_requests_mixed_in_match_sync(text_model, tokenizer):
    pytest.importorskip("llguidance")
    base = dict(text="the quick", max_new_tokens=16, temperature=1.0, ignore_eos=True)
    arrivals = {
        0: [dict(name="free0", **base, seed=1), dict(name="regex", **base, seed=2, regex=r"[a-z]{2,6}( [a-z]{2,6})?")],
        2: [dict(name="free1", **base, seed=3), dict(name="choice", **base, seed=4, choice=["yes", "no", "maybe"])],
        5: [dict(name="free2", **base, seed=5)],
    }
    kw = dict(num_pages=64, page_size=8, tokenizer=tokenizer)
    sync, over, engine = both(text_model, arrivals, **kw)
    assert over == sync and engine.overlapped_steps > 0
    assert over["choice"][-1][-1][4] in ("yes", "no", "maybe")


def test_a_step_is_read_only_after_the_next_is_launched(model, monkeypatch):
    """Observable order of launches and reads, and what an overlapped engine holds meanwhile."""
    engine = engine_for(model, overlap=True)
    order: list[str] = []
    launch = engine.runner.sampler.sample_on_device

    def logged(logits, requests):
        sample = launch(logits, requests)
        number = sum(1 for o in order if o.startswith("launch")) + 1
        order.append(f"launch {number}")
        read = sample.read

        def logged_read():
            order.append(f"read {number}")
            return read()

        sample.read = logged_read
        return sample

    monkeypatch.setattr(engine.runner.sampler, "sample_on_device", logged)
    rid = engine.submit([1, 2, 3, 4, 5], max_new_tokens=3)
    assert engine.step() == [] and not engine.idle  # the first token is in flight
    assert engine.result(rid).output_token_ids == []
    assert [e.index for e in engine.step()] == [0] and order == ["launch 1", "launch 2", "read 1"]
    assert [e.index for e in engine.step()] == [1] and order[-2:] == ["launch 3", "read 2"]
    assert not engine.scheduler.waiting and not engine.idle
    # the token in flight is the last: nothing is scheduled, and the step in flight is read
    last = engine.step()
    assert [(e.index, e.finish_reason) for e in last] == [(2, FinishReason.LENGTH)]
    assert order[-2:] == ["read 2", "read 3"] and engine.idle and engine.overlapped_steps == 2
    assert engine.step() == []
    assert_pool_free(engine)


def test_a_finished_requests_row_in_the_next_step_is_dropped(model, ref):
    """A request that stops in step N was given a row in step N+1 (its token was not known):
    that row yields no event and the result keeps the stop."""
    p = prompts(1, seed=8)[0]
    free = reference_greedy(ref, p, 8)
    stop = first_position(free, 2)
    assert stop is not None
    engine = engine_for(model, overlap=True)
    rid = engine.submit(p, max_new_tokens=8, stop_token_ids=[stop])
    events = []
    while not engine.idle:
        events += engine.step()
    assert [e.token_id for e in events] == free[:3]
    assert engine.result(rid).output_token_ids == free[:3] and engine.result(rid).stop_reason == stop
    assert engine.overlapped_steps >= 3  # the row after the stop was launched too
    assert_pool_free(engine)


def test_a_failing_step_fails_its_requests_after_the_step_in_flight_is_read(model, ref, monkeypatch):
    p0, p1 = prompts(2, seed=9)
    runs = []
    for overlap in (False, True):
        engine = engine_for(model, overlap=overlap)
        forward = engine.model.forward
        calls = {"n": 0}

        def failing_once(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("injected")
            return forward(*args, **kwargs)

        monkeypatch.setattr(engine.model, "forward", failing_once)
        ids = {"a": engine.submit(p0, max_new_tokens=6), "b": engine.submit(p1, max_new_tokens=6)}
        events = []
        while not engine.idle:
            events += one_event_each(engine.step())
        assert_pool_free(engine)
        runs.append(by_request(events, ids))
        monkeypatch.undo()
    sync, over = runs
    assert over == sync
    for name, p in (("a", p0), ("b", p1)):
        assert over[name][-1][3] is FinishReason.ERROR and "injected" in over[name][-1][4]
        tokens = [e[0] for e in over[name][:-1]]
        assert tokens == reference_greedy(ref, p, 6)[: len(tokens)] and 0 < len(tokens) < 6


def test_close_with_a_step_in_flight(model):
    engine = engine_for(model, overlap=True)
    engine.submit([1, 2, 3], max_new_tokens=5)
    engine.step()
    engine.step()
    assert engine._in_flight is not None
    engine.close()
    assert engine.idle
    assert engine.pool.num_used == 0


def test_overlap_is_on_by_default_on_cuda_only(model, device):
    assert Engine(model, num_pages=8).overlap is (device == "cuda")
    assert Engine(model, num_pages=8, overlap=True).overlap
    assert not Engine(model, num_pages=8, overlap=False).overlap


def test_generate_with_overlap_matches_transformers(model, ref):
    ps = prompts(5, seed=10)
    engine = engine_for(model, overlap=True)
    results = engine.generate(ps, max_new_tokens=7)
    assert [r.output_token_ids for r in results] == [reference_greedy(ref, p, 7) for p in ps]
    assert engine.overlapped_steps > 0 and engine.idle
    assert_pool_free(engine)


# -- served: a real server whose worker runs an overlapped engine


@pytest.fixture(scope="module")
def overlapped_server(model_dir):
    from service_fixtures import ENGINE, start_server

    srv = start_server(model_dir, engine=dict(ENGINE, overlap=True))
    yield srv
    srv.stop()


def test_a_served_overlapped_worker_streams_what_a_synchronous_engine_gives(overlapped_server, model_dir):
    """The worker loop keeps stepping while a step is in flight (``idle`` is false), streams
    every request's tokens once and in order, ends them where the synchronous engine does, and
    a cancel mid-stream frees every page."""
    import asyncio

    from qil_client import AsyncClient, Client
    from service_fixtures import ENGINE, wait_until

    ps = [[(5 * i + j) % 97 for j in range(3 + i % 7)] for i in range(16)]
    lengths = [1 + i % 9 for i in range(16)]
    sync = Engine(Qwen3.from_directory(model_dir), **ENGINE)
    free = [sync.submit(p, max_new_tokens=16) for p in ps]
    while not sync.idle:
        sync.step()
    free_runs = [sync.result(rid).output_token_ids for rid in free]
    stops = [run[2] for run in free_runs]
    want = [run[: n] for run, n in zip(free_runs, lengths)]
    want_stopped = [run[: run.index(stop) + 1] for run, stop in zip(free_runs, stops)]

    async def run():
        async with AsyncClient(overlapped_server.target, timeout=60) as ac:
            by_length = [ac.generate(p, max_new_tokens=n) for p, n in zip(ps, lengths)]
            by_stop = [ac.generate(p, max_new_tokens=16, stop_token_ids=[s]) for p, s in zip(ps, stops)]
            return await asyncio.gather(*by_length, *by_stop)

    results = asyncio.run(run())
    assert [r.token_ids for r in results] == want + want_stopped
    assert [r.finish_reason for r in results] == ["length"] * 16 + ["stop"] * 16
    with Client(overlapped_server.target, timeout=60) as client:
        stream = client.stream([1, 2, 3], max_new_tokens=5000, request_id="long")
        seen = [t for _, e in zip(range(3), stream) for t in e.token_ids]
        assert client.cancel("long") == {"long": True}
        stream.close()
        wait_until(lambda: client.info().pages.used == 0 and client.info().num_unfinished == 0)
        result = client.result("long")
        assert result.finish_reason == "cancelled" and result.token_ids[: len(seen)] == seen
