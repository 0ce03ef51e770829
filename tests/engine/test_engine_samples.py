"""``n`` samples of one prompt in one request: the prompt is computed once and its pages shared,
each sample draws with its own seed, events and results carry the sample index, cancel ends all,
and every page is free again after any mix of ends."""

from __future__ import annotations

import re

import pytest

from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from qil_worker import Engine, FinishReason, InvalidRequestError
from qil_worker.engine.sampling_params import MAX_SAMPLES
from qil_worker.engine.samples import sample_seed
from qil_worker.errors import CapacityError

SAMPLED = dict(temperature=1.0, top_k=50, seed=77)
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]  # 10 tokens: two full pages of 4 and a partial one


def _computed_tokens(engine: Engine) -> list[int]:
    """Count the tokens each step computes (observed where the scheduler commits them)."""
    counted = [0]
    commit = engine.scheduler.commit

    def counting(chunks):
        counted[0] += sum(c.num_tokens for c in chunks)
        commit(chunks)

    engine.scheduler.commit = counting
    return counted


def _by_sample(events, rid):
    out: dict[int, list[int]] = {}
    for e in events:
        if e.request_id == rid and e.token_id is not None:
            out.setdefault(e.sample_index, []).append(e.token_id)
    return out


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_prompt_is_computed_once_and_its_full_pages_are_shared(model, prefix_cache):
    engine = Engine(model, num_pages=64, page_size=4, prefix_cache=prefix_cache, debug=True)
    computed = _computed_tokens(engine)
    rid = engine.submit(PROMPT, max_new_tokens=6, n=4, ignore_eos=True, **SAMPLED)
    events = engine.step()  # the whole prompt in one chunk: it forks here
    assert computed[0] == len(PROMPT)
    assert sorted(e.sample_index for e in events) == [0, 1, 2, 3]  # every sample's first token
    # 2 full pages shared by all four, plus a partial page each: 2 + 4, not 4 x 3
    assert engine.stats().num_pages_used == 2 + 4
    assert engine.stats().num_running == 4
    events += run_to_completion(engine)
    # after the prompt, each sample computes its own tokens but the last
    assert computed[0] == len(PROMPT) + 4 * 5
    results = engine.results(rid)
    assert [r.sample_index for r in results] == [0, 1, 2, 3]
    assert all(len(r.output_token_ids) == 6 and r.finish_reason is FinishReason.LENGTH for r in results)
    assert _by_sample(events, rid) == {i: r.output_token_ids for i, r in enumerate(results)}
    assert_pool_free(engine)


def test_greedy_samples_are_identical_and_equal_the_single_request(model, ref):
    engine = Engine(model, num_pages=64, page_size=4)
    (single,) = engine.generate([PROMPT], max_new_tokens=8)
    (pair,) = engine.generate([PROMPT], max_new_tokens=8, n=2)
    assert [r.output_token_ids for r in pair] == [single.output_token_ids] * 2
    assert single.output_token_ids == reference_greedy(ref, PROMPT, 8, stop_ids=model.config.eos_token_ids)
    assert_pool_free(engine)


def test_each_seeded_sample_equals_a_single_request_with_its_derived_seed(model):
    engine = Engine(model, num_pages=64, page_size=4)
    (samples,) = engine.generate([PROMPT], max_new_tokens=12, n=3, **SAMPLED)
    seeds = [sample_seed(SAMPLED["seed"], i) for i in range(3)]
    assert seeds[0] == SAMPLED["seed"]  # sample 0 is the request with n = 1
    alone = [
        engine.generate([PROMPT], max_new_tokens=12, **{**SAMPLED, "seed": s})[0].output_token_ids
        for s in seeds
    ]
    assert [r.output_token_ids for r in samples] == alone
    assert len({tuple(a) for a in alone}) == 3, "the samples were meant to differ"


def test_seeded_samples_are_the_same_alone_batched_and_after_preemption(model):
    (alone,) = Engine(model, num_pages=64, page_size=4).generate([PROMPT], max_new_tokens=20, n=3, **SAMPLED)

    tight = Engine(model, num_pages=24, page_size=4, token_budget=24, prefill_chunk=8, debug=True)
    noise = [tight.submit([i + 1] * (3 + i), max_new_tokens=16, temperature=0.8, seed=i) for i in range(4)]
    rid = tight.submit(PROMPT, max_new_tokens=20, n=3, **SAMPLED)
    noise += [tight.submit([50 + i] * 5, max_new_tokens=16, temperature=0.8, seed=i) for i in range(3)]
    run_to_completion(tight)
    results = tight.results(rid)
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in alone]
    preemptions = sum(r.num_preemptions for r in results) + sum(tight.result(o).num_preemptions for o in noise)
    assert preemptions > 0, "the small pool was meant to force preemption"
    assert_pool_free(tight)


def test_one_sample_preempted_mid_run_recomputes_its_own_tokens(model):
    engine = Engine(model, num_pages=64, page_size=4, debug=True)
    (expected,) = engine.generate([PROMPT], max_new_tokens=10, n=3, ignore_eos=True, **SAMPLED)
    rid = engine.submit(PROMPT, max_new_tokens=10, n=3, ignore_eos=True, **SAMPLED)
    for _ in range(4):
        engine.step()
    victim = engine.scheduler.running[-1]  # the newest admitted: a forked sample
    assert victim.sample_index > 0 and victim.request_id == rid
    engine.scheduler._preempt(victim)
    run_to_completion(engine)
    results = engine.results(rid)
    assert results[victim.sample_index].num_preemptions == 1
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in expected]
    assert_pool_free(engine)


def test_events_carry_the_sample_index_and_the_last_final_ends_the_request(model):
    engine = Engine(model, num_pages=64, page_size=4)
    rid = engine.submit(PROMPT, max_new_tokens=5, n=3, ignore_eos=True, **SAMPLED)
    events = run_to_completion(engine)
    finals = [e for e in events if e.finished]
    assert sorted(e.sample_index for e in finals) == [0, 1, 2]
    assert [e.request_finished for e in finals] == [False, False, True]
    assert all(e.result.sample_index == e.sample_index for e in finals)
    by_sample = _by_sample(events, rid)
    assert {i: engine.results(rid)[i].output_token_ids for i in range(3)} == by_sample
    for i in range(3):  # per sample, token indices count that sample's output
        assert [e.index for e in events if e.sample_index == i and e.token_id is not None] == list(range(5))


def test_cancel_ends_every_sample_and_frees_every_page(model):
    engine = Engine(model, num_pages=64, page_size=4, debug=True)
    rid = engine.submit(PROMPT, max_new_tokens=30, n=4, ignore_eos=True, **SAMPLED)
    for _ in range(3):
        engine.step()
    assert engine.cancel(rid)
    assert not engine.cancel(rid)
    events = run_to_completion(engine)
    finals = [e for e in events if e.finished]
    assert sorted(e.sample_index for e in finals) == [0, 1, 2, 3]
    assert all(e.finish_reason is FinishReason.CANCELLED for e in finals)
    assert [e.request_finished for e in finals][-1] and sum(e.request_finished for e in finals) == 1
    assert_pool_free(engine)
    # before the fork too: the samples waiting for the prompt end with it
    rid = engine.submit(PROMPT * 3, max_new_tokens=4, n=3, **SAMPLED)
    assert engine.cancel(rid)
    events = run_to_completion(engine)
    assert sorted(e.sample_index for e in events if e.finished) == [0, 1, 2]
    assert_pool_free(engine)
    # a submit of the same id is possible again once its events are handed out
    engine.submit(PROMPT, max_new_tokens=2, n=2, request_id=rid)
    run_to_completion(engine)
    assert len(engine.results(rid)) == 2
    assert_pool_free(engine)


def test_samples_end_for_their_own_reasons(model):
    engine = Engine(model, num_pages=96, page_size=4)
    (greedy,) = engine.generate([PROMPT], max_new_tokens=6, ignore_eos=True)
    stop = greedy.output_token_ids[3]
    # greedy: every sample stops at the same id; sampled: each stops (or not) on its own
    (sampled,) = engine.generate([PROMPT], max_new_tokens=3, n=6, stop_token_ids=[stop], **SAMPLED)
    for r in sampled:
        if r.finish_reason is FinishReason.STOP:
            assert r.output_token_ids[-1] == stop and r.stop_reason == stop
            assert stop not in r.output_token_ids[:-1]
        else:
            assert r.finish_reason is FinishReason.LENGTH and len(r.output_token_ids) == 3
    assert {r.finish_reason for r in sampled} == {FinishReason.STOP, FinishReason.LENGTH}
    (mins,) = engine.generate([PROMPT], max_new_tokens=8, n=2, stop_token_ids=[stop], min_new_tokens=8)
    assert all(len(r.output_token_ids) == 8 for r in mins)
    (lp,) = engine.generate([PROMPT], max_new_tokens=3, n=2, logprobs=True, top_logprobs=2, **SAMPLED)
    assert all(r.finish_reason is not None for r in lp)
    assert_pool_free(engine)


def test_a_sample_that_ends_at_its_first_token_leaves_the_others_running(model):
    engine = Engine(model, num_pages=64, page_size=4, debug=True)
    (first,) = engine.generate([PROMPT], max_new_tokens=1, n=1)
    (samples,) = engine.generate([PROMPT], max_new_tokens=4, n=3, stop_token_ids=[first.output_token_ids[0]])
    assert all(r.output_token_ids == first.output_token_ids and r.finish_reason is FinishReason.STOP for r in samples)
    (one,) = engine.generate([PROMPT], max_new_tokens=1, n=4, **SAMPLED)
    assert all(len(r.output_token_ids) == 1 and r.finish_reason is FinishReason.LENGTH for r in one)
    assert_pool_free(engine)


def test_a_failing_step_fails_every_sample_and_frees_the_pages(model, monkeypatch):
    engine = Engine(model, num_pages=64, page_size=4)
    rid = engine.submit(PROMPT, max_new_tokens=4, n=3)
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    events = run_to_completion(engine)
    finals = [e for e in events if e.finished]
    assert sorted(e.sample_index for e in finals) == [0, 1, 2]
    assert all(e.finish_reason is FinishReason.ERROR and "boom" in e.error for e in finals)
    assert finals[-1].request_finished
    assert [r.finish_reason for r in engine.results(rid)] == [FinishReason.ERROR] * 3
    assert_pool_free(engine)


def test_a_short_pool_at_the_fork_queues_the_sample_to_compute_its_prompt(model):
    # 10-token prompt, page size 4: sample 0 holds 3 pages, each forked sample needs one more for
    # its copy of the partial page; with 4 pages in all only one of two gets it
    engine = Engine(model, num_pages=4, page_size=4, max_active=4, debug=True)
    (expected,) = Engine(model, num_pages=64, page_size=4).generate([PROMPT], max_new_tokens=2, n=3, **SAMPLED)
    from qil_worker.engine import samples as samples_module

    real = samples_module.check_fits
    try:
        samples_module.check_fits = lambda *a, **k: None  # the pool is too small by design here
        rid = engine.submit(PROMPT, max_new_tokens=2, n=3, **SAMPLED)
    finally:
        samples_module.check_fits = real
    run_to_completion(engine)
    assert [r.output_token_ids for r in engine.results(rid)] == [r.output_token_ids for r in expected]
    assert_pool_free(engine)


def test_validation_names_n(model):
    engine = Engine(model, num_pages=16, page_size=4, max_active=8)
    for bad in (0, -1, MAX_SAMPLES + 1, 1.5, True):
        with pytest.raises(InvalidRequestError) as err:
            engine.submit(PROMPT, max_new_tokens=4, n=bad)
        assert err.value.field == "n"
    with pytest.raises(CapacityError) as err:
        engine.submit(PROMPT, max_new_tokens=4, n=9)  # more than max_active
    assert err.value.field == "n" and "at most 8" in str(err.value)
    with pytest.raises(CapacityError) as err:
        engine.submit(PROMPT, max_new_tokens=20, n=3)  # 3 x 8 pages > 16
    assert err.value.field == "n"
    engine.submit(PROMPT, max_new_tokens=20, n=2)  # 2 x 8 fits
    run_to_completion(engine)
    assert_pool_free(engine)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    from checkpoints import make_text_checkpoint

    return make_text_checkpoint(tmp_path_factory.mktemp("samples-text"))


@pytest.fixture(scope="module")
def text_engine(text_dir):
    from qil_worker import Qwen3
    from qil_worker.text import load_tokenizer

    return Engine(Qwen3.from_directory(text_dir), num_pages=96, page_size=8, tokenizer=load_tokenizer(text_dir))


def test_each_sample_has_its_own_text_and_stop_strings(text_engine):
    engine = text_engine
    base = dict(text="the quick", max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    rid = engine.submit(**base, n=4)
    events = run_to_completion(engine)
    full = engine.results(rid)
    for i, r in enumerate(full):  # streamed text per sample adds up to that sample's text
        assert "".join(e.text for e in events if e.sample_index == i) == r.output_text
    # a stop string taken from sample 2's text: each sample stops where its own text has it
    stop = full[2].output_text[6:8]
    rid = engine.submit(**base, n=4, stop_strings=[stop])
    events = run_to_completion(engine)
    for i, r in enumerate(engine.results(rid)):
        alone_id = engine.submit(**{**base, "seed": sample_seed(base["seed"], i)}, stop_strings=[stop])
        run_to_completion(engine)
        alone = engine.result(alone_id)
        assert (r.output_token_ids, r.output_text, r.finish_reason) == (
            alone.output_token_ids, alone.output_text, alone.finish_reason
        )
        if stop in full[i].output_text:
            assert r.finish_reason is FinishReason.STOP and r.stop_reason == stop
            assert r.output_text == full[i].output_text[: full[i].output_text.find(stop)]
        assert "".join(e.text for e in events if e.sample_index == i) == r.output_text
    assert_pool_free(engine)


def test_each_sample_follows_the_constraint_with_its_own_matcher(text_engine):
    # One matcher shared by the samples would be advanced by every sample's tokens: the outputs
    # would not each match, and a regex over several tokens would fail mid-way.
    engine = text_engine
    regex = r"(ab|cd|ef)[0-9]{2,4}"
    base = dict(text="the quick", max_new_tokens=16, temperature=1.0, seed=11, regex=regex)
    rid = engine.submit(**base, n=4)
    run_to_completion(engine)
    full = engine.results(rid)
    assert len({tuple(r.output_token_ids) for r in full}) > 1  # the samples differ
    for i, r in enumerate(full):
        assert r.finish_reason is FinishReason.STOP and re.fullmatch(regex, r.output_text), r
        alone_id = engine.submit(**{**base, "seed": sample_seed(base["seed"], i)})
        run_to_completion(engine)
        assert engine.result(alone_id).output_token_ids == r.output_token_ids
    choices = ["red", "green", "blue"]
    rid = engine.submit(text="pick", max_new_tokens=8, temperature=1.0, seed=3, choice=choices, n=6)
    run_to_completion(engine)
    assert all(r.output_text in choices for r in engine.results(rid))
    assert_pool_free(engine)


@pytest.mark.parametrize("prompt", [PROMPT, [7], [1, 2, 3, 4, 5, 6, 7, 8]])
def test_samples_through_the_padded_decode_path(model, prompt):
    # cuda_graphs=True off CUDA runs the graphs' padded decode path without capture; a one-token
    # prompt forks in a decode-only step, a prompt of whole pages has no partial page to copy
    plain = Engine(model, num_pages=64, page_size=4)
    padded = Engine(model, num_pages=64, page_size=4, cuda_graphs=True)
    assert padded.runner.decode_graphs is not None
    (expected,) = plain.generate([prompt], max_new_tokens=9, n=3, ignore_eos=True, **SAMPLED)
    (got,) = padded.generate([prompt], max_new_tokens=9, n=3, ignore_eos=True, **SAMPLED)
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in expected]
    singles = [
        plain.generate([prompt], max_new_tokens=9, ignore_eos=True, **{**SAMPLED, "seed": sample_seed(77, i)})[0]
        for i in range(3)
    ]
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in singles]
    assert_pool_free(padded)


def test_the_worker_cli_prints_every_sample(text_dir, text_engine, capsys):
    import json

    from qil_worker.__main__ import main

    argv = ["generate", "--model", str(text_dir), "--prompt", "hello", "--n", "3", "--max-new-tokens", "6",
            "--ignore-eos", "--temperature", "1", "--seed", "4"]
    rid = text_engine.submit(text="hello", max_new_tokens=6, n=3, ignore_eos=True, temperature=1.0, seed=4)
    run_to_completion(text_engine)
    want = text_engine.results(rid)
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["output_token_ids"] for s in out["samples"]] == [r.output_token_ids for r in want]
    assert [s["sample_index"] for s in out["samples"]] == [0, 1, 2]
    assert out["output_token_ids"] == want[0].output_token_ids
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(want[0].output_text)
    for i in (1, 2):
        assert f"--- sample {i} ---\n{want[i].output_text}" in printed


def test_sample_0_preempted_before_the_fork_still_forks_them_all_once(model):
    prompt = list(range(1, 21))  # 20 tokens: three chunks of 8
    (expected,) = Engine(model, num_pages=64, page_size=4).generate([prompt], max_new_tokens=6, n=3, **SAMPLED)
    engine = Engine(model, num_pages=64, page_size=4, prefill_chunk=8, prefix_cache=False, debug=True)
    computed = _computed_tokens(engine)
    rid = engine.submit(prompt, max_new_tokens=6, n=3, ignore_eos=True, **SAMPLED)
    engine.step()
    assert computed[0] == 8 and engine.stats().num_running == 1
    engine.scheduler._preempt(engine.scheduler.running[0])
    run_to_completion(engine)
    results = engine.results(rid)
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in expected]
    assert results[0].num_preemptions == 1
    assert computed[0] == 8 + 20 + 3 * 5  # the prompt again after the preemption, then once per sample
    assert_pool_free(engine)


def test_the_prefix_cache_sees_one_request_and_keeps_its_pages(model):
    engine = Engine(model, num_pages=64, page_size=4)
    engine.generate([PROMPT], max_new_tokens=4, n=3, **SAMPLED)
    assert engine.prefix_cache.queried_tokens == len(PROMPT)  # counted once, at sample 0's admission
    assert engine.stats().num_pages_cached == 2  # the two full prompt pages, idle once all let go
    (again,) = engine.generate([PROMPT], max_new_tokens=4, n=2, **SAMPLED)
    assert all(r.num_cached_tokens == 8 for r in again)
    assert_pool_free(engine)


def test_the_worker_batch_carries_each_event_s_sample_and_final(model):
    import pickle

    from qil_worker.service import protocol as P
    from qil_worker.service.worker import loop as worker

    engine = Engine(model, num_pages=64, page_size=4)
    rid = engine.submit(PROMPT, max_new_tokens=2, n=3, ignore_eos=True, **SAMPLED)
    first = engine.step()
    stats = worker.pool_stats(engine)
    batch = pickle.loads(pickle.dumps(worker.step_batch([], first, stats, None)))
    assert batch.samples == [0, 1, 2] and batch.request_ids == [rid] * 3 and not batch.finals
    last = pickle.loads(pickle.dumps(worker.step_batch([], engine.step(), stats, None)))
    assert set(last.finals) == {rid, (rid, 1), (rid, 2)}
    assert all(f.reason is P.FinishReason.LENGTH and f.num_output_tokens == 2 for f in last.finals.values())
    # a batch of sample-0 events only has no column
    engine.submit(PROMPT, max_new_tokens=1)
    assert worker.step_batch([], engine.step(), stats, None).samples is None
