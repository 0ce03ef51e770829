"""``python -m qil_worker serve --http-port``: the flags, the announcement, a port in use, and
a SIGTERM that lets an HTTP stream in flight finish (the drain covers both fronts)."""

from __future__ import annotations

import json
import signal
import socket

import httpx
import pytest

from qil_worker.service.front.front import FrontConfig
from qil_worker.service.protocol import WorkerConfig
from qil_worker.service.front.server import ServeConfig, ServerThread
from service_fixtures import serve_process, stop_server_process, wait_until

PROMPT = [3, 4, 5, 6]


def test_serve_flags_and_graceful_drain_of_an_http_stream(model_dir):
    proc, target, err = serve_process("--model", str(model_dir), "--http-port", "0",
                                      "--served-model-name", "svc", "--grace-seconds", "60")
    try:
        http = proc.announcement.split("(HTTP on ", 1)[1].split(")")[0]
        assert http.startswith("127.0.0.1:") and http != target
        base = f"http://{http}/v1"
        assert httpx.get(f"{base}/models").json()["data"][0]["id"] == "svc"
        body = {"model": "svc", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", f"{base}/completions", json=body, timeout=120) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(signal.SIGTERM)
            # draining: /health says so, and a new call is refused, while this stream goes on
            health = f"http://{http}/health"
            wait_until(lambda: httpx.get(health).status_code == 503, timeout=30)
            refused = httpx.post(f"{base}/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "length"  # finished, not cut off
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            stop_server_process(proc)


def test_http_port_in_use_fails_the_start(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = ServeConfig(host="127.0.0.1", port=0, http_port=port,
                          front=FrontConfig(worker=WorkerConfig(model=str(model_dir), threads=1)))
        with pytest.raises(OSError, match="HTTP"):
            ServerThread(cfg).start()
