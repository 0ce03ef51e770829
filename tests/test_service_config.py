"""``serve`` flags → server configuration (no server started)."""

from __future__ import annotations

import argparse

from qil_worker.service.cli import add_serve_parser, config_from_args


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
    assert cfg.front.model == "/m" and cfg.front.max_queued == 4
    assert cfg.front.engine == dict(num_pages=7, page_size=8, token_budget=9, prefill_chunk=10, max_active=3)
    assert cfg.auth_token is None or cfg.auth_token  # from the environment, if any


def test_auth_token_from_flag_or_environment(monkeypatch):
    monkeypatch.setenv("QIL_AUTH_TOKEN", "from-env")
    assert config_from_args(_parse([])).auth_token == "from-env"
    assert config_from_args(_parse(["--auth-token", "flag"])).auth_token == "flag"
    monkeypatch.delenv("QIL_AUTH_TOKEN")
    assert config_from_args(_parse([])).auth_token is None
    assert config_from_args(_parse([])).front.model is None  # the embedded demo


def test_finished_requests_are_retained_boundedly():
    from qil_worker.service.front import Front, FrontConfig, Req

    front = Front(FrontConfig(retain_finished=2, retain_seconds=60))
    for i in range(4):
        req = Req(f"r{i}", 1)
        front.requests[req.rid] = req
        front.num_unfinished += 1
        req.final = (2, None, None)
        front._finished(req)
    assert sorted(front.requests) == ["r2", "r3"]  # the oldest finished ones are forgotten
    assert front.num_unfinished == 0
