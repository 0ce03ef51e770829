"""Command-line contracts a plausible bug would break silently (found by mutation testing):
``qil_worker generate`` flags against the in-process engine, ``serve`` flag bounds and their way
into the configuration, the client CLI's output and exit codes (against a stand-in client), and
the client's results."""
import argparse
import json

import pytest

import qil_client.__main__ as client_cli
from checkpoints import make_text_checkpoint
from qil_client import pb
from qil_client.errors import error_for
from qil_client.results import ResultBuilder
from qil_worker import Engine, Qwen3
from qil_worker.__main__ import main as worker_main
from qil_worker.service.cli import add_serve_parser, config_from_args, run_serve
from qil_worker.text import load_tokenizer
from qil_worker.text.output import TextOutput


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


# ---- serve flags ----------------------------------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


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
    assert cfg.metrics_host == "0.0.0.0" and cfg.front.threads == 3
    assert cfg.front.max_stream_backlog == 7 and cfg.front.retain_seconds == 1.5 and cfg.front.max_restarts == 9
    monkeypatch.setenv("QIL_AUTH_TOKEN", "")
    assert config_from_args(_parse([])).auth_token is None


def test_tls_cert_without_key_is_refused(capsys):
    assert run_serve(_parse(["--tls-cert", "cert.pem", "--port", "0"])) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err


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


# ---- the client CLI, against a stand-in client ----------------------------------------------


class FakeClient:
    last = None

    def __init__(self, target, token=None, tls=None):
        self.target, self.token, self.tls = target, token, tls
        self.calls = []
        FakeClient.last = self

    def wait_ready(self, t):
        self.calls.append(("wait_ready", t))

    def health(self):
        self.calls.append(("health",))
        return "SERVING"

    def cancel(self, *rids, timeout=None):
        return {rids[0]: True, rids[1]: False}

    def stream(self, timeout=None, **kw):
        self.calls.append(("stream", kw))
        return iter(self.events)

    def submit(self, timeout=None, **kw):
        raise error_for(3, "temperature: bad", "temperature")

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(client_cli, "Client", FakeClient)
    FakeClient.events = []
    return FakeClient


def final(seq, reason, **kw):
    return pb.Event(request_id="r", seq=seq, finished=True, finish_reason=reason, **kw)


@pytest.mark.parametrize("reason, rc", [(pb.FINISH_REASON_LENGTH, 0), (pb.FINISH_REASON_STOP, 0),
                                        (pb.FINISH_REASON_CANCELLED, 1), (pb.FINISH_REASON_ERROR, 1)])
def test_generate_exit_code_follows_the_finish_reason(fake, reason, rc):
    fake.events = [pb.Event(request_id="r", seq=0, token_ids=[5]), final(1, reason)]
    assert client_cli.main(["generate", "--token-ids", "[1]"]) == rc


def test_text_mode_prints_only_text_even_for_empty_deltas(fake, capsys):
    fake.events = [pb.Event(request_id="r", seq=0, token_ids=[5], text="a"),
                   pb.Event(request_id="r", seq=1, token_ids=[6], text=""),
                   final(2, pb.FINISH_REASON_LENGTH, text="b")]
    assert client_cli.main(["generate", "--prompt", "x"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "ab"


def test_server_error_exit_code_is_1(fake, capsys):
    assert client_cli.main(["submit", "--token-ids", "[1]", "--temperature", "-1"]) == 1
    assert "(field temperature)" in capsys.readouterr().err


def test_cancel_output(fake, capsys):
    assert client_cli.main(["cancel", "a", "b"]) == 0
    assert capsys.readouterr().out == "a\tcancelled\nb\tnot active\n"


def test_health_does_not_wait_for_serving(fake):
    assert client_cli.main(["health"]) == 0
    assert FakeClient.last.calls == [("health",)]


def test_flags_reach_the_client(fake):
    fake.events = [final(0, pb.FINISH_REASON_LENGTH)]
    assert client_cli.main(["--tls", "--token", "tok", "generate", "--prompt", "hi", "--stop-token-ids", "[7, 8]"]) == 0
    c = FakeClient.last
    assert c.tls is True and c.token == "tok"
    kw = c.calls[-1][1]
    assert kw["stop_token_ids"] == [7, 8] and kw["text"] == "hi" and "messages" not in kw


def test_result_text_is_empty_not_none_when_all_deltas_are_empty():
    b = ResultBuilder()
    b.add(pb.Event(request_id="r", seq=0, token_ids=[1], text=""))
    b.add(final(1, pb.FINISH_REASON_LENGTH, text=""))
    assert b.result().text == ""


def test_result_error_and_metrics():
    b = ResultBuilder()
    b.add(final(0, pb.FINISH_REASON_LENGTH, metrics=pb.RequestMetrics(mean_itl_s=0.1, max_itl_s=0.9)))
    r = b.result()
    assert r.error is None
    assert r.metrics.mean_itl_s == pytest.approx(0.1) and r.metrics.max_itl_s == pytest.approx(0.9)
