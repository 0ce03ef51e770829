"""Tokenize and Detokenize over gRPC: a prompt's ids are exactly a Submit's (transformers' own
``encode`` and chat template are the oracle), ids come back to the text output events carry, bad
input and missing tokenizers are the statuses Submit gives, and a pending call survives neither
a dead worker (UNAVAILABLE) nor its caller's deadline (no entry left behind). A long text is
tokenized on the worker's encoding thread while other requests run to their end."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import threading

import grpc
import pytest

from checkpoints import make_text_checkpoint
from qil_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    QilError,
    Unauthenticated,
    Unavailable,
    pb,
)
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from service_fixtures import start_server, wait_until

ENGINE = dict(num_pages=128, page_size=8, token_budget=256, prefill_chunk=64, max_active=16)
MULTIBYTE = "héllo wörld 中文字符 🙂🚀"
TEXTS = ["hello world", MULTIBYTE, "a <|im_end|> b", "the quick brown fox\n\njumps"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello 中文 world"}]


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    # room for the long texts below: a Tokenize of more tokens than the model's positions is refused
    return make_text_checkpoint(tmp_path_factory.mktemp("svc-tokenize"), max_position_embeddings=32768)


@pytest.fixture(scope="module")
def tokenizer(text_dir):
    from qil_worker.text import load_tokenizer

    return load_tokenizer(text_dir)


@pytest.fixture(scope="module")
def server(text_dir):
    srv = start_server(text_dir, engine=ENGINE, restart_backoff_s=0.2)
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with Client(server.target, timeout=60) as c:
        yield c


def _submitted_prompt_tokens(target: str, **prompt) -> int:
    """SubmitResponse.num_prompt_tokens of a Submit of this prompt (then cancelled)."""
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.InferenceStub(ch)
        resp = stub.Submit(pb.SubmitRequest(max_new_tokens=1, **prompt), timeout=30)
        stub.Cancel(pb.CancelRequest(request_ids=[resp.request_id]), timeout=30)
    return resp.num_prompt_tokens


def _chat_ids(tokenizer, messages, **kw) -> list[int]:
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_text_is_the_tokenizers_encoding_and_the_submits_count(server, client, tokenizer, text):
    got = client.tokenize(text)
    assert got.token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert got.num_tokens == len(got.token_ids) == _submitted_prompt_tokens(server.target, text=text)
    assert got.num_tokens == client.generate(text=text, max_new_tokens=1).num_prompt_tokens
    assert got.max_position_embeddings == client.info().model.max_position_embeddings > 0


@pytest.mark.parametrize("thinking", [None, True, False])
def test_tokenize_messages_renders_the_chat_template_as_submit_does(server, client, tokenizer, thinking):
    kw = {} if thinking is None else {"enable_thinking": thinking}
    got = client.tokenize(messages=CHAT, enable_thinking=thinking)
    assert got.token_ids == _chat_ids(tokenizer, CHAT, **kw)
    wire = [pb.ChatMessage(**m) for m in CHAT]
    assert got.num_tokens == _submitted_prompt_tokens(server.target, messages=wire, **kw)
    assert got.num_tokens == client.generate(messages=CHAT, max_new_tokens=1, **kw).num_prompt_tokens


def test_enable_thinking_changes_the_rendering(client):
    """(So the test above compares renderings that differ, not one rendering three times.)"""
    on, off = (client.tokenize(messages=CHAT, enable_thinking=t).token_ids for t in (True, False))
    assert on != off


def test_an_empty_prompt_is_zero_tokens(client):
    assert client.tokenize().token_ids == [] and client.tokenize("").num_tokens == 0


def test_a_long_text_over_grpc_gets_the_tokenizers_ids(client, tokenizer):
    """Over the inline limit: tokenized on the worker's encoding thread (the test below shows
    that others run meanwhile, at the worker's loop, where it can be observed)."""
    from qil_worker.service.worker.prompt_encoder import INLINE_CHARS

    text = ("hello world, qil serves 中文 " * (INLINE_CHARS // 20 + 50))
    assert len(text) > INLINE_CHARS
    got = client.tokenize(text)
    assert got.token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert client.detokenize(got.token_ids) == text  # over the inline id count too


def test_bad_prompts_are_invalid_argument_naming_the_field(client):
    with pytest.raises(InvalidArgument) as exc:
        client.tokenize("hi", messages=[("user", "hi")])
    assert exc.value.field == "messages"
    with pytest.raises(InvalidArgument) as exc:  # what Submit says of the same messages
        client.tokenize(messages=[{"role": "robot", "content": "hi"}])
    assert exc.value.field == "messages[0]"


def test_detokenize_round_trips_and_matches_the_output_text(client, tokenizer):
    for text in TEXTS[:2] + TEXTS[3:]:
        assert client.detokenize(client.tokenize(text).token_ids) == text
    r = client.generate(text="hello world", max_new_tokens=24, ignore_eos=True)
    assert client.detokenize(r.token_ids) == r.text  # what the events carried
    assert client.detokenize([]) == ""


def test_skip_special_tokens_both_ways(client, tokenizer):
    ids = tokenizer.encode("a<|im_end|>b", add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    kept = client.detokenize(ids, skip_special_tokens=False)
    assert kept == "a<|im_end|>b"
    skipped = client.detokenize(ids)
    assert skipped == client.detokenize(ids, skip_special_tokens=True) == "ab"
    assert skipped == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_ids_outside_the_vocabulary_are_invalid_argument_naming_token_ids(client):
    vocab = client.info().model.vocab_size
    for ids in ([1, vocab], [2**32 - 1]):
        with pytest.raises(InvalidArgument) as exc:
            client.detokenize(ids)
        assert exc.value.field == "token_ids" and str(ids[-1]) in exc.value.details
    assert client.detokenize([vocab - 1]) is not None  # the last id is in


def test_an_answer_over_the_message_limit_is_resource_exhausted(client, monkeypatch):
    """A request under the limit can expand past it; the limit is lowered here (the front runs
    in this process) so that a small request shows it."""
    from qil_client import ResourceExhausted
    from qil_worker.service.front import limits

    ids = client.tokenize("the quick brown fox jumps over the lazy dog " * 40).token_ids
    text = client.detokenize(ids)
    monkeypatch.setattr(limits, "MAX_MESSAGE_BYTES", min(len(ids), len(text)) - 8)
    with pytest.raises(ResourceExhausted) as exc:
        client.tokenize(text)
    assert "message limit" in exc.value.details
    with pytest.raises(ResourceExhausted):
        client.detokenize(ids)
    monkeypatch.undo()
    assert client.detokenize(ids) == text


def test_the_async_client(server, tokenizer):
    async def run():
        async with AsyncClient(server.target, timeout=60) as c:
            tok = await c.tokenize(messages=CHAT, enable_thinking=False)
            text = await c.detokenize(tok.token_ids, skip_special_tokens=False)
            with pytest.raises(InvalidArgument):
                await c.detokenize([10**6])
            return tok, text

    tok, text = asyncio.run(run())
    assert tok.token_ids == _chat_ids(tokenizer, CHAT, enable_thinking=False)
    assert text == tokenizer.decode(tok.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_the_cli(server, tokenizer, capsys):
    from qil_client.__main__ import main

    base = ["--target", server.target]
    assert main(base + ["tokenize", "--prompt", MULTIBYTE, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert out["token_ids"] == want and out["num_tokens"] == len(want) and out["max_position_embeddings"] > 0
    assert main(base + ["tokenize", "--prompt", "hello 中文 world", "--chat", "--system", "be brief",
                        "--no-thinking"]) == 0
    ids_line, count_line = capsys.readouterr().out.splitlines()
    assert json.loads(ids_line) == _chat_ids(tokenizer, CHAT, enable_thinking=False)
    assert count_line.startswith(f"{len(json.loads(ids_line))} tokens")
    assert main(base + ["tokenize", "--messages", json.dumps(CHAT), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == _chat_ids(tokenizer, CHAT)
    assert main(base + ["detokenize", "--token-ids", json.dumps(want)]) == 0
    assert capsys.readouterr().out == MULTIBYTE + "\n"
    special = json.dumps(tokenizer.encode("a<|im_end|>", add_special_tokens=False))
    assert main(base + ["detokenize", "--token-ids", special, "--keep-special-tokens", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"text": "a<|im_end|>"}
    assert main(base + ["detokenize", "--token-ids", "[99999999]"]) == 1
    assert "token_ids" in capsys.readouterr().err
    assert main(base + ["tokenize", "--messages", json.dumps(CHAT), "--chat"]) == 2  # refused before any call
    assert main(base + ["tokenize", "--prompt", "hi", "--system", "s"]) == 2


def test_a_call_whose_caller_gives_up_leaves_nothing_behind(server, client):
    """A stopped worker cannot answer: the deadline ends the call, the front forgets it, and
    the answer that comes once the worker runs again is dropped."""
    front = server.server.front  # this module's own in-thread server
    pid = client.info().worker.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(DeadlineExceeded):
            client.tokenize("hello world", timeout=1.0)
        with pytest.raises(DeadlineExceeded):
            client.detokenize([1, 2, 3], timeout=1.0)
        wait_until(lambda: front.num_pending_calls == 0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert client.tokenize("hello").token_ids  # the late answers were dropped, new calls work
    assert front.num_pending_calls == 0 and client.info().worker.pid == pid


def test_a_worker_that_dies_under_a_pending_call_fails_it_unavailable(server, client):
    front = server.server.front
    pid = client.info().worker.pid
    out: dict = {}

    def call():
        try:
            out["value"] = client.tokenize("hello world", timeout=30)
        except QilError as exc:
            out["error"] = exc

    os.kill(pid, signal.SIGSTOP)  # the call waits in the front until the worker is gone
    t = threading.Thread(target=call)
    t.start()
    wait_until(lambda: front.num_pending_calls == 1, timeout=20)
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    assert isinstance(out.get("error"), Unavailable), out
    assert front.num_pending_calls == 0
    wait_until(lambda: client.health() == "SERVING", timeout=120)
    assert client.info().worker.pid != pid and client.tokenize("hello").token_ids


# ---------------------------------------------------------------- servers without what it takes


def test_without_a_tokenizer_both_are_failed_precondition(text_dir):
    with start_server(text_dir, engine=ENGINE, use_tokenizer=False) as srv:
        with Client(srv.target, timeout=60) as c:
            for call, field in (
                (lambda: c.tokenize("hello"), "text"),
                (lambda: c.tokenize(messages=CHAT), "messages"),
                (lambda: c.tokenize(), "text"),
                (lambda: c.detokenize([1, 2]), "token_ids"),
            ):
                with pytest.raises(FailedPrecondition) as exc:
                    call()
                assert exc.value.field == field


def test_messages_without_a_chat_template_are_failed_precondition(text_dir, tmp_path):
    plain = tmp_path / "no-template"
    shutil.copytree(text_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    with start_server(plain, engine=ENGINE) as srv:
        with Client(srv.target, timeout=60) as c:
            assert not c.info().model.has_chat_template
            with pytest.raises(FailedPrecondition) as exc:
                c.tokenize(messages=CHAT)
            assert exc.value.field == "messages"
            assert c.tokenize("hello").token_ids  # text needs no template


def test_both_need_the_bearer_token_and_reflection_lists_them(text_dir):
    from grpc_reflection.v1alpha import reflection_pb2

    token = "tok-3n"
    with start_server(text_dir, engine=ENGINE, auth_token=token) as srv:
        for wrong in (None, "wrong"):
            with Client(srv.target, token=wrong, timeout=30) as c:
                with pytest.raises(Unauthenticated):
                    c.tokenize("hello")
                with pytest.raises(Unauthenticated):
                    c.detokenize([1])
        with Client(srv.target, token=token, timeout=30) as c:
            assert c.detokenize(c.tokenize("hello").token_ids) == "hello"
        with grpc.insecure_channel(srv.target) as ch:
            call = ch.stream_stream(
                "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
            )
            ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol="qil.v1.Inference")
            (resp,) = call(iter([ask]), metadata=(("authorization", f"Bearer {token}"),), timeout=10)
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in resp.file_descriptor_response.file_descriptor_proto]
    methods = {m.name for f in files for s in f.service if s.name == "Inference" for m in s.method}
    assert {"Tokenize", "Detokenize", "Submit"} <= methods


# ---------------------------------------------------------------- at the worker's loop


class _BlockingTokenizer:
    """A tokenizer whose ``encode`` of a long text waits for a signal: a prompt that takes long."""

    def __init__(self, tokenizer, long_chars: int):
        self._tokenizer = tokenizer
        self._long = long_chars
        self.release = threading.Event()
        self.blocked = threading.Event()

    def encode(self, text, *args, **kwargs):
        if len(text) > self._long:
            self.blocked.set()
            assert self.release.wait(30)
        return self._tokenizer.encode(text, *args, **kwargs)

    def __len__(self):
        return len(self._tokenizer)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_long_tokenize_runs_beside_the_loop_while_another_request_ends(text_dir, monkeypatch):
    """The worker loop over a real pipe: a Tokenize whose encode is held runs on the encoding
    thread; meanwhile a submit gets its ack and runs to its end, and a short Tokenize is answered
    in the loop. Once released, the long one's answer comes, with the tokenizer's ids."""
    from qil_worker import Engine, Qwen3
    from qil_worker.engine.spec import RequestSpec
    from qil_worker.service import protocol as P
    from qil_worker.service.worker import loop as worker
    from qil_worker.service.worker.prompt_encoder import INLINE_CHARS
    from qil_worker.text import load_tokenizer

    real = load_tokenizer(text_dir)
    tokenizer = _BlockingTokenizer(real, INLINE_CHARS)
    engine = Engine(Qwen3.from_directory(text_dir), num_pages=64, page_size=4, tokenizer=tokenizer)
    front, back = multiprocessing.Pipe()
    loop = threading.Thread(target=worker._serve, args=(back, engine, os.getppid()), daemon=True)
    loop.start()
    long_text = "hello world " * (INLINE_CHARS // 10)
    front.send(P.Tokenize(1, long_text, None, None))
    assert tokenizer.blocked.wait(30)  # the encoding thread holds it
    front.send(P.Submit(RequestSpec.of([1, 2, 3], 4, [], "fast", ignore_eos=True)))
    front.send(P.Tokenize(2, "hello", None, None))
    seen = []
    while not any(isinstance(m, P.StepBatch) and "fast" in m.finals for m in seen):
        assert front.poll(30), "the worker stopped answering"
        seen.append(front.recv())
    answers = [m for m in seen if isinstance(m, P.Tokenized)]
    assert [(a.call_id, a.token_ids) for a in answers] == [(2, real.encode("hello", add_special_tokens=False))]
    tokenizer.release.set()
    assert front.poll(30)
    answer = front.recv()
    assert isinstance(answer, P.Tokenized) and answer.call_id == 1 and answer.rejection is None
    assert answer.token_ids == real.encode(long_text, add_special_tokens=False)
    front.send(P.Detokenize(3, list(range(300)) * 20, False))  # over the inline id count: the thread
    assert front.poll(30)
    answer = front.recv()
    assert answer.call_id == 3 and answer.text == real.decode(
        list(range(300)) * 20, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    front.send(P.Stop())
    loop.join(10)
    assert not loop.is_alive() and engine.stats().num_pages_used == 0
