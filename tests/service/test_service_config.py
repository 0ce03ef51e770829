"""``serve`` flags → server configuration (no server started)."""

from __future__ import annotations

import argparse

import pytest

from qil_worker.engine.config import EngineConfig
from qil_worker.service.cli import add_serve_parser, config_from_args, run_serve
from service_fixtures import wait_until


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_reach_the_engine_and_the_front():
    cfg = config_from_args(_parse([
        "--model", "/m", "--port", "0", "--num-pages", "7", "--page-size", "8", "--token-budget", "9",
        "--prefill-chunk", "10", "--max-active", "3", "--max-queued", "4", "--grace-seconds", "2.5",
    ]))
    assert cfg.port == 0 and cfg.grace_seconds == 2.5
    worker = cfg.front.worker
    assert worker.model == "/m" and cfg.front.max_queued == 4
    assert worker.engine == EngineConfig(
        num_pages=7, page_size=8, token_budget=9, prefill_chunk=10, max_active=3, prefix_cache=True,
        schedule_policy="fcfs", attention="auto",
    )
    assert cfg.auth_token is None or cfg.auth_token  # from the environment, if any
    assert worker.kv_memory_bytes is None and worker.kv_memory_fraction is None
    assert worker.tokenizer is None and worker.use_tokenizer


def test_defaults_leave_pool_sizing_and_tokenizer_to_the_worker():
    cfg = config_from_args(_parse([]))
    assert cfg.front.worker.engine == EngineConfig()  # the engine's defaults: 512 pages...
    assert cfg.front.worker.engine.prefix_cache is True
    assert cfg.front.worker.tokenizer is None and cfg.front.worker.use_tokenizer


def test_schedule_policy_flag():
    assert config_from_args(_parse(["--schedule-policy", "shortest-first"])).front.worker.engine.schedule_policy == \
        "shortest-first"
    with pytest.raises(SystemExit):
        _parse(["--schedule-policy", "random"])


def test_attention_flag():
    assert config_from_args(_parse(["--attention", "varlen-packed"])).front.worker.engine.attention == "varlen-packed"
    with pytest.raises(SystemExit):
        _parse(["--attention", "flash"])


def test_prefix_cache_and_tokenizer_flags():
    cfg = config_from_args(_parse(["--no-prefix-cache", "--tokenizer", "/tok"]))
    engine = cfg.front.worker.engine
    assert engine.prefix_cache is False
    assert engine.cuda_graphs is None  # the engine decides: on for CUDA
    assert config_from_args(_parse(["--no-cuda-graphs"])).front.worker.engine.cuda_graphs is False
    assert engine.overlap is None  # the engine decides: on for CUDA
    assert config_from_args(_parse(["--no-overlap"])).front.worker.engine.overlap is False
    assert config_from_args(_parse(["--no-step-graphs"])).front.worker.engine.step_graphs is False
    assert config_from_args(_parse(["--step-graphs"])).front.worker.engine.step_graphs is True
    assert config_from_args(_parse([])).front.worker.engine.step_graphs is None
    assert engine.compile_decode is False  # opt-in: compiling takes minutes for a real model
    assert config_from_args(_parse(["--compile-decode"])).front.worker.engine.compile_decode is True
    assert cfg.front.worker.tokenizer == "/tok" and cfg.front.worker.use_tokenizer
    cfg = config_from_args(_parse(["--no-tokenizer"]))
    assert not cfg.front.worker.use_tokenizer
    assert cfg.front.worker.compile is True  # CPU kernels that measure faster compiled: on by default
    assert config_from_args(_parse(["--no-compile"])).front.worker.compile is False
    with pytest.raises(SystemExit):
        _parse(["--no-tokenizer", "--tokenizer", "/tok"])


@pytest.mark.parametrize(
    "text, value",
    [("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1e9", 10**9), ("1000", 1000), ("2g", 2 * 10**9),
     ("64KiB", 65536)],
)
def test_kv_memory_bytes_accepts_units(text, value):
    cfg = config_from_args(_parse(["--kv-memory-bytes", text]))
    assert cfg.front.worker.kv_memory_bytes == value  # (the worker sizes the pool from it)


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-memory-bytes", "1GiB", "--num-pages", "8"],
        ["--kv-memory-fraction", "0.5", "--num-pages", "8"],
        ["--kv-memory-fraction", "0.5", "--kv-memory-bytes", "1GiB"],
        ["--kv-memory-bytes", "-5"],
        ["--kv-memory-bytes", "lots"],
        ["--kv-memory-bytes", "nan"],
        ["--kv-memory-fraction", "1.5"],
        ["--kv-memory-fraction", "0"],
        ["--num-pages", "0"],
    ],
)
def test_pool_sizing_flags_are_exclusive_and_checked(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-memory" in err or "--num-pages" in err


def test_kv_memory_fraction_reaches_the_front():
    cfg = config_from_args(_parse(["--kv-memory-fraction", "0.8"]))
    assert cfg.front.worker.kv_memory_fraction == 0.8 and cfg.front.worker.kv_memory_bytes is None


def test_auth_token_from_flag_or_environment(monkeypatch):
    monkeypatch.setenv("QIL_AUTH_TOKEN", "from-env")
    assert config_from_args(_parse([])).auth_token == "from-env"
    assert config_from_args(_parse(["--auth-token", "flag"])).auth_token == "flag"
    monkeypatch.delenv("QIL_AUTH_TOKEN")
    assert config_from_args(_parse([])).auth_token is None
    assert config_from_args(_parse([])).front.worker.model is None  # the embedded demo


def _finished_req(rid: str, num_tokens: int = 1, top_width: int = 0):
    from qil_worker.service.front.request_log import FrontRequest
    from qil_worker.service.protocol import FinalRecord, FinishReason

    req = FrontRequest(rid, 1)
    for i in range(num_tokens):
        req.append(i, None, None, [(1, -0.1)] * top_width if top_width else None)
    req.append(-1, None, None, None, FinalRecord(FinishReason.LENGTH, None, 1, num_tokens, 0, None, None))
    return req


def test_finished_requests_are_retained_boundedly():
    from qil_worker.service.front.request_log import Retention

    kept = Retention(max_count=2, max_size=10**6, max_age_s=60)
    dropped = [kept.keep(_finished_req(f"r{i}")) for i in range(4)]
    assert dropped == [[], [], ["r0"], ["r1"]]  # the oldest finished ones are forgotten
    assert len(kept) == 2


def test_finished_requests_are_retained_within_a_token_budget():
    from qil_worker.service.front.request_log import Retention, retained_size

    kept = Retention(max_count=100, max_size=1000, max_age_s=60)
    sizes, dropped = {}, []
    for i in range(6):  # odd ones with 4 top-logprob candidates per token: 5x the weight
        req = _finished_req(f"r{i}", num_tokens=100, top_width=4 if i % 2 else 0)
        sizes[req.rid] = retained_size(req)
        dropped += kept.keep(req)
    assert sizes == {"r0": 100, "r1": 500, "r2": 100, "r3": 500, "r4": 100, "r5": 500}
    # newest first while the total stays within 1000: r5 (500) + r4 (100) ... r3 would make 1100
    assert dropped == ["r0", "r1", "r2", "r3"]
    assert kept.size == 600


def test_finished_requests_expire_by_age_and_a_forgotten_id_frees_its_size():
    from qil_worker.service.front.request_log import Retention

    kept = Retention(max_count=100, max_size=1000, max_age_s=0.05)
    kept.keep(_finished_req("old", num_tokens=10))
    kept.keep(_finished_req("gone", num_tokens=20))
    kept.forget("gone")  # its id was submitted again
    assert kept.size == 10 and kept.expired() == []
    assert wait_until(kept.expired, timeout=5) == ["old"]  # once 0.05 s have passed
    assert len(kept) == 0 and kept.size == 0


def test_retention_bounds_are_inclusive():
    from qil_worker.service.front.request_log import Retention

    kept = Retention(max_count=2, max_size=200, max_age_s=60)
    assert kept.keep(_finished_req("a", num_tokens=100)) == []
    assert kept.keep(_finished_req("b", num_tokens=100)) == []  # 200 tokens fit a 200 budget
    assert len(kept) == 2 and kept.size == 200


def test_serve_flag_bounds():
    assert _parse(["--port", "65535"]).port == 65535
    assert _parse(["--metrics-port", "65535"]).metrics_port == 65535
    assert _parse(["--max-queued", "0"]).max_queued == 0
    assert _parse(["--max-stream-backlog", "0"]).max_stream_backlog == 0
    with pytest.raises(SystemExit):
        _parse(["--kv-memory-fraction", "1.0"])
    assert _parse(["--kv-memory-bytes", "3MB"]).kv_memory_bytes == 3 * 10**6
    assert _parse(["--kv-memory-bytes", "3m"]).kv_memory_bytes == 3 * 10**6


def test_serve_flags_reach_the_config(monkeypatch):
    cfg = config_from_args(_parse(["--metrics-host", "0.0.0.0", "--threads", "3", "--max-stream-backlog", "7",
                                   "--retain-seconds", "1.5", "--max-restarts", "9"]))
    assert cfg.metrics_host == "0.0.0.0" and cfg.front.worker.threads == 3
    assert cfg.front.max_stream_backlog == 7 and cfg.front.retain_seconds == 1.5 and cfg.front.max_restarts == 9
    monkeypatch.setenv("QIL_AUTH_TOKEN", "")
    assert config_from_args(_parse([])).auth_token is None


def test_tls_cert_without_key_is_refused(capsys):
    assert run_serve(_parse(["--tls-cert", "cert.pem", "--port", "0"])) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


def test_structured_warmup_flag_reaches_the_worker_config():
    assert config_from_args(_parse([])).front.worker.structured_warmup is True
    cfg = config_from_args(_parse(["--no-structured-warmup"]))
    assert cfg.front.worker.structured_warmup is False
