"""The ``python -m qil_worker generate`` command, run as a user would, and its flags against the
in-process engine; the help of every command line (qil_worker, qil_client, scripts/loadtest.py)."""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import make_text_checkpoint
from qil_worker import Engine, Qwen3
from qil_worker.__main__ import main as worker_main
from qil_worker.text import load_tokenizer
from qil_worker.text.output import TextOutput

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
ROOT = Path(__file__).resolve().parents[2]


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
    from qil_worker.service.front.server import ServeConfig, Server

    with pytest.raises(ValueError, match="--tls-client-ca needs"):
        asyncio.run(Server(ServeConfig(port=0, tls_client_ca="ca.pem")).start())


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def text_engine(text_dir):
    tok = load_tokenizer(text_dir)
    return tok, Engine(Qwen3.from_directory(text_dir), num_pages=64, page_size=8, tokenizer=tok)


def gen(capsys, *argv):
    assert worker_main(["generate", *argv]) == 0
    return capsys.readouterr().out


def run_ref(engine, **kw):
    rid = engine.submit(**kw)
    while not engine.idle:
        engine.step()
    r = engine.result(rid)
    engine.release(rid)
    return r


def test_chat_flag_renders_the_template(capsys, text_dir, text_engine):
    tok, engine = text_engine
    out = json.loads(gen(capsys, "--model", str(text_dir), "--prompt", "hello", "--chat", "--json", "--max-new-tokens", "2"))
    want = run_ref(engine, messages=[{"role": "user", "content": "hello"}], max_new_tokens=2)
    assert out["prompt_tokens"] == len(want.prompt_token_ids)


def test_json_text_and_streamed_text_and_default_length(capsys, text_dir, text_engine):
    tok, engine = text_engine
    want = run_ref(engine, text="hello world", max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=4)
    out = json.loads(gen(capsys, "--model", str(text_dir), "--prompt", "hello world", "--json",
                         "--ignore-eos", "--temperature", "1", "--seed", "4"))
    assert out["output_tokens"] == 16 and out["text"] == want.output_text
    plain = gen(capsys, "--model", str(text_dir), "--prompt", "hello world", "--ignore-eos",
                "--temperature", "1", "--seed", "4")
    assert plain.startswith(want.output_text + "\n")


def test_seed_zero_is_sent(capsys, text_dir, text_engine):
    tok, engine = text_engine
    want = run_ref(engine, text="hello", max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=0)
    for _ in range(2):
        out = json.loads(gen(capsys, "--model", str(text_dir), "--prompt", "hello", "--json", "--max-new-tokens", "12",
                             "--ignore-eos", "--temperature", "1", "--seed", "0"))
        assert out["output_token_ids"] == want.output_token_ids


def test_stop_string_and_stop_ids(capsys, text_dir, text_engine):
    tok, engine = text_engine
    free = run_ref(engine, text="the quick", max_new_tokens=20, ignore_eos=True, temperature=1.0, seed=9)
    stop = free.output_text[5]
    stop_id = free.output_token_ids[6]
    common = ["--model", str(text_dir), "--prompt", "the quick", "--json", "--max-new-tokens", "20",
              "--ignore-eos", "--temperature", "1", "--seed", "9"]
    out = json.loads(gen(capsys, *common, "--stop", stop))
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop
    out = json.loads(gen(capsys, *common, "--stop-token-ids", json.dumps([stop_id])))
    assert out["finish_reason"] == "stop" and out["stop_reason"] == stop_id


def test_tokenizer_flag_is_used(capsys, text_dir, tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (text_dir / name).exists():
            (weights / name).symlink_to(text_dir / name)
    out = json.loads(gen(capsys, "--model", str(weights), "--tokenizer", str(text_dir), "--prompt", "hello",
                         "--json", "--max-new-tokens", "2"))
    assert out["output_tokens"] == 2


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_structured_output_flags_constrain_the_output_as_the_engine_does(capsys, text_dir, text_engine, tmp_path):
    import re

    import jsonschema

    tok, engine = text_engine
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    grammar_file = tmp_path / "g.lark"
    grammar_file.write_text('start: "yes" | "no" | "maybe"')
    common = ["--model", str(text_dir), "--prompt", "hello", "--json", "--max-new-tokens", "40",
              "--temperature", "1", "--seed", "3"]
    cases = [
        (["--choice", "yes", "--choice", "no"], dict(choice=["yes", "no"])),
        (["--json-schema", str(schema_file)], dict(json_schema=json.dumps(SCHEMA))),
        (["--json-schema", json.dumps(SCHEMA)], dict(json_schema=json.dumps(SCHEMA))),
        (["--regex", "[a-c]{3}[0-9]"], dict(regex="[a-c]{3}[0-9]")),
        (["--grammar", str(grammar_file)], dict(grammar='start: "yes" | "no" | "maybe"')),
        (["--json-object"], dict(json_object=True)),
    ]
    texts = []
    for flags, kw in cases:
        out = json.loads(gen(capsys, *common, *flags))
        want = run_ref(engine, text="hello", max_new_tokens=40, temperature=1.0, seed=3, **kw)
        assert out["output_token_ids"] == want.output_token_ids and out["text"] == want.output_text, flags
        assert out["text"].startswith("{") if "json_object" in kw else out["finish_reason"] == "stop"
        texts.append(out["text"])
    choice, schema_from_file, inline_schema, regex, grammar, json_object = texts
    assert choice in ("yes", "no") and grammar in ("yes", "no", "maybe")
    jsonschema.validate(json.loads(schema_from_file), SCHEMA)
    assert inline_schema == schema_from_file and re.fullmatch("[a-c]{3}[0-9]", regex)


@pytest.mark.parametrize("flags, says", [
    (["--regex", "a", "--choice", "b"], "not allowed with argument"),
    (["--json-schema", "{not json"], "argument --json-schema: expected a JSON schema file or inline JSON"),
    (["--grammar", "/no/such/file.lark"], "argument --grammar: cannot read the grammar file"),
])
def test_structured_output_flags_refuse_what_cannot_be_sent(capsys, flags, says):
    with pytest.raises(SystemExit) as exc:
        worker_main(["generate", "--prompt", "hi", *flags])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_a_constraint_that_does_not_compile_is_a_clear_error(capsys, text_dir):
    argv = ["generate", "--model", str(text_dir), "--prompt", "hello", "--regex", "([a-z"]
    assert worker_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: regex: ") and "unclosed character class" in err, err


def test_generate_exits_1_when_the_request_fails(capsys, text_dir, monkeypatch):
    def broken_push(self, token_id):
        raise RuntimeError("injected detokenizer fault")

    monkeypatch.setattr(TextOutput, "push", broken_push)  # a fault of this request only
    argv = ["generate", "--model", str(text_dir), "--prompt", "hello", "--max-new-tokens", "4"]
    assert worker_main([*argv, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["finish_reason"] == "error"
    assert worker_main(argv) == 1
    assert "error: RuntimeError: injected detokenizer fault" in capsys.readouterr().out


def test_generate_refuses_chat_without_a_text_prompt(capsys, text_dir):
    assert worker_main(["generate", "--model", str(text_dir), "--token-ids", "[1, 2]", "--chat"]) == 2
    assert "--chat goes with --prompt" in capsys.readouterr().err


def _parsers():
    """Every command line of qil and its scripts, by name: (name, parser)."""
    import argparse

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import loadtest
    finally:
        sys.path.pop(0)
    from qil_client.__main__ import _parser as client_parser
    from qil_worker.__main__ import build_parser

    found = []

    def walk(name, parser):
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(f"{name} {sub_name}", sub)

    walk("qil_worker", build_parser())
    walk("qil_client", client_parser())
    walk("loadtest.py", loadtest.build_parser())
    return found


def _undocumented(parser) -> list[str]:
    """Arguments without a one-line help, or whose help leaves out a default that says something
    (None, False and empty defaults are described by the help itself)."""
    import argparse

    bad = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        if not action.help:
            bad.append(f"{name}: no help")
            continue
        shown = parser._get_formatter()._expand_help(action)
        if "\n" in shown:
            bad.append(f"{name}: more than one line")
        default = action.default
        says_something = not (default is None or default is False or default == "" or default == [])
        if says_something and "default" not in shown:
            bad.append(f"{name}: its default {default!r} is not shown")
    return bad


@pytest.mark.parametrize("name", [name for name, _ in _parsers()])
def test_every_flag_has_help_and_its_default(name):
    (parser,) = [p for n, p in _parsers() if n == name]
    assert _undocumented(parser) == []
    parser.format_help()  # every help string formats (a stray % would raise here)


def test_qil_worker_help_summarises_the_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        worker_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m qil_worker ")
    assert "``" not in out  # not a docstring
    for command in ("serve", "generate"):
        assert any(line.split()[:1] == [command] and len(line.split()) > 1 for line in out.splitlines()), out


def test_serve_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        worker_main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for shown in ("(default: 127.0.0.1)", "(default: 50051)", "(default: cpu)", "(default: 512)",
                  "(default: 1024)", "(default: 5)", "(default: 10.0)", "(default: fcfs)"):
        assert shown in out, shown


def test_generate_without_a_model_uses_the_demo_model_as_serve_does(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("QIL_CACHE_DIR", str(tmp_path))
    out = json.loads(gen(capsys, "--token-ids", "[1,2,3]", "--max-new-tokens", "3", "--json"))
    from qil_worker.model.demo import demo_dir

    (want,) = Engine(Qwen3.from_directory(demo_dir()), num_pages=16, page_size=8).generate([[1, 2, 3]], 3)
    assert out["output_token_ids"] == want.output_token_ids
