"""The OpenAI-compatible HTTP API with the official ``openai`` SDK (sync and async, streaming
and not) against a real server and worker: every endpoint and parameter, greedy output equal to
gRPC ``Generate``, exact usage, both logprobs shapes, and the SSE framing byte for byte.

One server (front in a thread, worker in a spawned process) on a tiny random model whose
vocabulary is a locally trained byte-level BPE with a chat template.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from checkpoints import make_text_checkpoint
from qil_client import Client
from service_fixtures import http_base_url, openai_client, start_http_server

ENGINE = dict(num_pages=128, page_size=8, token_budget=256, prefill_chunk=64, max_active=16)
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld 🙂"}]
GREEDY = dict(temperature=0)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("http-text"))


@pytest.fixture(scope="module")
def server(text_dir):
    srv = start_http_server(text_dir, engine=ENGINE, served_model_name="tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    with openai_client(server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.target, timeout=60) as c:
        yield c


def test_models_lists_the_served_name(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].object == "model"
    assert oai.models.retrieve("tiny").id == "tiny"


def test_served_model_name_defaults_to_the_directory(text_dir):
    from qil_worker.service.front.http.context import served_model_name

    assert served_model_name(str(text_dir), None) == text_dir.name
    assert served_model_name(str(text_dir) + "/", None) == text_dir.name
    assert served_model_name(None, None) == "qil-demo"
    assert served_model_name(None, "mine") == "mine"


def test_completion_greedy_equals_grpc_generate(oai, grpc_client):
    ref = grpc_client.generate(text="the quick brown fox", max_new_tokens=12, ignore_eos=True)
    out = oai.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=12,
                                 extra_body={"ignore_eos": True}, **GREEDY)
    choice = out.choices[0]
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == "tiny"
    assert out.usage.prompt_tokens == ref.num_prompt_tokens
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == ref.num_prompt_tokens + 12


def test_completion_token_id_prompts_and_batches(oai, grpc_client):
    ids = grpc_client.tokenize("one two three").token_ids
    ref = grpc_client.generate(ids, max_new_tokens=6, ignore_eos=True)
    out = oai.completions.create(model="tiny", prompt=ids, max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(ids)
    ref2 = grpc_client.generate(text="four", max_new_tokens=6, ignore_eos=True)
    both = oai.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=6,
                                  extra_body={"ignore_eos": True}, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == ref.text
    assert both.usage.prompt_tokens == len(ids) + 2
    strings = oai.completions.create(model="tiny", prompt=["one two three", "four"], max_tokens=6,
                                     extra_body={"ignore_eos": True}, **GREEDY)
    assert [c.text for c in strings.choices] == [ref.text, ref2.text]
    assert strings.usage.completion_tokens == 12


def test_completion_stream_equals_non_stream(oai):
    kw = dict(model="tiny", prompt="a streamed prompt", max_tokens=10, extra_body={"ignore_eos": True}, **GREEDY)
    full = oai.completions.create(**kw)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_n_samples_differ_and_are_reproducible_with_a_seed(oai):
    kw = dict(model="tiny", prompt="sample me", max_tokens=8, n=3, seed=7, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    assert a.usage.completion_tokens == 24
    one = oai.completions.create(model="tiny", prompt="sample me", max_tokens=8, seed=7, temperature=1.0,
                                 extra_body={"ignore_eos": True})
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once


def test_stop_strings_and_stop_token_ids(oai, grpc_client):
    ref = grpc_client.generate(text="stop here", max_new_tokens=12, ignore_eos=True)
    stop = ref.text[3:6]
    assert stop and stop in ref.text
    out = oai.completions.create(model="tiny", prompt="stop here", max_tokens=12, stop=stop,
                                 extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == ref.text[: ref.text.index(stop)]
    for_list = oai.completions.create(model="tiny", prompt="stop here", max_tokens=12, stop=[stop, "zzzz"],
                                      extra_body={"ignore_eos": True}, **GREEDY)
    assert for_list.choices[0].text == out.choices[0].text
    kept = oai.completions.create(model="tiny", prompt="stop here", max_tokens=12, stop=stop, **GREEDY,
                                  extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == ref.text[: ref.text.index(stop) + len(stop)]
    by_id = oai.completions.create(model="tiny", prompt="stop here", max_tokens=12, **GREEDY,
                                   extra_body={"ignore_eos": True, "stop_token_ids": [ref.token_ids[2]]})
    assert by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == ref.token_ids.index(ref.token_ids[2]) + 1


def test_sampling_parameters_reach_the_engine(oai, grpc_client):
    params = dict(temperature=0.8, top_p=0.9, seed=11, presence_penalty=0.5, frequency_penalty=0.3)
    extras = dict(top_k=20, min_p=0.05, repetition_penalty=1.2, min_tokens=3, ignore_eos=True)
    ref = grpc_client.generate(text="knobs", max_new_tokens=10, **params, top_k=20, min_p=0.05,
                               repetition_penalty=1.2, min_new_tokens=3, ignore_eos=True)
    out = oai.completions.create(model="tiny", prompt="knobs", max_tokens=10, **params, extra_body=extras)
    assert out.choices[0].text == ref.text


def test_default_temperature_is_the_apis(oai, grpc_client):
    """Absent, temperature is 1 (the API's default), not the engine's greedy 0."""
    ref = grpc_client.generate(text="defaults", max_new_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    out = oai.completions.create(model="tiny", prompt="defaults", max_tokens=10, seed=3,
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.text


def test_completion_logprobs_shape(oai, grpc_client):
    ref = grpc_client.generate(text="logprobs please", max_new_tokens=5, ignore_eos=True, logprobs=True,
                               top_logprobs=3)
    out = oai.completions.create(model="tiny", prompt="logprobs please", max_tokens=5, logprobs=3,
                                 extra_body={"ignore_eos": True}, **GREEDY)
    lp = out.choices[0].logprobs
    strings = {t: grpc_client.detokenize([t], skip_special_tokens=False) for t in ref.token_ids}
    assert lp.tokens == [strings[t] for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx(ref.logprobs, abs=1e-6)
    for top, cands, t, tlp in zip(lp.top_logprobs, ref.top_logprobs, ref.token_ids, ref.logprobs):
        expected = {grpc_client.detokenize([c], skip_special_tokens=False): v for c, v in cands}
        expected[strings[t]] = tlp
        assert top == pytest.approx(expected, abs=1e-6)
    # each token's offset: the characters of the text before the text it released (a token
    # that ends inside a character releases none: the next one has the same offset)
    text = out.choices[0].text
    assert text == ref.text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] <= len(text)
    streamed = list(oai.completions.create(model="tiny", prompt="logprobs please", max_tokens=5, logprobs=3,
                                           stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in streamed for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_echo_prepends_the_prompt(oai, grpc_client):
    out = oai.completions.create(model="tiny", prompt="echo this", max_tokens=4, echo=True,
                                 extra_body={"ignore_eos": True}, **GREEDY)
    plain = oai.completions.create(model="tiny", prompt="echo this", max_tokens=4,
                                   extra_body={"ignore_eos": True}, **GREEDY)
    assert out.choices[0].text == "echo this" + plain.choices[0].text
    ids = grpc_client.tokenize("echo this").token_ids
    by_ids = oai.completions.create(model="tiny", prompt=ids, max_tokens=4, echo=True,
                                    extra_body={"ignore_eos": True}, **GREEDY)
    assert by_ids.choices[0].text == "echo this" + plain.choices[0].text
    streamed = list(oai.completions.create(model="tiny", prompt="echo this", max_tokens=4, echo=True, stream=True,
                                           extra_body={"ignore_eos": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_chat_greedy_equals_grpc_generate(oai, grpc_client):
    ref = grpc_client.generate(messages=MESSAGES, max_new_tokens=10, ignore_eos=True)
    out = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=10,
                                      extra_body={"ignore_eos": True}, **GREEDY)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.text
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.usage.prompt_tokens == ref.num_prompt_tokens
    assert out.usage.completion_tokens == 10
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    legacy = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10,
                                         extra_body={"ignore_eos": True}, **GREEDY)
    assert legacy.choices[0].message.content == ref.text


def test_chat_text_parts_and_template_kwargs(oai, grpc_client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "héllo "}, {"type": "text", "text": "wörld"}]}]
    joined = [{"role": "user", "content": "héllo wörld"}]
    a = oai.chat.completions.create(model="tiny", messages=parts, max_tokens=6, **GREEDY)
    b = oai.chat.completions.create(model="tiny", messages=joined, max_tokens=6, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    for thinking in (True, False):
        ref = grpc_client.generate(messages=joined, max_new_tokens=6, enable_thinking=thinking)
        out = oai.chat.completions.create(model="tiny", messages=joined, max_tokens=6, **GREEDY,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        assert out.usage.prompt_tokens == ref.num_prompt_tokens
        assert out.choices[0].message.content == ref.text


def test_chat_default_max_tokens_is_the_rest_of_the_context(oai, grpc_client):
    info = grpc_client.info()
    room = min(info.model.max_position_embeddings, ENGINE["num_pages"] * ENGINE["page_size"] + 1)
    prompt = grpc_client.tokenize(messages=MESSAGES).num_tokens
    out = oai.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    assert out.choices[0].finish_reason in ("stop", "length")
    if out.choices[0].finish_reason == "length":
        assert out.usage.completion_tokens == room - prompt
    assert out.usage.prompt_tokens == prompt


def test_chat_stream_role_first_and_usage_last(oai):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    full = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    no_usage = list(oai.chat.completions.create(stream=True, **kw))
    assert all(c.usage is None for c in no_usage)


def test_chat_n_streams_every_choice(oai):
    chunks = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, n=2, seed=1,
                                              temperature=1.0, stream=True, extra_body={"ignore_eos": True}))
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    done = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(done) == [0, 1]


def test_chat_logprobs_shape(oai, grpc_client):
    ref = grpc_client.generate(messages=MESSAGES, max_new_tokens=4, ignore_eos=True, logprobs=True,
                               top_logprobs=2)
    out = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True,
                                      top_logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry, t, lp, cands in zip(content, ref.token_ids, ref.logprobs, ref.top_logprobs):
        s = grpc_client.detokenize([t], skip_special_tokens=False)
        assert entry.token == s and entry.bytes == list(s.encode())
        assert entry.logprob == pytest.approx(lp, abs=1e-6)
        assert [(c.token, c.logprob) for c in entry.top_logprobs] == [
            (grpc_client.detokenize([c], skip_special_tokens=False), pytest.approx(v, abs=1e-6)) for c, v in cands
        ]
    plain = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **GREEDY)
    assert plain.choices[0].logprobs is None
    streamed = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True,
                                                top_logprobs=2, stream=True, extra_body={"ignore_eos": True},
                                                **GREEDY))
    assert [e.token for c in streamed if c.choices[0].logprobs for e in c.choices[0].logprobs.content] == [
        e.token for e in content
    ]


def test_async_client_stream_and_not(server):
    async def main():
        async with openai.AsyncOpenAI(base_url=http_base_url(server), api_key="x", max_retries=0) as c:
            kw = dict(model="tiny", messages=MESSAGES, max_tokens=6, extra_body={"ignore_eos": True}, **GREEDY)
            full, stream = await asyncio.gather(
                c.chat.completions.create(**kw), c.chat.completions.create(stream=True, **kw))
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream])
            comp = await c.completions.create(model="tiny", prompt="async", max_tokens=3, **GREEDY)
            return full, text, comp

    full, text, comp = asyncio.run(main())
    assert full.choices[0].message.content == text
    assert comp.usage.completion_tokens <= 3


def test_sse_framing_byte_for_byte(server):
    """Raw httpx: the exact bytes of a stream (ids and timestamps replaced)."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{http_base_url(server)}/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert resp.headers["cache-control"] == "no-cache"
        raw = b"".join(resp.iter_raw())
    events = raw.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    assert all(e.startswith(b"data: {") for e in events[:-2])
    assert b"\r" not in raw and not any(b"\n" in e for e in events)
    first = json.loads(events[0][len(b"data: "):])
    head = {"id": first["id"], "object": "text_completion", "created": first["created"], "model": "tiny"}
    assert list(first) == ["id", "object", "created", "model", "choices", "usage"]
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-2]]
    assert [{k: c[k] for k in head} for c in chunks] == [head] * len(chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    assert chunks[-1]["usage"]["prompt_tokens"] == 3
    expected = b"".join(
        b"data: " + json.dumps(c, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for c in chunks
    ) + b"data: [DONE]\n\n"
    assert raw == expected


def test_health_and_no_metrics_route_without_metrics(server):
    assert httpx.get(f"http://127.0.0.1:{server.http_port}/health").status_code == 200
    assert httpx.get(f"http://127.0.0.1:{server.http_port}/metrics").status_code == 404


def test_logit_bias_forces_a_token(oai, grpc_client):
    forced = grpc_client.tokenize("z").token_ids[0]
    out = oai.completions.create(model="tiny", prompt="bias", max_tokens=4, logit_bias={str(forced): 100},
                                 extra_body={"ignore_eos": True}, **GREEDY)
    ref = grpc_client.generate(text="bias", max_new_tokens=4, ignore_eos=True, logit_bias={forced: 100.0})
    assert ref.token_ids == [forced] * 4
    assert out.choices[0].text == ref.text
    chat = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, logit_bias={str(forced): 100},
                                       extra_body={"ignore_eos": True}, **GREEDY)
    assert chat.choices[0].message.content == "z" * 3


def test_echo_with_logprobs_scores_the_prompt(oai, grpc_client):
    """lm-eval's loglikelihood: echo, logprobs, max_tokens 0 → the prompt's logprobs only."""
    ids = grpc_client.tokenize("score this prompt").token_ids
    ref = grpc_client.generate(ids, max_new_tokens=1, prompt_logprobs=2)
    strings = {t: grpc_client.detokenize([t], skip_special_tokens=False) for t in ids}
    for prompt in ("score this prompt", ids):
        out = oai.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2, **GREEDY)
        choice = out.choices[0]
        assert choice.text == "score this prompt"
        assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
        lp = choice.logprobs
        assert lp.tokens == [strings[t] for t in ids]
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(ref.prompt_logprobs, abs=1e-6)
        assert lp.top_logprobs[0] is None and len(lp.top_logprobs) == len(ids)
        for top, t, v in zip(lp.top_logprobs[1:], ids[1:], ref.prompt_logprobs):
            assert top[strings[t]] == pytest.approx(v, abs=1e-6) and 1 <= len(top) <= 3
        assert lp.text_offset == [sum(len(strings[t]) for t in ids[:i]) for i in range(len(ids))]
    gen = oai.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=1,
                                 extra_body={"ignore_eos": True}, **GREEDY)
    assert len(gen.choices[0].logprobs.tokens) == len(ids) + 3
    assert gen.usage.completion_tokens == 3
    streamed = list(oai.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=1,
                                           stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == gen.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in streamed) == gen.choices[0].text


BOOL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
               "additionalProperties": False}


def test_json_schema_response_validates(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": BOOL_SCHEMA, "strict": True}}
    out = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=48, response_format=fmt, **GREEDY)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), BOOL_SCHEMA)
    streamed = list(oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=48, response_format=fmt,
                                                stream=True, **GREEDY))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == out.choices[0].message.content
    guided = oai.completions.create(model="tiny", prompt="json:", max_tokens=48, extra_body={"guided_json": BOOL_SCHEMA},
                                    **GREEDY)
    jsonschema.validate(json.loads(guided.choices[0].text), BOOL_SCHEMA)


def test_json_object_regex_and_choice(oai):
    # (a prompt whose greedy object closes within the budget on this random model; thinking
    # off, so the object starts at once rather than after a reasoning block the model may open)
    obj = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=48,
                                      response_format={"type": "json_object"}, **GREEDY,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    regex = oai.completions.create(model="tiny", prompt="abc:", max_tokens=16, extra_body={"guided_regex": "[a-c]{3}"},
                                   **GREEDY)
    assert re.fullmatch("[a-c]{3}", regex.choices[0].text)
    choice = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16,
                                         extra_body={"guided_choice": ["yes", "no"]}, **GREEDY)
    assert choice.choices[0].message.content in ("yes", "no")


def test_n_is_one_request_per_prompt_and_streams_as_it_answers(oai, server):
    """The engine's n: one request per prompt (its prompt computed once), choice p * n + j its
    sample j; the stream's choices add up to the answer's."""
    front = server.server.front
    before = front.num_requests_total
    kw = dict(model="tiny", prompt=["p one", "p two"], max_tokens=6, n=3, seed=5, temperature=1.0,
              extra_body={"ignore_eos": True})
    full = oai.completions.create(**kw)
    assert front.num_requests_total == before + 2
    assert [c.index for c in full.choices] == list(range(6))
    assert full.usage.completion_tokens == 36
    texts: dict[int, str] = {}
    finish = {}
    for chunk in oai.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert [texts[i] for i in range(6)] == [c.text for c in full.choices]
    assert finish == {i: "length" for i in range(6)}
    echo = dict(model="tiny", prompt="p one", max_tokens=2, n=2, echo=True, logprobs=1, seed=1, temperature=1.0,
                extra_body={"ignore_eos": True})
    answer = oai.completions.create(**echo)
    tokens: dict[int, list] = {}
    for chunk in oai.completions.create(stream=True, **echo):
        for ch in chunk.choices:
            tokens.setdefault(ch.index, []).extend(ch.logprobs.tokens)
    for i in range(2):
        assert tokens[i] == answer.choices[i].logprobs.tokens
        assert answer.choices[i].text.startswith("p one")
