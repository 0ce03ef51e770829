"""The HTTP front against slow and idle clients (``qil_worker.service.front.http.connections``): a
request head trickled in is cut off after the header timeout while other clients are served,
connections over the cap are answered 503 and closed, an idle kept-alive connection is closed
after the keep-alive timeout, and the loop's accept-error log line is rate-limited.

One real server (front in a thread, worker process) with a small cap and short timeouts; raw
sockets play the slow clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from qil_worker.service.cli import add_serve_parser, config_from_args
from qil_worker.service.front.http.connections import ACCEPT_ERROR, AcceptErrorLog, connection_cap, limit_accept_log
from service_fixtures import http_base_url, start_http_server, wait_until

PROMPT = [3, 4, 5, 6]
CAP = 8
HEADER_S = 1.5
KEEPALIVE_S = 3.0  # longer than HEADER_S: which timer closed a connection shows in its time
SLACK_S = 3.0  # how much later than its timeout a connection may be seen closed
EARLY_S = 0.1  # timers are the loop's: one may fire this much before its time, no more
TRICKLE_S = 0.25  # the slow clients' pace (the attack's, not a wait for the server)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_http_server(model_dir, http_max_connections=CAP, http_header_timeout=HEADER_S,
                            http_keepalive_timeout=KEEPALIVE_S)
    yield srv
    srv.stop()


@pytest.fixture
def srv(server):
    """The server once the previous test's connections have closed."""
    wait_until(lambda: server.server.http.connections.open == 0, timeout=KEEPALIVE_S + SLACK_S)
    return server


def _conns(srv):
    return srv.server.http.connections


def _snapshot(srv) -> tuple[int, int, int]:
    """(open, rejected, header_timeouts), read together on the server's loop."""
    async def read() -> tuple[int, int, int]:
        c = _conns(srv)
        return c.open, c.rejected, c.header_timeouts

    return srv.call(read())


def _connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.http_port), timeout=10)


def _read_to_close(sock: socket.socket, deadline: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes ``sock`` (EOF or reset), and the monotonic
    time that was seen at; fails if it is still open at ``deadline`` (monotonic; one past
    already still gets a last look)."""
    got = b""
    try:
        while True:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            data = sock.recv(65536)
            if not data:
                break
            got += data
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open {deadline - time.monotonic():+.1f}s after the deadline") from None
    return got, time.monotonic()


def _read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response (head, body by Content-Length) off a kept-alive connection."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    assert len(body) == length, "more than one response"
    return head, body


class Trickle:
    """Sends ``data`` a byte every TRICKLE_S from a thread, until the socket fails (the server
    closed it) or ``stop``; ``sent`` counts the bytes that went out."""

    def __init__(self, sock: socket.socket, data: bytes) -> None:
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock, data), daemon=True)
        self._thread.start()

    def _run(self, sock: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            if self._stop.wait(TRICKLE_S):
                return
            try:
                sock.send(data[i:i + 1])
            except OSError:
                return
            self.sent += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


HEADERS_REST = b"st: x\r\nX-Padding: " + b"a" * 200 + b"\r\n\r\n"


def test_a_client_trickling_its_headers_is_closed_while_others_are_served(srv):
    _, _, timeouts = _snapshot(srv)
    start = time.monotonic()
    slow = _connect(srv)
    with slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nHo")
        trickle = Trickle(slow, HEADERS_REST)
        try:
            wait_until(lambda: _snapshot(srv)[0] == 1)  # held while the others come
            with httpx.Client(timeout=30) as c:
                assert c.get(f"http://127.0.0.1:{srv.http_port}/health").text == "ok\n"
                resp = c.post(f"{http_base_url(srv)}/completions", json={"prompt": PROMPT, "max_tokens": 2})
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 2
            got, closed = _read_to_close(slow, start + HEADER_S + SLACK_S)
        finally:
            trickle.stop()
    assert got == b""  # closed unanswered: its request never was complete
    assert closed - start >= HEADER_S - EARLY_S
    assert 2 <= trickle.sent < len(HEADERS_REST)  # the bytes it kept sending did not extend its time
    wait_until(lambda: _snapshot(srv)[2] == timeouts + 1)


def test_the_cap_holds_under_twice_as_many_idle_connections(srv):
    _, rejected, timeouts = _snapshot(srv)
    start = time.monotonic()
    socks = [_connect(srv) for _ in range(2 * CAP)]
    try:
        wait_until(lambda: _snapshot(srv)[1] == rejected + CAP)
        held, _, now_timeouts = _snapshot(srv)
        # the held ones, and those of them already timed out (on a slow host), make the cap
        assert held <= CAP and held + (now_timeouts - timeouts) == CAP
        answers = [_read_to_close(s, start + HEADER_S + SLACK_S)[0] for s in socks]
    finally:
        for s in socks:
            s.close()
    refused = [a for a in answers if a]
    assert len(refused) == CAP and answers.count(b"") == CAP  # the held ones: closed unanswered
    for answer in refused:
        head = answer.split(b"\r\n\r\n", 1)[0].decode().lower()
        assert head.startswith("http/1.1 503 ")
        assert "connection: close" in head and "retry-after: 1" in head
        assert b'"service_unavailable"' in answer
    wait_until(lambda: _snapshot(srv)[0] == 0)
    _, now_rejected, now_timeouts = _snapshot(srv)
    assert now_timeouts == timeouts + CAP and now_rejected == rejected + CAP
    with httpx.Client(timeout=30) as c:  # served again
        assert c.get(f"http://127.0.0.1:{srv.http_port}/health").text == "ok\n"


def test_an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout(srv):
    _, _, timeouts = _snapshot(srv)
    with _connect(srv) as sock:
        for _ in range(2):  # kept alive between the two
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head, body = _read_response(sock)
            assert head.startswith(b"HTTP/1.1 200") and body == b"ok\n"
        answered = time.monotonic()
        got, closed = _read_to_close(sock, answered + KEEPALIVE_S + SLACK_S)
    assert got == b""
    assert closed - answered >= KEEPALIVE_S - EARLY_S  # not the header timer's (HEADER_S)
    assert _snapshot(srv)[2] == timeouts


def test_a_pooled_connection_the_server_closed_is_not_reused(srv):
    """The keep-alive close is a close the client sees (its FIN), not a socket left half
    open: a client that would keep the connection longer than the server (httpx's expiry
    set past KEEPALIVE_S) finds it closed and connects anew; no request is lost to it."""
    opened = []
    transport = httpx.HTTPTransport(limits=httpx.Limits(keepalive_expiry=10 * KEEPALIVE_S))
    hooks = {"request": [lambda request: opened.append(_conns(srv).open)]}
    with httpx.Client(base_url=f"http://127.0.0.1:{srv.http_port}", transport=transport, timeout=30,
                      event_hooks=hooks) as client:
        assert client.get("/health").status_code == 200
        wait_until(lambda: _conns(srv).open == 0, timeout=KEEPALIVE_S + SLACK_S)  # the server closed it
        assert client.get("/health").status_code == 200
        assert client.get("/health").status_code == 200  # and the new one is kept alive
    assert opened[1:] == [0, 1]


def test_a_kept_alive_connection_trickling_its_next_head_is_closed(srv):
    _, _, timeouts = _snapshot(srv)
    with _connect(srv) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        _read_response(sock)
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # the header timer starts here
        trickle = Trickle(sock, HEADERS_REST)
        try:
            got, closed = _read_to_close(sock, start + HEADER_S + SLACK_S)
        finally:
            trickle.stop()
    assert got == b"" and trickle.sent >= 2
    assert closed - start >= HEADER_S - EARLY_S
    wait_until(lambda: _snapshot(srv)[2] == timeouts + 1)  # the header timer's, not keep-alive's


def test_a_request_in_its_handler_outlives_the_header_timeout(srv):
    """The header timer ends with the head: a body trickled in for longer (it has the call's
    BODY_TIMEOUT_S) is answered."""
    _, _, timeouts = _snapshot(srv)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2}).encode()
    slow_part = int(HEADER_S / TRICKLE_S) + 2  # bytes: more than the header timeout's worth
    with _connect(srv) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        start = time.monotonic()
        trickle = Trickle(sock, body[:slow_part])
        try:
            wait_until(lambda: trickle.sent == slow_part, timeout=30)
        finally:
            trickle.stop()
        assert time.monotonic() - start > HEADER_S
        sock.sendall(body[slow_part:])
        head, answer = _read_response(sock)
    assert head.startswith(b"HTTP/1.1 200"), head + answer
    assert json.loads(answer)["usage"]["completion_tokens"] == 2
    assert _snapshot(srv)[2] == timeouts


def test_the_accept_log_limit_is_on_the_servers_loop(srv):
    async def handler():
        return asyncio.get_running_loop().get_exception_handler()

    assert isinstance(srv.call(handler()), AcceptErrorLog)


def test_accept_errors_pass_once_per_interval_with_a_count():
    passed: list[dict] = []
    clock = [100.0]
    limit = AcceptErrorLog(lambda loop, ctx: passed.append(ctx), interval_s=10.0, clock=lambda: clock[0])
    accept = {"message": ACCEPT_ERROR, "exception": OSError(24, "Too many open files")}
    for _ in range(100):
        limit(None, accept)
    assert passed == [accept] and limit.suppressed == 99
    other = {"message": "Task exception was never retrieved"}
    limit(None, other)
    assert passed[-1] is other  # everything else passes, limited or not
    clock[0] += 9.9
    limit(None, accept)
    assert len(passed) == 2 and limit.suppressed == 100
    clock[0] += 0.1
    limit(None, accept)
    assert len(passed) == 3 and "100 more" in passed[-1]["message"]
    assert passed[-1]["exception"] is accept["exception"] and limit.suppressed == 0


def test_limit_accept_log_passes_to_the_handler_it_replaces_and_puts_it_back():
    loop = asyncio.new_event_loop()
    try:
        seen: list[dict] = []

        def previous(loop, ctx):
            seen.append(ctx)

        loop.set_exception_handler(previous)
        restore = limit_accept_log(loop)
        for _ in range(100):
            loop.call_exception_handler({"message": ACCEPT_ERROR})
        loop.call_exception_handler({"message": "something else"})
        assert [c["message"] for c in seen] == [ACCEPT_ERROR, "something else"]
        restore()
        assert loop.get_exception_handler() is previous
    finally:
        loop.close()


def test_the_cap_stays_under_the_descriptor_limit():
    resource = pytest.importorskip("resource")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(1) == 1
    if soft != resource.RLIM_INFINITY:
        # half of what one accept batch (the listen backlog) leaves
        assert connection_cap(10**9, backlog=100) == (soft - 100) // 2


def test_serve_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--http-port", "0", "--http-max-connections", "5",
                              "--http-header-timeout", "2.5", "--http-keepalive-timeout", "4"])
    cfg = config_from_args(args)
    assert (cfg.http_max_connections, cfg.http_header_timeout, cfg.http_keepalive_timeout) == (5, 2.5, 4.0)
    for flag in ("--http-max-connections", "--http-header-timeout", "--http-keepalive-timeout"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", flag, "0"])
