"""The client against a real server: sessions end gRPC's request thread, ``events --from-seq``,
one clean error line for bad targets and TLS files, timeouts, and AsyncClient's parity with Client."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qil_client import AsyncClient, Client, DeadlineExceeded, NotFound, Unavailable
from service_fixtures import wait_until

ROOT = Path(__file__).resolve().parents[2]
LONG = 6000  # tokens: as many steps in a row, so a tiny model still runs when the session is left


def _client_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m qil_client ARGS`` run from the worktree root, as a user would."""
    return subprocess.run([sys.executable, "-m", "qil_client", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def _read_to_first_event(session, finished: bool = False) -> None:
    for resp in session:
        if resp.WhichOneof("frame") == "event" and (resp.event.finished or not finished):
            return


def test_leaving_or_aborting_a_session_ends_grpcs_request_thread(client):
    client.generate([1, 2], max_new_tokens=1)  # the channel's own threads start on first use
    before = threading.active_count()
    for i in range(4):
        with client.session() as s:
            s.submit([1, 2, 3], max_new_tokens=2, request_id=f"thr-with-{i}")
            _read_to_first_event(s, finished=True)
    s = client.session()
    s.submit([1, 1, 1], max_new_tokens=LONG, request_id="thr-abort")
    _read_to_first_event(s)
    s.abort()
    assert client.result("thr-abort", timeout=30).finish_reason == "cancelled"
    wait_until(lambda: threading.active_count() <= before, timeout=5)


def test_a_session_the_server_ends_frees_its_request_thread(client):
    client.generate([1, 2], max_new_tokens=1)
    before = threading.active_count()
    s = client.session(timeout=0.5)  # neither closed nor aborted: its deadline ends it
    s.submit([3, 3, 3], max_new_tokens=LONG, request_id="thr-deadline")
    with pytest.raises(DeadlineExceeded):
        for _ in s:
            pass
    assert client.result("thr-deadline", timeout=30).finish_reason == "cancelled"
    wait_until(lambda: threading.active_count() <= before, timeout=5)


def test_cli_events_from_a_later_seq(server, client):
    want = client.generate([1, 2, 3], max_new_tokens=8, request_id="cli-from-seq").token_ids
    out = _client_cli("--target", server.target, "events", "cli-from-seq", "--from-seq", "3")
    assert out.returncode == 0, out.stderr
    tokens, summary = out.stdout.strip().splitlines()
    assert [int(t) for t in tokens.split()] == want[3:]
    assert "request cli-from-seq: 8 tokens, finish=length" in summary


@pytest.mark.parametrize("args", [
    ["--target", "nonexistent.invalid:1,other.invalid:2"],
    ["--target", "127.0.0.1:1,127.0.0.1"],
    ["--tls-ca", "/nonexistent.pem"],
])
def test_cli_bad_target_or_tls_file_is_one_error_line(args):
    out = _client_cli(*args, "health")
    assert out.returncode == 2 and out.stdout == ""
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("error: ")


def test_async_client_wait_ready_and_async_with_session(server):
    async def run() -> None:
        async with AsyncClient(server.target, timeout=60) as ac:
            await ac.wait_ready(30)
            async with ac.session() as s:
                s.submit([2, 2, 2], max_new_tokens=LONG, request_id="aio-with")
                async for resp in s:
                    if resp.WhichOneof("frame") == "event":
                        break
            # leaving the block aborts the session: the server cancels its requests
            assert (await ac.result("aio-with")).finish_reason == "cancelled"
        async with AsyncClient("127.0.0.1:1") as down:  # nothing listens there
            with pytest.raises(TimeoutError):
                await down.wait_ready(0.5)

    asyncio.run(run())


def test_client_wait_ready_returns_when_serving_and_times_out_when_nothing_listens(server):
    with Client(server.target, timeout=60) as c:
        c.wait_ready(30)  # returns: the server is SERVING
        assert c.health() == "SERVING"
    with Client("127.0.0.1:1") as down:  # nothing listens there
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="last error: UNAVAILABLE") as exc:
            down.wait_ready(0.5)
        assert time.monotonic() - t0 < 10  # gives up near its timeout, not the health call's 5 s
        assert isinstance(exc.value.__cause__, Unavailable)  # the cause, not only "not in time"


@pytest.fixture
def refused_target():
    """A port bound but never listening: connections to it are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def not_serving(server):
    """The module's server reporting NOT_SERVING, as while it loads its model."""
    server.call(server.server.health.set_serving(False))
    try:
        yield server
    finally:
        server.call(server.server.health.set_serving(True))


def test_a_refused_connection_ends_the_wait_at_once_with_its_cause(refused_target):
    t0 = time.monotonic()
    out = _client_cli("--target", refused_target, "generate", "--token-ids", "[1]")  # waits 30 s at most
    assert out.returncode == 1 and out.stdout == ""
    (line,) = out.stderr.splitlines()
    assert line.startswith("error: UNAVAILABLE: ") and "connection refused" in line.lower(), line
    assert time.monotonic() - t0 < 20
    with Client(refused_target) as c:
        with pytest.raises(Unavailable, match="(?i)connection refused"):
            c.wait_ready(30, fail_when_refused=True)

    async def run() -> None:
        async with AsyncClient(refused_target) as ac:
            with pytest.raises(Unavailable, match="(?i)connection refused"):
                await ac.wait_ready(30, fail_when_refused=True)

    asyncio.run(run())
    assert time.monotonic() - t0 < 30


def test_a_wait_that_runs_out_names_the_last_status(not_serving):
    with Client(not_serving.target) as c:
        with pytest.raises(TimeoutError, match=r"not SERVING within 0.5 s \(last status: NOT_SERVING\)"):
            c.wait_ready(0.5, fail_when_refused=True)
    out = _client_cli("--target", not_serving.target, "--wait-ready", "0.5", "info")
    assert out.returncode == 1 and "last status: NOT_SERVING" in out.stderr, out.stderr


def test_cli_health_exits_1_unless_serving_and_waits_when_asked(server, not_serving):
    t0 = time.monotonic()
    out = _client_cli("--target", not_serving.target, "--wait-ready", "1", "health")
    assert out.returncode == 1 and out.stdout == "NOT_SERVING\n", out
    assert time.monotonic() - t0 >= 1  # it waited as asked, then said what the server says
    out = _client_cli("--target", not_serving.target, "health")  # a probe: one check
    assert out.returncode == 1 and out.stdout == "NOT_SERVING\n"


def test_closing_a_client_ends_the_sessions_it_left_open(server):
    """A session dropped without close() or abort(): gRPC's thread that sends its frames waits on
    the session's queue; closing the client ends it (and the server cancels its requests)."""
    with Client(server.target, timeout=60) as warm:
        warm.generate([1, 2], max_new_tokens=1)
        before = threading.active_count()
        c = Client(server.target, timeout=60)
        for i in range(5):
            s = c.session()
            s.submit([4, 4, i], max_new_tokens=LONG, request_id=f"dropped-{i}")
            _read_to_first_event(s)
            del s
        c.close()
        wait_until(lambda: threading.active_count() <= before, timeout=5)
        assert {warm.result(f"dropped-{i}", timeout=30).finish_reason for i in range(5)} == {"cancelled"}


def test_async_events_left_early_end_their_calls(server):
    async def run() -> None:
        async with AsyncClient(server.target, timeout=60) as ac:
            rid = await ac.submit([5, 5, 5], max_new_tokens=LONG, request_id="aio-events-early")
            await asyncio.sleep(0)  # one turn of the loop: the submit's own tasks are done
            before = len(asyncio.all_tasks())
            for _ in range(10):
                events = ac.events(rid)
                async for _ev in events:
                    break
                await events.aclose()
            deadline = time.monotonic() + 10
            while len(asyncio.all_tasks()) > before:  # no call left waiting for its status
                assert time.monotonic() < deadline, asyncio.all_tasks()
                await asyncio.sleep(0.01)
            # ... and they ended by themselves, not because the request did
            assert (await ac.info()).num_unfinished >= 1
            await ac.cancel(rid)

    asyncio.run(run())


def test_async_result_of_an_unknown_request_is_not_found(server):

    async def main():
        async with AsyncClient(server.target, timeout=30) as c:
            with pytest.raises(NotFound) as exc:
                await c.result("no-such-request")
            assert exc.value.field == "request_id"
    asyncio.run(main())


def test_async_stream_closed_early_cancels_its_request(server):

    async def main():
        async with AsyncClient(server.target, timeout=30) as c:
            agen = c.stream([1, 2, 3], max_new_tokens=6000, ignore_eos=True, request_id="aio-early")
            await agen.__anext__()
            await agen.aclose()
            for _ in range(100):
                if (await c.info()).num_unfinished == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await c.result("aio-early")).finish_reason == "cancelled"
    asyncio.run(main())


def test_a_successful_result_has_error_none(server):
    with Client(server.target, timeout=30) as c:
        assert c.generate([1, 2, 3], max_new_tokens=2).error is None


def test_result_honours_its_timeout(server):
    with Client(server.target) as c:  # no client-wide default timeout
        rid = c.submit([1, 2, 3], max_new_tokens=6000, ignore_eos=True)
        try:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                c.result(rid, timeout=0.5)
            assert time.monotonic() - t0 < 3

            async def main():
                async with AsyncClient(server.target) as ac:
                    with pytest.raises(DeadlineExceeded):
                        await ac.result(rid, timeout=0.5)
            asyncio.run(main())
        finally:
            c.cancel(rid)


def test_cli_prints_a_server_error_naming_the_field_once(server):
    out = _client_cli("--target", server.target, "generate", "--token-ids", "[]")
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    assert line.startswith("error: INVALID_ARGUMENT: token_ids: the prompt is empty"), line
    assert "(field" not in line
