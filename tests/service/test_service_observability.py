"""Operations: Prometheus metrics (``--metrics-port``), request-scoped logs, ``--log-format json``,
the worker's startup summary, and a server that runs without prometheus_client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from qil_client import Client, NotFound
from service_fixtures import free_port, join_output, scrape, serve_process, start_server, wait_until

ROOT = Path(__file__).resolve().parents[2]


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def metrics_server(model_dir):
    port = free_port()
    srv = start_server(model_dir, metrics_port=port)
    yield srv, port
    srv.stop()


def test_metrics_follow_requests_tokens_and_steps(metrics_server):
    srv, port = metrics_server
    with Client(srv.target, timeout=60) as c:
        before = scrape(port)
        assert before["qil_kv_pages_total"] == 512
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11, 12]]
        lengths = [6, 7, 8]
        results = [None] * 3

        def run(i: int) -> None:
            results[i] = c.generate(prompts[i], max_new_tokens=lengths[i], ignore_eos=True)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r.finish_reason for r in results] == ["length"] * 3
        # one cancelled request: counted under its reason, with the tokens it got
        stream = c.stream([13, 14], max_new_tokens=5000, ignore_eos=True)
        got = len(next(stream).token_ids)
        stream.close()
        wait_until(lambda: c.info().num_unfinished == 0 and c.info().pages.used == 0)
        after = wait_until(
            lambda: (m := scrape(port))['qil_requests_finished_total{reason="cancelled"}']
            > before['qil_requests_finished_total{reason="cancelled"}'] and m
        )
    assert delta(after, before, 'qil_requests_finished_total{reason="length"}') == 3
    assert delta(after, before, 'qil_requests_finished_total{reason="cancelled"}') == 1
    assert delta(after, before, 'qil_requests_finished_total{reason="error"}') == 0
    assert delta(after, before, "qil_prompt_tokens_total") == 3 + 4 + 5 + 2
    out_tokens = delta(after, before, "qil_generation_tokens_total")
    assert 6 + 7 + 8 + got <= out_tokens < 6 + 7 + 8 + 5000
    for hist in ("qil_time_to_first_token_seconds", "qil_inter_token_latency_seconds",
                 "qil_queue_time_seconds", "qil_e2e_seconds"):
        assert delta(after, before, f"{hist}_count") >= 3, hist
        assert delta(after, before, f"{hist}_sum") > 0, hist
    assert delta(after, before, "qil_e2e_seconds_count") == 4
    # every token came out of one step; each step's batch counts the requests with events in it
    steps = delta(after, before, "qil_step_seconds_count")
    assert steps >= 8
    assert delta(after, before, "qil_batch_size_count") == steps
    # token events plus the cancelled request's closing event
    assert out_tokens <= delta(after, before, "qil_batch_size_sum") <= out_tokens + 1
    assert delta(after, before, "qil_step_seconds_sum") > 0
    # gauges from the worker's last step
    assert after["qil_kv_pages_used"] == 0 and after["qil_kv_pages_free"] == 512
    assert after["qil_requests_running"] == 0 and after["qil_requests_waiting"] == 0
    assert after["qil_worker_restarts_total"] == 0


def test_pages_gauge_moves_while_a_request_runs(metrics_server):
    srv, port = metrics_server
    with Client(srv.target, timeout=60) as c:
        stream = c.stream(list(range(1, 40)), max_new_tokens=5000, ignore_eos=True)
        next(stream)
        m = wait_until(lambda: (m := scrape(port))["qil_kv_pages_used"] > 0 and m)
        assert m["qil_requests_running"] == 1
        assert m["qil_kv_pages_used"] + m["qil_kv_pages_free"] == 512
        assert m["qil_requests_unfinished"] == 1
        # the gateway's KV-utilisation gauge: the fraction of the pool requests hold
        assert m["qil_kv_cache_usage_ratio"] == m["qil_kv_pages_used"] / 512 > 0
        stream.close()
        m = wait_until(lambda: (m := scrape(port))["qil_kv_pages_used"] == 0 and m)
        assert m["qil_kv_cache_usage_ratio"] == 0


def test_cache_config_info_names_the_pools_page_size_and_count(metrics_server):
    """What an endpoint picker's prefix scorer reads (vLLM's label names, docs/deploy.md)."""
    srv, port = metrics_server
    with Client(srv.target, timeout=60) as c:
        info = c.info()
    (key,) = [k for k in scrape(port) if k.startswith("qil_cache_config_info{")]
    assert key == f'qil_cache_config_info{{block_size="{info.limits.page_size}",num_gpu_blocks="{info.pages.total}"}}'
    assert scrape(port)[key] == 1


def _serve(env: dict, *args: str) -> tuple[subprocess.Popen, str, list[str]]:
    return serve_process(*args, env=env)


def test_json_logs_request_lines_startup_summary_and_metrics_flag(model_dir, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", QIL_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("QIL_AUTH_TOKEN", None)
    port = free_port()
    proc, target, err = _serve(
        env, "--model", str(model_dir), "--log-format", "json", "--metrics-port", str(port),
        "--grace-seconds", "5",
    )
    try:
        with Client(target, timeout=60) as c:
            worker_pid = c.info().worker.pid
            r = c.generate([1, 2, 3, 4], max_new_tokens=9, ignore_eos=True, request_id="json-log-req")
            assert r.finish_reason == "length"
            m = scrape(port)
            assert m['qil_requests_finished_total{reason="length"}'] == 1
            assert m["qil_generation_tokens_total"] == 9 and m["qil_prompt_tokens_total"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    join_output(proc)  # every line of stderr is in ``err``
    lines = [line for line in err if line.strip()]
    records = []
    for line in lines:
        records.append(json.loads(line))  # every line, of both processes, is one JSON object
    for rec in records:
        assert {"ts", "level", "logger", "message", "process"} <= set(rec), rec
    fin = [r for r in records if r.get("request_id") == "json-log-req" and r["message"].startswith("finished")]
    assert len(fin) == 1, records
    fin = fin[0]
    assert fin["level"] == "INFO" and fin["process"] == proc.pid
    assert fin["reason"] == "length" and fin["prompt_tokens"] == 4 and fin["output_tokens"] == 9
    assert fin["ttft_s"] > 0 and fin["mean_itl_s"] > 0 and fin["e2e_s"] >= fin["ttft_s"]
    assert "ttft=" in fin["message"] and "itl=" in fin["message"]
    worker = [r for r in records if r["process"] == worker_pid]
    shard = [r for r in worker if r["logger"] == "qil_worker.model.loader"]
    assert any("loading weights: shard 1/1" in r["message"] for r in shard), worker
    summary = [r for r in worker if "loaded and warm" in r["message"]]
    assert len(summary) == 1
    msg = summary[0]["message"]
    assert "dtype float32" in msg and "device cpu" in msg and "512 KV pages" in msg
    assert "KV pool" in msg and "process RSS" in msg
    assert "tensor parallel: 1 rank(s) on 1 node(s)" in msg
    assert any(r["logger"] == "qil.metrics" and str(port) in r["message"] for r in records)
    ready = [r for r in records if r["logger"] == "qil.front" and "worker ready" in r["message"]]
    assert len(ready) == 1 and "process RSS" in ready[0]["message"]
    assert ready[0]["process"] == proc.pid


def test_metrics_port_in_use_is_a_clear_error(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--model", str(model_dir),
             "--metrics-port", str(port)],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )
    assert out.returncode == 2, out.stderr
    assert "cannot start the server" in out.stderr and "Traceback" not in out.stderr


def test_prometheus_client_is_only_needed_with_the_flag(model_dir, tmp_path):
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "prometheus_client.py").write_text("raise ImportError('blocked for this test')\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}")
    env.pop("QIL_AUTH_TOKEN", None)
    out = subprocess.run(
        [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--model", str(model_dir),
         "--metrics-port", str(free_port())],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )
    assert out.returncode == 2
    assert "prometheus_client" in out.stderr and "qil[metrics]" in out.stderr
    assert "qil serving on" not in out.stdout
    proc, target, _ = _serve(env, "--model", str(model_dir))
    try:
        with Client(target, timeout=60) as c:
            assert c.generate([1, 2], max_new_tokens=3).num_output_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_operations_flags_reach_the_config():
    import argparse

    from qil_worker.service.cli import add_serve_parser, config_from_args
    from qil_worker.service.front.limits import MAX_STREAM_BACKLOG

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["serve"]))
    assert cfg.metrics_port is None and cfg.front.worker.log_format == "text"
    assert cfg.front.max_stream_backlog == MAX_STREAM_BACKLOG
    cfg = config_from_args(parser.parse_args(
        ["serve", "--log-format", "json", "--metrics-port", "9100", "--metrics-host", "0.0.0.0",
         "--max-stream-backlog", "8", "--log-level", "debug"]))
    assert cfg.metrics_port == 9100 and cfg.metrics_host == "0.0.0.0"
    assert cfg.front.worker.log_format == "json" and cfg.front.max_stream_backlog == 8
    assert cfg.front.worker.log_level == "DEBUG"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--log-format", "xml"])


def test_log_lines_carry_the_request_id():
    import io
    import logging

    from qil_worker.service import logs

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        for fmt in ("json", "text"):
            buf = io.StringIO()
            logs.setup("INFO", fmt, stream=buf)
            log = logging.getLogger("qil.test")
            logs.request_logger(log, "rid-7").info("hello %d", 5)
            log.info("plain", extra={"fields": {"k": 1}})
            first, second = buf.getvalue().splitlines()
            if fmt == "json":
                a, b = json.loads(first), json.loads(second)
                assert a["request_id"] == "rid-7" and a["message"] == "hello 5"
                assert a["logger"] == "qil.test" and a["level"] == "INFO" and a["process"] == os.getpid()
                assert "request_id" not in b and b["k"] == 1
            else:
                assert "[req rid-7] hello 5" in first and "[req" not in second
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_preemptions_are_counted(model_dir):
    """A pool too small for both requests at once: the engine preempts one; the counter agrees
    with the requests' own metrics."""
    from service_fixtures import ENGINE

    port = free_port()
    srv = start_server(model_dir, engine=dict(ENGINE, num_pages=8), metrics_port=port)  # 128 tokens
    try:
        with Client(srv.target, timeout=60) as c:
            results = [None, None]

            def run(i: int) -> None:
                results[i] = c.generate([i + 1] * 10, max_new_tokens=100, ignore_eos=True)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert [r.finish_reason for r in results] == ["length", "length"]
            preempted = sum(r.metrics.num_preemptions for r in results)
            assert preempted >= 1
            m = scrape(port)
            assert m["qil_preemptions_total"] == preempted
            assert m["qil_kv_pages_total"] == 8 and m["qil_kv_pages_used"] == 0
    finally:
        srv.stop()


def test_metrics_on_port_0_log_the_port_picked_and_an_ipv6_host_is_unbracketed(model_dir, caplog):
    hosts = ["127.0.0.1"]
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        hosts.append("[::1]")  # how --host writes an IPv6 address for gRPC
    except OSError:
        pass
    for host in hosts:
        caplog.clear()
        with caplog.at_level("INFO", logger="qil.metrics"):
            srv = start_server(model_dir, metrics_port=0, host=host)
        try:
            (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("metrics on ")]
            url = line.split()[-1]
            assert not url.endswith(":0/metrics")
            with urllib.request.urlopen(url, timeout=10) as r:
                assert b"qil_" in r.read()
        finally:
            srv.stop()


def test_finished_requests_expire_while_the_server_is_idle(model_dir):
    """--retain-seconds bounds how long a finished request is replayed, even when nothing else
    finishes after it (expiry must not wait for another request to finish)."""
    with start_server(model_dir, retain_seconds=0.5) as srv:
        with Client(srv.target, timeout=30) as c:
            c.generate([1, 2, 3], max_new_tokens=2, request_id="old")
            assert c.result("old").finish_reason == "length"  # kept at first

            def forgotten() -> bool:
                try:
                    c.result("old")
                except NotFound:
                    return True
                return False

            wait_until(forgotten, timeout=10)  # far past its 0.5 s, with nothing else finishing
