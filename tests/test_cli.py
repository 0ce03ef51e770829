"""The ``python -m qil_worker generate`` command, run as a user would."""

import asyncio
import json
import os
import subprocess
import sys

import pytest

from qil_worker import Engine, Qwen3

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def _run(*args, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "qil_worker", "generate", *args],
        capture_output=True, text=True, timeout=120, env=ENV,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_generate_token_ids_matches_engine(tiny_dir):
    proc = _run("--model", str(tiny_dir), "--token-ids", "[1,2,3]", "--max-new-tokens", "8",
                "--device", "cpu", "--dtype", "float32", "--json")
    out = json.loads(proc.stdout)
    (want,) = Engine(Qwen3.from_directory(tiny_dir), num_pages=16, page_size=8).generate([[1, 2, 3]], 8)
    assert out["output_token_ids"] == want.output_token_ids
    assert out["finish_reason"] == "length" and out["ttft_s"] > 0

    text = _run("--model", str(tiny_dir), "--token-ids", "[1,2,3]", "--max-new-tokens", "8").stdout
    assert f"tokens: {want.output_token_ids}" in text and "TTFT" in text


@pytest.fixture(scope="module")
def dir_with_tokenizer(tmp_path_factory, tiny_dir):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tok")
    for f in tiny_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    words = ["<unk>", "hello", "world", "qil", "serves", "qwen"] + [f"w{i}" for i in range(80)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    return path


def test_generate_prompt_uses_the_directory_tokenizer(dir_with_tokenizer):
    proc = _run("--model", str(dir_with_tokenizer), "--prompt", "hello world qil", "--json",
                "--max-new-tokens", "5")
    out = json.loads(proc.stdout)
    (want,) = Engine(Qwen3.from_directory(dir_with_tokenizer), num_pages=16, page_size=8).generate([[1, 2, 3]], 5)
    assert out["output_token_ids"] == want.output_token_ids


def test_clear_errors(tiny_dir):
    proc = _run("--model", str(tiny_dir), "--prompt", "hi", check=False)
    assert proc.returncode == 2 and "no tokenizer files" in proc.stderr
    proc = _run("--model", str(tiny_dir), "--token-ids", "[1, 500]", check=False)
    assert proc.returncode == 2 and "token id 500 is outside [0, 97)" in proc.stderr
    proc = _run("--model", str(tiny_dir), "--token-ids", "nope", check=False)
    assert proc.returncode != 0 and "JSON list" in proc.stderr
    for flag in ("--num-pages", "--page-size"):
        proc = _run("--model", str(tiny_dir), "--token-ids", "[1]", flag, "0", check=False)
        assert proc.returncode == 2 and f"{flag}: expected a positive integer, got '0'" in proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_that_is_not_there_is_a_clear_error(tiny_dir):
    proc = _run("--model", str(tiny_dir), "--token-ids", "[1]", "--device", "cuda", check=False)
    assert proc.returncode == 2 and "has no CUDA device" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag, value", [
    ("--threads", "0"), ("--port", "-5"), ("--port", "70000"), ("--metrics-port", "70000"),
    ("--max-queued", "-1"), ("--retain-tokens", "-3"), ("--log-level", "verbose"),
])
def test_serve_refuses_impossible_flag_values(flag, value):
    proc = subprocess.run(
        [sys.executable, "-m", "qil_worker", "serve", flag, value],
        capture_output=True, text=True, timeout=120, env=ENV,
    )
    assert proc.returncode == 2 and f"argument {flag}:" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_refuses_client_certificates_without_tls():
    """--tls-client-ca alone would have served plaintext to anyone."""
    proc = subprocess.run(
        [sys.executable, "-m", "qil_worker", "serve", "--tls-client-ca", "ca.pem"],
        capture_output=True, text=True, timeout=120, env=ENV,
    )
    assert proc.returncode == 2 and "--tls-client-ca needs --tls-cert and --tls-key" in proc.stderr
    from qil_worker.service.server import ServeConfig, Server

    with pytest.raises(ValueError, match="--tls-client-ca needs"):
        asyncio.run(Server(ServeConfig(port=0, tls_client_ca="ca.pem")).start())
