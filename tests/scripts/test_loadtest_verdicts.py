"""The load test's verdicts on faults it must catch, so that a checker that lets one pass fails
here: the event checker's sequence, count and foreign-event checks, ``evaluate``'s invariants on
synthetic records, the reported figures, and whole runs against a stand-in server that
misbehaves."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import loadtest as lt  # noqa: E402
from qil_client import pb  # noqa: E402

ARGS = argparse.Namespace(rss_per_process=False, rss_tolerance=0.1, no_consistency=False)


def rec(max_new=4, rid="r", kind="normal", **fields):
    r = lt.Rec(rid=rid, kind=kind, transport="generate", prompt_key=0, prompt_len=3, max_new=max_new,
               warmup=False)
    for name, value in fields.items():
        setattr(r, name, value)
    return r


def ev(seq, tokens, finished=False, n=None, reason=pb.FINISH_REASON_LENGTH, rid="r"):
    e = pb.Event(request_id=rid, seq=seq, token_ids=tokens, finished=finished)
    if finished:
        e.finish_reason = reason
        e.num_output_tokens = seq + len(tokens) if n is None else n
    return e


def check(events, max_new=4):
    r = rec(max_new)
    checker = lt.EventChecker(r, True)
    for i, e in enumerate(events):
        checker.add(e, float(i))
    checker.close(primary=True)
    return r.problems


def info(total=0, used=0, restarts=0):
    i = pb.GetInfoResponse(num_requests_total=total)
    i.pages.used, i.pages.total = used, 10
    i.worker.restarts, i.worker.state = restarts, pb.WORKER_STATE_READY
    return i


def evaluate(recs, before=None, after=None, mem_before=None, mem_after=None, args=ARGS):
    for r in recs:
        r.accepted = True
    return lt.evaluate(args, recs, before or info(0), after or info(len(recs)), 0.0,
                       mem_before or {}, mem_after or {})


# -- the event checker


def test_a_skipped_seq_is_a_gap_even_when_the_count_adds_up():
    assert "gap_free" in check([ev(0, [1]), ev(2, [2, 3]), ev(4, [4], True, n=4)])


def test_a_final_count_below_the_tokens_received_is_a_gap():
    assert "gap_free" in check([ev(0, [1, 2, 3, 4], True, n=3, reason=pb.FINISH_REASON_STOP)], max_new=8)


def test_one_token_beyond_max_new_tokens_is_a_fault():
    assert "gap_free" in check([ev(0, [1, 2, 3, 4, 5], True, reason=pb.FINISH_REASON_STOP)], max_new=4)


def test_an_event_after_the_final_one_is_a_fault():
    assert "one_final_event" in check([ev(0, [1, 2, 3, 4], True), ev(4, [])])


def test_an_event_of_another_request_is_a_fault():
    assert "gap_free" in check([ev(0, [1], rid="other"), ev(1, [2, 3, 4], True)])


# -- evaluate() on synthetic records


def test_cancel_semantics_catch_each_contradiction():
    said_active_ran_on = rec(cancel_sent=True, cancel_was_active=True, finish="length")
    said_inactive_was_cancelled = rec(cancel_sent=True, cancel_was_active=False, finish="cancelled")
    cancelled_unasked = rec(finish="cancelled")
    for r in (said_active_ran_on, said_inactive_was_cancelled, cancelled_unasked):
        assert not evaluate([r])["cancel_semantics"]["ok"]


def test_server_counts_catch_an_over_count_and_a_restart():
    assert not evaluate([rec(finish="length")], after=info(2))["server_counts"]["ok"]
    assert not evaluate([rec(finish="length")], after=info(1, restarts=1))["server_counts"]["ok"]


def test_pages_left_in_use_after_the_run_fail():
    assert not evaluate([rec(finish="length")], after=info(1, used=3))["pages_free"]["ok"]


@pytest.mark.parametrize("per_process", [False, True])
def test_memory_growth_fails_in_sum_and_per_process(per_process):
    args = argparse.Namespace(**{**vars(ARGS), "rss_per_process": per_process})
    result = evaluate([rec(finish="length")], mem_before={"front": 100, "worker": 100},
                      mem_after={"front": 100, "worker": 200}, args=args)
    assert not result["memory"]["ok"]


def test_outputs_that_differ_at_their_last_token_are_inconsistent():
    a, b = rec(rid="a", tokens=[1, 2, 3]), rec(rid="b", tokens=[1, 2, 9])
    assert len(lt.check_consistency([a, b])) == 1


# -- figures


def test_percentiles_sort_their_samples():
    assert lt.pct([3.0, 1.0, 2.0], 50) == 2.0


def test_ttft_is_the_time_to_the_first_token():
    r = rec(t_start=0.0, t_first=1.0, t_end=5.0, finish="length")
    assert lt.figures([r], 5.0)["ttft_ms"]["p50"] == 1000.0


# -- whole runs against a stand-in server


class FakeAsyncClient:
    """Answers like a server whose faults the test switches on."""

    total = 0
    rids: list = []
    n: dict = {}
    extra_after_final = False
    final_reason = pb.FINISH_REASON_LENGTH
    replay_shift = 0
    cancel_active = True
    warmup_gap = False

    def __init__(self, *args, **kwargs):
        pass

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        pass

    async def close(self):
        pass

    async def info(self, timeout=None):
        i = info(FakeAsyncClient.total)
        i.model.vocab_size, i.model.max_position_embeddings = 50, 256
        i.limits.page_size, i.pages.total = 16, 100
        return i

    def _events(self, rid, n, shift=0):
        out = [ev(k, [(k + shift) % 50], rid=rid) for k in range(n - 1)]
        out.append(ev(n - 1, [(n - 1 + shift) % 50], True, reason=FakeAsyncClient.final_reason, rid=rid))
        if FakeAsyncClient.warmup_gap and "-warmup-" in rid and n > 1:
            out[1].seq += 1
        if FakeAsyncClient.extra_after_final:
            out.append(ev(n, [], True, rid=rid))
        return out

    async def stream(self, prompt, max_new_tokens, request_id, timeout=None):
        FakeAsyncClient.total += 1
        FakeAsyncClient.rids.append(request_id)
        FakeAsyncClient.n[request_id] = max_new_tokens
        for e in self._events(request_id, max_new_tokens):
            await asyncio.sleep(0.002)  # a stream that takes time, as a server's does: the run's timings
            yield e

    async def events(self, rid, timeout=None):
        for e in self._events(rid, FakeAsyncClient.n[rid], FakeAsyncClient.replay_shift):
            yield e

    async def cancel(self, rid, timeout=None):
        return {rid: FakeAsyncClient.cancel_active}


@pytest.fixture
def fake(monkeypatch):
    for name, value in dict(total=0, rids=[], n={}, extra_after_final=False, replay_shift=0,
                            final_reason=pb.FINISH_REASON_LENGTH, cancel_active=True,
                            warmup_gap=False).items():
        setattr(FakeAsyncClient, name, value)
    monkeypatch.setattr(lt, "AsyncClient", FakeAsyncClient)
    monkeypatch.setattr(lt, "draw", lambda rng, wl: (
        "normal", "generate", rng.randrange(len(wl.prompts)), rng.randint(*wl.max_new_range)))
    return FakeAsyncClient


def run_one(kind, max_new=6, seed=1):
    workload = lt.Workload(50, [[1, 2, 3]], (max_new, max_new), 0, 0, 0, (0, 0))
    r = rec(max_new, rid="lt-x-run-0-0", kind=kind)
    asyncio.run(lt.Runner(FakeAsyncClient(), workload, 5.0).run(r, random.Random(seed)))
    return r


def test_an_event_after_the_final_one_on_a_generate_stream_is_caught(fake):
    fake.extra_after_final = True
    assert "one_final_event" in run_one("normal").problems


def test_a_request_that_ends_in_error_is_a_failure(fake):
    fake.final_reason = pb.FINISH_REASON_ERROR
    assert "no_failures" in run_one("normal").problems


def test_a_replay_that_differs_from_the_stream_is_a_gap(fake):
    fake.replay_shift = 7
    assert "gap_free" in run_one("disconnect").problems


def test_a_cancel_said_active_on_a_request_that_ran_on_fails(fake):
    r = run_one("cancel")
    r.accepted = True
    assert r.cancel_sent and r.finish == "length"
    assert not lt.evaluate(ARGS, [r], info(0), info(1), 0, {}, {})["cancel_semantics"]["ok"]


def _short_run():
    args = lt.parse_args(["--target", "127.0.0.1:1", "--concurrency", "2", "--duration", "0.3",
                          "--warmup", "0.2", "--max-new-range", "3,5", "--settle", "0", "--no-consistency"])
    return asyncio.run(lt.amain(args))


def test_elapsed_is_the_rounds_wall_time(fake):
    workload = lt.Workload(50, [[1, 2, 3]], (4, 4), 0, 0, 0, (0, 0))
    args = argparse.Namespace(channels=1, concurrency=2, target="x", request_timeout=5.0)
    _, elapsed = asyncio.run(lt.run_round(args, workload, "run", 0.3, 0, "n"))
    assert elapsed >= 0.3


def test_warmup_requests_are_not_counted(fake):
    report = _short_run()
    assert report["warmup_requests"] > 0
    assert report["figures"]["requests"] == sum("-run-" in rid for rid in fake.rids)


def test_a_fault_during_the_warmup_fails_the_run(fake):
    fake.warmup_gap = True
    assert _short_run()["ok"] is False
