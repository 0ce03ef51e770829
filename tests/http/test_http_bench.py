"""``scripts/bench_service.py --protocol both``: the HTTP/gRPC ratio is best round over best
round, and a real quick run reports both protocols with the front's CPU per event."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import types
from contextlib import redirect_stdout
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_service as bs  # noqa: E402


def test_http_over_grpc_is_best_round_over_best_round(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    in_process, grpc_rounds, http_rounds = iter([100.0, 80.0]), iter([90.0, 70.0]), iter([60.0, 81.0])
    monkeypatch.setattr(bs, "load_engine", lambda args, d: types.SimpleNamespace(close=lambda: None))
    server = types.SimpleNamespace(terminate=lambda: None, wait=lambda timeout: 0)
    monkeypatch.setattr(bs, "start_server", lambda args, d: (server, "x", "http://x/v1"))
    monkeypatch.setattr(bs, "_closed_loop", lambda engine, args, prompts: {"tokens_per_s": next(in_process)})

    async def fake_grpc(args, target, prompts):
        return {"tokens_per_s": next(grpc_rounds)}

    async def fake_http(args, url, prompts):
        assert url == "http://x/v1"
        return {"tokens_per_s": next(http_rounds)}

    monkeypatch.setattr(bs, "run_grpc", fake_grpc)
    monkeypatch.setattr(bs, "run_http", fake_http)
    out = io.StringIO()
    with redirect_stdout(out):
        bs.main(["--model", str(tmp_path), "--warmup-rounds", "0", "--repeat", "2", "--json", "--protocol", "both"])
    report = json.loads(out.getvalue())
    assert report["http_over_grpc"] == pytest.approx(0.9)
    assert report["ratio"] == pytest.approx(0.9)  # gRPC's best over in-process's best


def test_quick_run_of_both_protocols(tmp_path):
    out = subprocess.run(
        [sys.executable, "scripts/bench_service.py", "--quick", "--protocol", "both", "--requests", "4",
         "--max-new-tokens", "4", "--concurrency", "2", "--warmup-rounds", "0", "--repeat", "1",
         "--threads", "1", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
        env={**__import__("os").environ, "QIL_CACHE_DIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    for name in ("grpc", "http"):
        assert report[name]["tokens"] == 16
        assert report[name]["events"] >= 4 and report[name]["front_cpu_us_per_event"] >= 0
    assert report["http_over_grpc"] > 0
