"""The README quick start, end to end: ``python -m qil_worker serve`` on the embedded demo model,
``python -m qil_client ... generate``, then SIGTERM with a request in flight."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service_fixtures import serve_process
from qil_client import Client, QilError, Unavailable

ROOT = Path(__file__).resolve().parents[2]


def _start(env: dict, *args: str) -> tuple[subprocess.Popen, str, list[str]]:
    return serve_process(*args, env=env)


def test_quickstart_demo_model_client_cli_and_graceful_sigterm(tmp_path):
    env = dict(os.environ, QIL_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    env.pop("QIL_AUTH_TOKEN", None)
    proc, target, err_lines = _start(env, "--grace-seconds", "1")
    try:
        assert (tmp_path / "cache" / "demo-v2" / "config.json").exists()
        # The front never imports torch (only the worker does).
        maps = Path(f"/proc/{proc.pid}/maps")
        if maps.exists():
            assert "libtorch" not in maps.read_text()
        out = subprocess.run(
            [sys.executable, "-m", "qil_client", "--target", target, "generate",
             "--token-ids", "[1,2,3]", "--max-new-tokens", "8", "--ids"],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        token_line, summary = out.stdout.strip().splitlines()[-2:]
        assert len(token_line.split()) == 8
        assert "8 tokens, finish=length" in summary and "ttft" in summary
        # a chat prompt with sampling: the text streams out, as the library returns it
        flags = ["--prompt", "Hello", "--chat", "--no-thinking", "--temperature", "0.8", "--top-p", "0.9",
                 "--seed", "5", "--max-new-tokens", "12", "--ignore-eos"]
        out = subprocess.run(
            [sys.executable, "-m", "qil_client", "--target", target, "generate", *flags],
            capture_output=True, text=True, cwd=ROOT, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        with Client(target) as c:
            info = c.info()
            assert info.model.demo and info.model.name == "demo"
            assert info.model.vocab_size == 320
            # the CPU worker was started with malloc in huge pages (huge_page_malloc.py)
            environ = Path(f"/proc/{info.worker.pid}/environ")
            if environ.exists() and "GLIBC_TUNABLES" not in env:
                assert b"GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in environ.read_bytes().split(b"\0")
            assert info.model.has_tokenizer and info.model.has_chat_template
            r = c.generate(messages=[{"role": "user", "content": "Hello"}], enable_thinking=False,
                           temperature=0.8, top_p=0.9, seed=5, max_new_tokens=12, ignore_eos=True)
            assert r.num_output_tokens == 12 and r.text is not None
            summary = out.stdout.rsplit("\n", 2)[-2]
            assert out.stdout == r.text + "\n" + summary + "\n"
            assert "12 tokens, finish=length" in summary
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


def test_serve_on_a_port_in_use_fails_with_one_clear_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        out = subprocess.run(
            [sys.executable, "-m", "qil_worker", "serve", "--port", str(taken.getsockname()[1]),
             "--model", str(tmp_path)],
            capture_output=True, text=True, cwd=ROOT, timeout=120,
        )
    assert out.returncode == 2, out.stderr
    assert "cannot start the server: cannot bind 127.0.0.1:" in out.stderr
    assert "Traceback" not in out.stderr


def _weights_only(src: Path, dst: Path) -> Path:
    """A model directory without tokenizer files (links to ``src``'s config and weights)."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (src / name).exists():
            (dst / name).symlink_to(src / name)
    return dst


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    from checkpoints import make_text_checkpoint

    return make_text_checkpoint(tmp_path_factory.mktemp("cli-text"))


def test_serve_kv_budget_no_prefix_cache_and_tokenizer_dir(tmp_path, text_dir):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("QIL_AUTH_TOKEN", None)
    model = _weights_only(text_dir, tmp_path / "weights")
    # one page: K and V of 8 tokens in 2 layers, 2 KV heads of 16, float32 = 4096 bytes
    proc, target, err_lines = _start(
        env, "--model", str(model), "--tokenizer", str(text_dir), "--no-prefix-cache",
        "--kv-memory-bytes", "64KiB", "--page-size", "8", "--grace-seconds", "1",
        "--schedule-policy", "shortest-first",
    )
    try:
        with Client(target, timeout=60) as c:
            info = c.info()
            assert info.pages.total == 16 and info.pages.page_bytes == 4096
            assert info.limits.page_size == 8 and info.limits.schedule_policy == "shortest-first"
            assert info.limits.attention_backend == "sdpa" and not info.limits.cuda_graphs  # CPU
            assert info.model.has_tokenizer and not info.prefix_cache.enabled
            prompt = [(5 * i + 1) % 250 for i in range(40)]
            runs = [c.generate(prompt, max_new_tokens=3) for _ in range(2)]
            assert [r.num_cached_tokens for r in runs] == [0, 0]
            assert runs[0].token_ids == runs[1].token_ids and runs[0].text is not None
            assert c.info().pages.cached == 0 and c.info().prefix_cache.hit_rate == 0
            with pytest.raises(QilError) as exc:  # 128 tokens of KV in all
                c.submit(prompt, max_new_tokens=100)
            assert exc.value.field == "max_new_tokens"
            r = c.generate(text="hello world", max_new_tokens=5, temperature=0.6, seed=2)
            assert r.num_output_tokens == len(r.token_ids) > 0 and r.text is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        log = "".join(err_lines)
        assert "KV pool: 16 pages x 8 tokens = 128 tokens, 64.0 KiB (budget of 64.0 KiB)" in log
        assert f"tokenizer: {text_dir}" in log and "prefix cache: off; schedule: shortest-first" in log
        frozen = re.search(r"(\d+) start-up objects frozen for the GC", log)
        assert frozen and int(frozen.group(1)) > 10_000  # torch, the tokenizer, the model's modules
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_without_tokenizer_and_refused_configurations(tmp_path, text_dir):
    """--no-tokenizer serves token ids only; a KV fraction and a varlen attention backend need
    CUDA, and a tokenizer whose vocabulary does not fit the model's is refused (all: exit before
    serving)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("QIL_AUTH_TOKEN", None)
    serve = [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--threads", "1"]
    tiny = tmp_path / "tiny"
    from checkpoints import make_checkpoint

    make_checkpoint(tiny, seed=0)  # vocabulary of 97: the text tokenizer has more tokens
    failing = [
        subprocess.Popen(serve + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=ROOT)
        for args in (["--model", str(text_dir), "--kv-memory-fraction", "0.5"],
                     ["--model", str(tiny), "--tokenizer", str(text_dir)],
                     ["--model", str(tiny), "--attention", "varlen-packed"])
    ]
    proc, target, _ = _start(env, "--model", str(text_dir), "--no-tokenizer", "--grace-seconds", "1")
    try:
        with Client(target, timeout=60) as c:
            assert not c.info().model.has_tokenizer
            with pytest.raises(QilError) as exc:
                c.generate(text="hello", max_new_tokens=2)
            assert exc.value.code.name == "FAILED_PRECONDITION" and exc.value.field == "text"
            r = c.generate([1, 2, 3], max_new_tokens=3)
            assert r.text is None and r.num_output_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    outs = [p.communicate(timeout=120) for p in failing]
    assert [p.returncode for p in failing] == [2, 2, 2]
    assert "CUDA" in outs[0][1]
    assert "do not belong together" in outs[1][1]
    assert "attention 'varlen-packed' is unavailable: not a CUDA device" in outs[2][1]
