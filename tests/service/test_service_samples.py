"""``n`` samples over gRPC against a real server: every sample's events arrive, gap-free across
samples, the last event ends the request, a late subscriber replays all of them, cancel ends all
and frees every page, and max_queued counts the request once."""

from __future__ import annotations

import pytest

from qil_client import Client, InvalidArgument, ResourceExhausted
from qil_client.results import ResultBuilder
from qil_worker.engine.samples import sample_seed
from service_fixtures import start_server, wait_until

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
SEEDED = dict(temperature=1.0, top_k=40, seed=2024)


def _check_sequence(events) -> None:
    """Gap-free seq over all samples; each sample ends once; only the last event ends the request."""
    seq = 0
    ended = []
    for ev in events:
        assert ev.seq == seq
        seq += len(ev.token_ids)
        if ev.sample_finished:
            ended.append(ev.sample_index)
        assert ev.finished == (ev is events[-1])
    assert sorted(ended) == list(range(len(ended))) and events[-1].sample_finished


def _events_until_finished(session) -> list:
    out = []
    for resp in session:
        if resp.WhichOneof("frame") == "event":
            out.append(resp.event)
            if resp.event.finished:
                return out
    raise AssertionError("the stream ended before the request")


def test_generate_with_three_samples_equals_three_single_requests(server):
    with Client(server.target, timeout=60) as c:
        events = list(c.stream(PROMPT, max_new_tokens=12, n=3, **SEEDED))
        _check_sequence(events)
        assert {ev.sample_index for ev in events} == {0, 1, 2}
        builder = ResultBuilder()
        for ev in events:
            builder.add(ev)
        result = builder.result()
        assert [s.sample_index for s in result.samples] == [0, 1, 2]
        assert result.token_ids == result.samples[0].token_ids
        singles = [
            c.generate(PROMPT, max_new_tokens=12, **{**SEEDED, "seed": sample_seed(SEEDED["seed"], i)})
            for i in range(3)
        ]
        assert [s.token_ids for s in result.samples] == [r.token_ids for r in singles]
        assert len({tuple(r.token_ids) for r in singles}) == 3, "the samples were meant to differ"
        for s in result.samples:
            assert s.finish_reason in ("stop", "length") and s.num_output_tokens == len(s.token_ids)
            assert s.num_prompt_tokens == len(PROMPT)
        # the convenience call groups the samples the same way
        again = c.generate(PROMPT, max_new_tokens=12, n=3, **SEEDED)
        assert [s.token_ids for s in again.samples] == [s.token_ids for s in result.samples]
        assert c.info().pages.used == 0


def test_stream_events_and_a_late_subscriber_replay_every_sample(server):
    with Client(server.target, timeout=60) as c:
        with c.session() as session:
            session.submit(PROMPT, max_new_tokens=10, n=3, request_id="samples-late", ignore_eos=True, **SEEDED)
            events = _events_until_finished(session)
        _check_sequence(events)
        by_sample = {i: [t for ev in events if ev.sample_index == i for t in ev.token_ids] for i in range(3)}
        assert all(len(tokens) == 10 for tokens in by_sample.values())
        replay = list(c.events("samples-late"))
        _check_sequence(replay)
        assert {i: [t for ev in replay if ev.sample_index == i for t in ev.token_ids] for i in range(3)} == by_sample
        # from the middle: exactly the tokens produced from there on, each sample's end once
        log = [(ev.sample_index, t) for ev in events for t in ev.token_ids]
        middle = 13
        tail = list(c.events("samples-late", from_seq=middle))
        assert [(ev.sample_index, t) for ev in tail for t in ev.token_ids] == log[middle:]
        assert sorted(ev.sample_index for ev in tail if ev.sample_finished) == [0, 1, 2]
        assert tail[-1].finished and sum(ev.finished for ev in tail) == 1
        assert c.result("samples-late").samples[2].token_ids == by_sample[2]


def test_cancel_ends_every_sample_and_frees_all_pages(server):
    with Client(server.target, timeout=60) as c:
        # (3 x the pages of 2500 tokens fit the 512 pages; n x 6000 would not: INVALID_ARGUMENT)
        rid = c.submit(PROMPT, max_new_tokens=2500, n=3, ignore_eos=True, **SEEDED)
        wait_until(lambda: c.info().num_running == 3)
        assert c.cancel(rid) == {rid: True}
        result = c.result(rid)
        assert [s.finish_reason for s in result.samples] == ["cancelled"] * 3
        info = c.info()
        assert info.pages.used == 0 and info.num_unfinished == 0 and info.num_running == 0


def test_invalid_n_names_the_field(server):
    with Client(server.target, timeout=30) as c:
        for n in (0, 65, 49):  # 49: more than this server's max_active (48)
            with pytest.raises(InvalidArgument) as err:
                c.generate(PROMPT, max_new_tokens=4, n=n)
            assert err.value.field == "n", n


def test_max_queued_counts_a_request_of_several_samples_once(model_dir):
    engine = dict(num_pages=1024, page_size=16, token_budget=128, prefill_chunk=64, max_active=4)
    with start_server(model_dir, engine=engine, max_queued=1) as srv, Client(srv.target, timeout=60) as c:
        # 5 requests of 3 samples each: 15 sequences, but 5 requests is what max_queued counts
        admitted = [c.submit(PROMPT + [i], max_new_tokens=5000, n=3, ignore_eos=True) for i in range(5)]
        with pytest.raises(ResourceExhausted):
            c.submit(PROMPT, max_new_tokens=2)
        assert c.info().num_unfinished == 5
        assert all(c.cancel(*admitted).values())
        info = c.info()
        assert info.num_unfinished == 0 and info.pages.used == 0
        assert c.generate(PROMPT, max_new_tokens=2, n=2).samples[1].finish_reason == "length"


def test_the_client_cli_prints_every_sample(server, capsys):
    import json

    from qil_client.__main__ import main

    argv = ["--target", server.target, "generate", "--token-ids", json.dumps(PROMPT), "--max-new-tokens", "5",
            "--n", "3", "--ignore-eos", "--temperature", "1", "--seed", "7"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for i in (1, 2):
        assert f"--- sample {i} ---" in out
    assert sum(line.startswith("request ") and " sample " in line for line in out.splitlines()) == 3
    assert main(argv + ["--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {e["sample_index"] for e in events} == {0, 1, 2}
    assert sum(e["sample_finished"] for e in events) == 3 and events[-1]["finished"]
    assert sum(len(e["token_ids"]) for e in events) == 15


def test_the_async_client_groups_the_samples(server):
    import asyncio

    from qil_client import AsyncClient

    async def run():
        async with AsyncClient(server.target, timeout=60) as c:
            return await c.generate(PROMPT, max_new_tokens=4, n=2, ignore_eos=True, **SEEDED)

    result = asyncio.run(run())
    with Client(server.target, timeout=60) as c:
        sync = c.generate(PROMPT, max_new_tokens=4, n=2, ignore_eos=True, **SEEDED)
    assert [s.token_ids for s in result.samples] == [s.token_ids for s in sync.samples]
    assert all(len(s.token_ids) == 4 for s in result.samples)


def _record(reason, output):
    from qil_worker.service.protocol import FinalRecord, RequestTimings

    return FinalRecord(reason, None, 2, output, 0, None, RequestTimings(0.1, 0.2, 0.0, 0.0, 0.3, 0))


def _drain(req, cursor):
    from qil_worker.service.front.streams import ends_before, next_event

    events, seen = [], ends_before(req, cursor)
    while True:
        ev, cursor, seen, done = next_event(req, cursor, seen)
        if ev is None:
            return events
        events.append((ev.seq, ev.sample_index, list(ev.token_ids), ev.sample_finished, ev.finished))
        if done:
            return events


def test_the_front_log_keeps_the_samples_apart_and_their_ends_in_place():
    from qil_worker.service.front.request_log import FrontRequest
    from qil_worker.service.protocol import FinishReason as R

    req = FrontRequest("r", prompt_len=2, n=3)
    for token, sample in ((10, 0), (20, 1), (30, 2), (11, 0)):
        req.append(token, None, None, None, sample=sample)
    req.append(21, None, None, None, _record(R.STOP, 2), sample=1)  # an end with its token
    req.append(-1, None, None, None, _record(R.CANCELLED, 1), sample=2)  # an end without one
    assert req.final is None and _drain(req, 0)[-1] == (5, 2, [], True, False)
    req.append(12, None, None, None, _record(R.LENGTH, 3), sample=0)
    assert req.final is not None and req.final.reason is R.LENGTH  # the last sample's end
    assert _drain(req, 0) == [
        (0, 0, [10], False, False), (1, 1, [20], False, False), (2, 2, [30], False, False),
        (3, 0, [11], False, False), (4, 1, [21], True, False), (5, 2, [], True, False),
        (5, 0, [12], True, True),
    ]
    # from the middle: the tokens from there on, and the ends at or after it
    assert _drain(req, 5) == [(5, 1, [], True, False), (5, 2, [], True, False), (5, 0, [12], True, True)]
    assert _drain(req, 6) == [(6, 0, [], True, True)]
    # an error in the front ends every sample that has not ended
    lost = FrontRequest("l", prompt_len=2, n=2)
    lost.append(7, None, None, None, sample=1)
    lost.lose("worker died")
    assert [(e.sample, e.record.num_output_tokens, e.record.reason) for e in lost.ends] == [
        (0, 0, R.ERROR), (1, 1, R.ERROR)
    ]
    assert _drain(lost, 0) == [(0, 1, [7], False, False), (1, 0, [], True, False), (1, 1, [], True, True)]
