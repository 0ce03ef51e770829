"""Usage on every final event: prompt tokens, cached prompt tokens and output tokens, however a
request ends (STOP, LENGTH, CANCELLED, ERROR, and ERROR for a request lost with its worker), as
the clients expose them (``Result.usage``)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from qil_client import AsyncClient, Client, Unavailable, Usage, pb
from service_fixtures import ENGINE, start_server, wait_until

PROMPT = [(7 * i + 3) % 97 + 1 for i in range(40)]  # 2 full pages of 16 and 8 tokens
CACHED = 32  # the 2 full pages, once a request with this prompt has run


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_server(model_dir, restart_backoff_s=0.2)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with Client(server.target, timeout=60) as c:
        c.generate(PROMPT, max_new_tokens=1)  # the prompt's pages into the prefix cache
        yield c


def _usage(ev: pb.Event) -> tuple[int, int, int]:
    assert ev.finished
    return ev.num_prompt_tokens, ev.num_cached_tokens, ev.num_output_tokens


def test_length_and_stop(client):
    r = client.generate(PROMPT, max_new_tokens=3, ignore_eos=True)
    assert r.finish_reason == "length"
    assert r.usage == Usage(len(PROMPT), CACHED, 3) and r.usage.total_tokens == len(PROMPT) + 3
    stop = r.token_ids[1]
    s = client.generate(PROMPT, max_new_tokens=50, stop_token_ids=[stop])
    assert s.finish_reason == "stop" and s.token_ids[-1] == stop
    assert s.usage == Usage(len(PROMPT), CACHED, len(s.token_ids))


def test_cancelled(client):
    with client.session() as session:
        session.submit(PROMPT, max_new_tokens=6000, ignore_eos=True, request_id="usage-cancel")
        events = []
        for resp in session:
            if resp.WhichOneof("frame") != "event":
                continue
            events.append(resp.event)
            if len(events) == 1:
                session.cancel("usage-cancel")
            if resp.event.finished:
                break
    final = events[-1]
    assert final.finish_reason == pb.FINISH_REASON_CANCELLED
    assert _usage(final) == (len(PROMPT), CACHED, sum(len(e.token_ids) for e in events))
    assert final.num_output_tokens >= 1
    replay = client.result("usage-cancel")  # a late subscriber gets the same counts
    assert replay.usage == Usage(*_usage(final))


def test_worker_loss(server, client):
    pid = client.info().worker.pid
    stream = client.stream(PROMPT, max_new_tokens=6000, ignore_eos=True, request_id="usage-lost")
    first = next(stream)
    assert first.token_ids
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(Unavailable):
        for _ in stream:
            pass
    wait_until(lambda: client.health() == "SERVING", timeout=120)  # (for the next tests)
    r = client.result("usage-lost")  # replayed: its tokens and the final ERROR event
    assert r.finish_reason == "error" and "worker" in r.error
    assert r.usage == Usage(len(PROMPT), CACHED, len(r.token_ids))
    assert len(r.token_ids) >= len(first.token_ids)


def test_a_failed_step(model_dir, monkeypatch):
    """The forward fails (test-only fault injection) after the cached request made tokens."""
    from qil_worker.service.worker.startup import FAULT_FORWARD_ENV

    # forwards 1-2: the warm-up request's two tokens; 3-4: the victim's two; 5 raises
    monkeypatch.setenv(FAULT_FORWARD_ENV, "5")
    srv = start_server(model_dir)
    monkeypatch.delenv(FAULT_FORWARD_ENV)
    try:
        with Client(srv.target, timeout=60) as c:
            assert c.generate(PROMPT, max_new_tokens=2, ignore_eos=True).usage == Usage(len(PROMPT), 0, 2)
            events = list(c.stream(PROMPT, max_new_tokens=100, ignore_eos=True))
            final = events[-1]
            assert final.finish_reason == pb.FINISH_REASON_ERROR and "injected fault" in final.error
            assert _usage(final) == (len(PROMPT), CACHED, 2)
            assert sum(len(e.token_ids) for e in events) == 2
    finally:
        srv.stop()


def test_the_async_client_exposes_usage(server):
    async def run():
        async with AsyncClient(server.target, timeout=60) as c:
            await c.generate(PROMPT, max_new_tokens=1)
            return await c.generate(PROMPT, max_new_tokens=4, ignore_eos=True)

    r = asyncio.run(run())
    assert r.finish_reason == "length" and r.usage == Usage(len(PROMPT), CACHED, 4)


def test_a_result_without_its_end_has_zero_usage():
    from qil_client.results import ResultBuilder

    b = ResultBuilder("x")
    b.add(pb.Event(request_id="x", seq=0, token_ids=[1, 2]))
    assert b.result().usage == Usage(0, 0, 0)
