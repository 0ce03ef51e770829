"""Hostile input, round two, against a real server (front and worker processes, gRPC and HTTP
on one front): counts that size something are refused before anything is made from them (a
``n`` of 4294967295 once grew the front until the kernel killed it), deep JSON and lone
surrogates are 400s naming the field, every 4xx message starts with its parameter, the
prompt is blamed when the prompt alone cannot fit, the grammar library's internal words are
translated, and a Tokenize of more tokens than the model has positions is refused from its
size. Then what the OpenAI API accepts and the server once refused (the ``developer`` role,
an empty prompt, ``reasoning_effort``) and vLLM's tokenizer routes.
"""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest

from checkpoints import make_text_checkpoint
from qil_client import Client, pb
from service_fixtures import serve_process, stop_server_process, wait_until
from raw_grpc import raw_call
from service_fixtures import rss

MAX_POSITIONS = 512  # the text checkpoint's
FAST_S = 1.0  # a refusal of a count takes well under this
PROMPT = [3, 4, 5, 6]


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    """(process, gRPC target, HTTP base URL, stderr lines) of ``serve --http-port`` on a text
    checkpoint: a tokenizer, a chat template and the structured-output library."""
    model = make_text_checkpoint(tmp_path_factory.mktemp("hostile-text"))
    proc, target, err = serve_process("--model", str(model), "--http-port", "0")
    http = proc.announcement.split("(HTTP on ", 1)[1].split(")")[0]
    yield proc, target, f"http://{http}", err
    stop_server_process(proc)


@pytest.fixture(scope="module")
def channel(text_server):
    ch = grpc.insecure_channel(text_server[1])
    yield ch
    ch.close()


def _idle(target: str) -> bool:
    with Client(target, timeout=10) as c:
        info = c.info()
    return info.num_unfinished == 0 and info.pages.used == 0


# ---------------------------------------------------------------------------- counts over gRPC

HUGE = 4294967295  # uint32's largest: what the wire allows for n, top_logprobs, prompt_logprobs


@pytest.mark.parametrize("method", ["Submit", "Generate", "StreamEvents"])
@pytest.mark.parametrize("request_, field", [
    (pb.SubmitRequest(token_ids=[5], max_new_tokens=2, n=HUGE), "n"),
    (pb.SubmitRequest(token_ids=[5], max_new_tokens=2, n=1_000_000), "n"),
    (pb.SubmitRequest(token_ids=[5], max_new_tokens=2, logprobs=True, top_logprobs=HUGE), "top_logprobs"),
    (pb.SubmitRequest(token_ids=[5], max_new_tokens=2, prompt_logprobs=HUGE), "prompt_logprobs"),
    (pb.SubmitRequest(token_ids=[5], max_new_tokens=2, logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (pb.SubmitRequest(token_ids=[5], max_new_tokens=2, stop_strings=["x"] * 17), "stop_strings"),
    (pb.SubmitRequest(token_ids=[5], max_new_tokens=2, choice=pb.Choices(choices=[str(i) for i in range(1025)])),
     "choice"),
])
def test_a_count_that_sizes_something_is_refused_at_once_without_growing_the_front(
        text_server, channel, method, request_, field):
    proc, target, _, _ = text_server
    before = rss(proc.pid)
    t0 = time.monotonic()
    code, details, answers = raw_call(channel, method, request_.SerializeToString())
    took = time.monotonic() - t0
    if method == "StreamEvents":  # answered in-band
        assert code == grpc.StatusCode.OK and len(answers) == 1
        error = answers[0].error
        details = f"{error.field}: {error.message}"
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], details
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith(f"{field}: "), details
    assert took < FAST_S, took
    assert rss(proc.pid) < before * 1.1
    assert wait_until(lambda: _idle(target))


# ---------------------------------------------------------------------------- HTTP bodies

def _post_raw(base: str, path: str, body: dict | str) -> httpx.Response:
    # ensure_ascii: a lone surrogate goes out as the \ud800 escape a hostile client would send
    content = body if isinstance(body, str) else json.dumps(body, ensure_ascii=True)
    return httpx.post(f"{base}{path}", content=content.encode(),
                      headers={"Content-Type": "application/json"}, timeout=60)


def _error(resp: httpx.Response, status: int, param: str | None) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    if param is not None:
        assert err["message"].startswith(f"{param}: "), err
    assert "Traceback" not in resp.text
    return err["message"]


def test_deep_json_is_a_400_naming_the_body_or_the_field(text_server):
    _, target, base, err = text_server
    deep = '{"prompt": "hi", "x": ' + "[" * 300 + "]" * 300 + "}"
    assert "nested deeper" in _error(_post_raw(base, "/v1/completions", deep), 400, "x")
    for levels in (980, 5000):  # at or past the parser's own limit (Python's recursion limit)
        deeper = '{"prompt": "hi", "x": ' + "[" * levels + "]" * levels + "}"
        assert "nested deeper" in _error(_post_raw(base, "/v1/completions", deeper), 400, "body")
    schema: dict = {"type": "string"}
    for _ in range(300):  # 600 levels: past the server's bound, within the encoders' recursion
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    _error(_post_raw(base, "/v1/chat/completions", body), 400, "response_format")
    # over gRPC, the schema's text: refused by the same rule, in the front
    with Client(target) as c:
        with pytest.raises(Exception, match="json_schema: .*nested deeper than 128 levels"):
            c.generate(text="hi", max_new_tokens=2, json_schema=json.dumps(schema))
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "ab\ud800cd", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "ab\udfffcd"], "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab\ud800cd"}], "max_tokens": 2}, "messages"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"], "max_tokens": 2}, "stop"),
    ("/tokenize", {"prompt": "ab\ud800cd"}, "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(text_server, path, body, param):
    _, target, base, _ = text_server
    assert "surrogate" in _error(_post_raw(base, path, body), 400, param)
    assert wait_until(lambda: _idle(target))


def test_a_valid_surrogate_pair_is_text(text_server):
    base = text_server[2]
    resp = _post_raw(base, "/v1/completions", {"prompt": "emoji \U0001F642", "max_tokens": 2})
    assert resp.status_code == 200, resp.text


# ---------------------------------------------------------------------------- blame

def test_the_prompt_is_blamed_when_the_prompt_alone_cannot_fit(text_server):
    _, target, base, _ = text_server
    long_ids = [5] * (MAX_POSITIONS + 10)
    _error(_post_raw(base, "/v1/completions", {"prompt": long_ids, "max_tokens": 4}), 400, "prompt")
    # a prompt that fits, with too many new tokens: max_tokens, as the caller named it
    _error(_post_raw(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": MAX_POSITIONS}), 400, "max_tokens")
    chat = [{"role": "user", "content": "hello world"}] * 400
    _error(_post_raw(base, "/v1/chat/completions", {"messages": chat, "max_tokens": 4}), 400, "messages")
    short = [{"role": "user", "content": "hi"}]
    _error(_post_raw(base, "/v1/chat/completions", {"messages": short, "max_tokens": MAX_POSITIONS}), 400,
           "max_tokens")
    _error(_post_raw(base, "/v1/chat/completions", {"messages": short, "max_completion_tokens": MAX_POSITIONS}),
           400, "max_completion_tokens")
    with Client(target) as c:
        with pytest.raises(Exception, match="token_ids: prompt"):
            c.generate(long_ids, max_new_tokens=4)
        with pytest.raises(Exception, match="text: prompt"):
            c.generate(text="hello world " * 400, max_new_tokens=4)


def test_the_grammar_librarys_refusals_are_in_plain_words(text_server):
    base = text_server[2]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#"}}}}
    message = _error(_post_raw(base, "/v1/chat/completions", body), 400, "response_format")
    assert "no output can match it" in message and "NoExtension" not in message and "<" not in message


def test_unsupported_parameters_name_themselves_in_the_message(text_server):
    base = text_server[2]
    body = {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]}
    assert _error(_post_raw(base, "/v1/chat/completions", body), 400, "functions") == \
        "functions: is not supported by this server"
    _error(_post_raw(base, "/v1/completions", {"prompt": PROMPT, "temperature": -1}), 400, "temperature")


# ---------------------------------------------------------------------------- Tokenize

def test_a_tokenize_that_no_request_could_carry_is_refused_from_its_size(text_server):
    proc, target, base, _ = text_server
    with Client(target, timeout=60) as c:
        assert c.tokenize(text="hello world").num_tokens > 0
        before = rss(proc.pid)
        t0 = time.monotonic()
        with pytest.raises(Exception, match=f"text: at least .* tokens, more than the model's {MAX_POSITIONS}"):
            c.tokenize(text="x" * (15 * 2**20))
        assert time.monotonic() - t0 < 5.0
        # a text just over: found while encoding (no size bound shows it), refused all the same
        with pytest.raises(Exception, match=f"text: .*tokens, more than the model's {MAX_POSITIONS}"):
            c.tokenize(text="hello world " * 400)
        wait_until(lambda: rss(proc.pid) < before * 1.1 + 20 * 2**20, timeout=30)


# ---------------------------------------------------------------------------- what the API accepts

def test_the_developer_role_is_the_system_role(text_server):
    base = text_server[2]
    as_dev = _post_raw(base, "/tokenize", {"messages": [{"role": "developer", "content": "be brief"},
                                                        {"role": "user", "content": "hi"}]})
    as_sys = _post_raw(base, "/tokenize", {"messages": [{"role": "system", "content": "be brief"},
                                                        {"role": "user", "content": "hi"}]})
    assert as_dev.status_code == 200, as_dev.text
    assert as_dev.json()["tokens"] == as_sys.json()["tokens"]
    out = _post_raw(base, "/v1/chat/completions", {"messages": [{"role": "developer", "content": "x"},
                                                                {"role": "user", "content": "hi"}],
                                                   "max_tokens": 2})
    assert out.status_code == 200, out.text


def test_an_empty_prompt_starts_a_document(text_server):
    base = text_server[2]
    out = _post_raw(base, "/v1/completions", {"prompt": "", "max_tokens": 3, "temperature": 0})
    assert out.status_code == 200, out.text
    assert out.json()["usage"]["prompt_tokens"] == 1  # <|endoftext|>, as the model saw before documents


def test_reasoning_effort_maps_to_the_thinking_switch(text_server):
    base = text_server[2]
    hi = [{"role": "user", "content": "hi"}]
    off = _post_raw(base, "/tokenize", {"messages": hi, "chat_template_kwargs": {"enable_thinking": False}})
    on = _post_raw(base, "/tokenize", {"messages": hi})
    none = _post_raw(base, "/tokenize", {"messages": hi, "reasoning_effort": "none"})
    high = _post_raw(base, "/tokenize", {"messages": hi, "reasoning_effort": "high"})
    assert none.json()["tokens"] == off.json()["tokens"] != on.json()["tokens"] == high.json()["tokens"]
    _error(_post_raw(base, "/v1/chat/completions", {"messages": hi, "reasoning_effort": "extreme"}), 400,
           "reasoning_effort")
    _error(_post_raw(base, "/v1/chat/completions", {"messages": hi, "reasoning_effort": "none",
                                                    "chat_template_kwargs": {"enable_thinking": True}}),
           400, "reasoning_effort")


def test_chat_streams_carry_no_empty_chunks(text_server):
    base = text_server[2]
    body = {"messages": [{"role": "user", "content": "héllo 中文 🙂"}], "max_tokens": 60, "stream": True,
            "temperature": 1.0, "seed": 3, "ignore_eos": True, "stop": ["zz"]}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    for choice in choices[1:]:
        assert choice["delta"].get("content") or choice["finish_reason"] is not None, choice
    assert choices[-1]["finish_reason"] is not None


def test_vllm_tokenizer_routes(text_server):
    _, target, base, _ = text_server
    with Client(target) as c:
        expected = list(c.tokenize(text="hello world").token_ids)
    out = _post_raw(base, "/tokenize", {"prompt": "hello world", "add_special_tokens": False,
                                        "return_token_strs": True}).json()
    assert out["tokens"] == expected and out["count"] == len(expected)
    assert out["max_model_len"] == MAX_POSITIONS and "".join(out["token_strs"]) == "hello world"
    back = _post_raw(base, "/detokenize", {"tokens": expected}).json()
    assert back == {"prompt": "hello world"}
    info = httpx.get(f"{base}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["pad_token"] == "<|endoftext|>"
    assert "<|im_start|>" in info["chat_template"]
    _error(_post_raw(base, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    _error(_post_raw(base, "/tokenize", {"prompt": 5}), 400, "prompt")
    _error(_post_raw(base, "/tokenize", {"prompt": "x", "model": "other"}), 404, "model")
