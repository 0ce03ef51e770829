"""The HTTP API's failures in the API's error shape (``{"error": {message, type, param,
code}}``) with the right status: 400 naming the parameter, 401, 404, 413, 429 and 503; a
client gone mid-call cancels its requests and frees their pages; /metrics on the same port.

Servers on the service test model (token ids only: no tokenizer), so this is also where a
server without a tokenizer is checked.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import openai
import pytest

from qil_client import Client
from service_fixtures import free_port, http_base_url, openai_client, start_http_server, wait_until

PROMPT = [3, 4, 5, 6]
LONG = 4000  # tokens: runs for seconds on the test model
RESTART_BACKOFF_S = 2.0


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_http_server(model_dir, restart_backoff_s=RESTART_BACKOFF_S, metrics_port=free_port())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    with openai_client(server, timeout=60) as c:
        yield c


def _post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{http_base_url(server)}{path}", json=body, timeout=60, **kw)


def _error(resp: httpx.Response, status: int, param: str | None, kind: str = "invalid_request_error") -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == kind and err["param"] == param, err
    assert err["message"]
    if param is not None:  # SDKs show only the message: it names the parameter too
        assert err["message"].startswith(f"{param}: "), err
    return err["message"]


def _idle(server) -> bool:
    with Client(server.target, timeout=10) as c:
        info = c.info()
    return info.num_unfinished == 0 and info.pages.used == 0


def test_token_id_prompts_without_a_tokenizer(oai, server):
    out = oai.completions.create(model=server.server.http.ctx.model_name, prompt=PROMPT, max_tokens=4,
                                 temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "" and out.usage.completion_tokens == 4
    resp = _post(server, "/completions", {"prompt": "text needs a tokenizer", "max_tokens": 2})
    _error(resp, 400, "prompt")
    lp = oai.completions.create(prompt=PROMPT, model=out.model, max_tokens=2, logprobs=1, temperature=0)
    assert lp.choices[0].logprobs.tokens[0].startswith("token_id:")


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "max_tokens": -1}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 10**9}, "max_tokens"),
    ({"prompt": PROMPT, "min_tokens": -1}, "min_tokens"),
    ({"prompt": PROMPT, "logprobs": 99}, "logprobs"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "n": 1000}, "n"),
    ({"prompt": PROMPT, "best_of": 3}, "best_of"),
    ({"prompt": PROMPT, "stop": [""]}, "stop"),
    ({"prompt": PROMPT, "stop": 5}, "stop"),
    ({"prompt": PROMPT, "stop_token_ids": ["x"]}, "stop_token_ids"),
    ({"prompt": PROMPT, "seed": -1}, "seed"),
    ({"prompt": PROMPT, "suffix": "tail"}, "suffix"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": PROMPT, "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": PROMPT, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "logit_bias": {"x": 10}}, "logit_bias"),
    ({"prompt": PROMPT, "guided_regex": 5}, "guided_regex"),
    ({"prompt": PROMPT, "guided_choice": []}, "guided_choice"),
    ({"prompt": PROMPT, "guided_choice": ["yes", ""]}, "guided_choice"),
    ({"prompt": PROMPT, "guided_json": 5}, "guided_json"),
    ({"prompt": PROMPT, "guided_json": "{not json"}, "guided_json"),
    ({"prompt": PROMPT, "guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": [[1, 2], "mixed"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({}, "prompt"),
])
def test_completions_400_names_the_parameter(server, body, param):
    _error(_post(server, "/completions", body), 400, param)


@pytest.mark.parametrize("body, param", [
    ({}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                                                                            "json_schema": {"schema": 5}}},
     "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"},
      "guided_regex": "a+"}, "guided_regex"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": "no"}},
     "chat_template_kwargs"),
])
def test_chat_400_names_the_parameter(server, body, param):
    _error(_post(server, "/chat/completions", body), 400, param)


def test_chat_without_a_tokenizer_is_400(server):
    msg = _error(_post(server, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2}), 400, "messages")
    assert "tokenizer" in msg


def test_no_tokenizer_routes_without_a_tokenizer(server):
    root = f"http://127.0.0.1:{server.http_port}"
    assert httpx.get(f"{root}/tokenizer_info", timeout=30).status_code == 404
    _error(httpx.post(f"{root}/tokenize", json={"prompt": "x"}, timeout=30), 400, "prompt")
    _error(httpx.post(f"{root}/detokenize", json={"tokens": [1, 2]}, timeout=30), 400, "tokens")


def test_body_that_is_not_json_or_too_large(server):
    resp = httpx.post(f"{http_base_url(server)}/completions", content=b"{nope", timeout=60)
    _error(resp, 400, "body")
    _error(_post(server, "/completions", [1, 2]), 400, "body")
    big = b'{"prompt": "' + b"x" * (16 * 1024 * 1024 + 1) + b'"}'
    resp = httpx.post(f"{http_base_url(server)}/completions", content=big, timeout=60)
    _error(resp, 413, None)


def test_unknown_model_route_and_method(oai, server):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")
    _error(httpx.get(f"{http_base_url(server)}/nothing-here"), 404, None)
    _error(httpx.get(f"{http_base_url(server)}/completions"), 405, None)


def test_metrics_on_the_same_port(oai, server):
    _post(server, "/completions", {"prompt": PROMPT, "max_tokens": 2})
    resp = httpx.get(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10)
    assert resp.status_code == 200
    assert "qil_requests_finished_total" in resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    # what an inference gateway's endpoint picker scrapes from the port it routes to
    for gauge in ("qil_requests_waiting ", "qil_requests_running ", "qil_kv_cache_usage_ratio ",
                  "qil_cache_config_info{"):
        assert f"\n{gauge}" in resp.text, gauge


def test_disconnect_mid_stream_cancels_and_frees_the_pages(server):
    wait_until(lambda: _idle(server), timeout=30)
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{http_base_url(server)}/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        with Client(server.target, timeout=10) as c:
            assert c.info().num_unfinished == 1
    # the response is closed unread: the server sees the disconnect
    wait_until(lambda: _idle(server), timeout=30)
    with Client(server.target, timeout=10) as c:
        assert c.info().pages.used == 0


def test_disconnect_while_waiting_cancels_a_non_streaming_call(server):
    wait_until(lambda: _idle(server), timeout=30)
    client = httpx.Client(timeout=60)
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    failed = []

    def call():
        try:
            client.post(f"{http_base_url(server)}/completions", json=body)
        except httpx.HTTPError as exc:
            failed.append(exc)

    t = threading.Thread(target=call)
    t.start()
    front = server.server.front
    wait_until(lambda: front.num_unfinished == 1 and front.stats.pages_used > 0, timeout=30)
    client.close()  # closes the connection under the waiting call
    t.join(30)
    wait_until(lambda: _idle(server), timeout=30)


def test_worker_down_is_503_and_health_follows(server):
    front = server.server.front
    pid = front.worker_pid
    os.kill(pid, signal.SIGKILL)
    # the module's server waits RESTART_BACKOFF_S before it restarts the worker: the window
    # below is that long
    wait_until(lambda: front.state.name != "READY", timeout=30)
    base = f"http://127.0.0.1:{server.http_port}"
    _error(_post(server, "/completions", {"prompt": PROMPT, "max_tokens": 2}), 503, None, "service_unavailable")
    assert httpx.get(f"{base}/health").status_code == 503
    wait_until(lambda: httpx.get(f"{base}/health").status_code == 200, timeout=60, interval=0.1)
    assert front.worker_pid != pid
    assert _post(server, "/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_worker_lost_mid_stream_ends_with_an_error_event(model_dir):
    with start_http_server(model_dir, restart_backoff_s=0.2) as srv:
        body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{http_base_url(srv)}/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(srv.server.front.worker_pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert rest[-2].startswith('data: {"error":') and '"service_unavailable"' in rest[-2]
        health = f"http://127.0.0.1:{srv.http_port}/health"
        wait_until(lambda: httpx.get(health).status_code == 200, timeout=60, interval=0.1)


def test_health_is_503_until_serving(model_dir):
    from qil_worker.service.front.front import FrontConfig
    from qil_worker.service.protocol import WorkerConfig
    from qil_worker.service.front.server import ServeConfig, ServerThread

    port = free_port()
    cfg = ServeConfig(host="127.0.0.1", port=0, http_port=port,
                      front=FrontConfig(worker=WorkerConfig(model=str(model_dir), threads=1)))
    srv = ServerThread(cfg)
    t = threading.Thread(target=srv.start)
    t.start()
    seen = set()

    def answered():
        try:
            seen.add(httpx.get(f"http://127.0.0.1:{port}/health").status_code)
        except httpx.HTTPError:
            return False
        return 200 in seen

    try:
        wait_until(answered, timeout=120, interval=0.01)
    finally:
        t.join(120)
        srv.stop()
    assert seen <= {200, 503}


def test_max_queued_is_429(model_dir):
    engine = dict(num_pages=512, page_size=16, token_budget=256, prefill_chunk=64, max_active=1)
    with start_http_server(model_dir, engine=engine, max_queued=0) as srv:
        body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{http_base_url(srv)}/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()  # (kept: a dropped iterator closes the response)
            assert next(lines).startswith("data: {")
            with openai_client(srv, api_key="x") as oai:
                with pytest.raises(openai.RateLimitError) as exc:
                    oai.completions.create(model=srv.server.http.ctx.model_name, prompt=PROMPT, max_tokens=2)
            assert exc.value.body["type"] == "rate_limit_error"


def test_auth(model_dir):
    with start_http_server(model_dir, auth_token="s3cret") as srv:
        url = f"{http_base_url(srv)}/completions"
        body = {"prompt": PROMPT, "max_tokens": 2}
        name = srv.server.http.ctx.model_name
        with openai_client(srv, api_key="s3cret") as good:
            assert good.completions.create(model=name, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
            assert [m.id for m in good.models.list().data] == [name]
        with openai_client(srv, api_key="wrong") as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=name, prompt=PROMPT, max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        unauthenticated = httpx.post(url, json=body)
        _error(unauthenticated, 401, None, "authentication_error")
        assert unauthenticated.headers["WWW-Authenticate"].startswith("Bearer")  # RFC 6750
        _error(httpx.post(url, json=body, headers={"Authorization": "Basic s3cret"}), 401, None,
               "authentication_error")
        _error(httpx.post(url, json=body, headers={"Authorization": "Bearer s3cre"}), 401, None,
               "authentication_error")
        two = httpx.Headers([("Authorization", "Bearer s3cret"), ("Authorization", "Bearer s3cret")])
        _error(httpx.post(url, json=body, headers=two), 401, None, "authentication_error")
        assert httpx.post(url, json=body, headers={"Authorization": "bEaReR s3cret"}).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{srv.http_port}/health").status_code == 200


def test_a_reader_that_stops_reading_is_cut_off_and_its_pages_freed(model_dir):
    """The gRPC streams' rule: more than --max-stream-backlog tokens unwritten while a write is
    stuck for a second ends the call and cancels its request."""
    import socket

    with start_http_server(model_dir, max_stream_backlog=16) as srv:
        front = srv.server.front
        # logprobs: big chunks, so that the socket buffers (megabytes on loopback) fill early
        body = json.dumps({"prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True, "stream": True,
                           "logprobs": 20}).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connecting: a small window
            sock.connect(("127.0.0.1", srv.http_port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            wait_until(lambda: front.num_unfinished == 1, timeout=30)
            (rid,) = front.requests.unfinished_ids()
            # never read: the request is cancelled once the server's writes are stuck
            wait_until(lambda: front.num_unfinished == 0, timeout=120, interval=0.05)
            req = front.find(rid)
            assert req.final.reason.name == "CANCELLED" and len(req.tokens) < 8000
        wait_until(lambda: front.stats.pages_used == 0, timeout=30)
