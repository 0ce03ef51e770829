"""The README quick start, end to end: ``python -m qil_worker serve`` on the embedded demo model,
``python -m qil_client ... generate``, then SIGTERM with a request in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qil_client import Client, QilError, Unavailable

ROOT = Path(__file__).resolve().parent.parent


def _start(env: dict, *extra: str) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--threads", "1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )
    err_lines: list[str] = []
    threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            pytest.fail("server exited early:\n" + "".join(err_lines))
        if line.startswith("qil serving on "):
            return proc, line.split()[3], err_lines
    proc.kill()
    pytest.fail("server did not start")


def test_quickstart_demo_model_client_cli_and_graceful_sigterm(tmp_path):
    env = dict(os.environ, QIL_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    env.pop("QIL_AUTH_TOKEN", None)
    proc, target, err_lines = _start(env, "--grace-seconds", "1")
    try:
        assert (tmp_path / "cache" / "demo-v1" / "config.json").exists()
        # The front never imports torch (only the worker does).
        maps = Path(f"/proc/{proc.pid}/maps")
        if maps.exists():
            assert "libtorch" not in maps.read_text()
        out = subprocess.run(
            [sys.executable, "-m", "qil_client", "--target", target, "generate",
             "--token-ids", "[1,2,3]", "--max-new-tokens", "8"],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        token_line, summary = out.stdout.strip().splitlines()[-2:]
        assert len(token_line.split()) == 8
        assert "8 tokens, finish=length" in summary and "ttft" in summary
        with Client(target) as c:
            info = c.info()
            assert info.model.demo and info.model.name == "demo"
            assert info.model.vocab_size == 320
            # SIGTERM with a request in flight: NOT_SERVING, grace period, then it is cancelled.
            stream = c.stream([72, 101, 108, 108, 111], max_new_tokens=2000)  # no EOS within 2000
            assert next(stream).token_ids
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            finish = None
            try:
                for ev in stream:
                    if ev.finished:
                        finish = ev.finish_reason
            except Unavailable:
                finish = "unavailable"
            assert finish in (3, "unavailable")  # FINISH_REASON_CANCELLED
        assert proc.wait(30) == 0
        assert time.monotonic() - t0 < 20
        assert any("DEMO" in line for line in err_lines)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_with_a_bad_model_directory_fails_fast(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--model", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode != 0
    assert "config.json" in out.stderr
