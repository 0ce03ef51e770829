"""Tool calling and reasoning over the OpenAI-compatible HTTP API, with the official ``openai``
SDK against a real server and worker, on a tiny random model whose tokenizer has a Qwen3-style
chat template with tools (``tool_fixtures``).

The random model never chooses to call a tool, so what is tested is what the server
guarantees whatever the model: ``tool_choice`` required or named gives calls that parse and
validate against their function's schema for every seed; under ``auto`` a block the model
opens (a logit bias on ``<tool_call>`` makes it open one) closes as a valid call; prompts are
the template's rendering of the tools and the API's messages, as transformers renders them.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from service_fixtures import openai_client, start_http_server
from tool_fixtures import ADD, BOOK, NO_ARGS, SCHEMAS, TOOLS, WEATHER, make_tool_checkpoint

ENGINE = dict(num_pages=2048, page_size=8, token_budget=512, prefill_chunk=256, max_active=16)
ASK = [{"role": "user", "content": "hello world"}]
SEEDS = (1, 2, 3, 4)
SAMPLED = dict(temperature=1.0)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}  # a short answer the model must give


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tool_checkpoint(tmp_path_factory.mktemp("http-tools"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = start_http_server(model_dir, engine=ENGINE, served_model_name="tiny")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server):
    with openai_client(server, timeout=120) as c:
        yield c


def valid_call(call) -> dict:
    """The arguments of a returned call, checked against its function's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


# ---------------------------------------------------------------- the prompt


def test_the_prompt_is_the_templates_rendering_of_tools_and_tool_messages(oai, tokenizer):
    history = [
        {"role": "user", "content": "what is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    out = oai.chat.completions.create(model="tiny", messages=history, tools=[ADD, WEATHER], max_tokens=2,
                                      tool_choice="none", temperature=0)
    # transformers' rendering of the same conversation, arguments as the object they stand for
    expected = tokenizer.apply_chat_template(
        [history[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
         history[2]],
        tools=[ADD, WEATHER], add_generation_prompt=True, tokenize=False)
    assert "<tools>" in expected and '"arguments": {"a": 2, "b": 3}' in expected
    assert out.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False))


def test_tokenize_with_tools_counts_what_the_chat_call_renders(oai, server):
    import httpx

    history = [
        {"role": "user", "content": "what is 2 + 3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    root = f"http://127.0.0.1:{server.http_port}"
    chat = oai.chat.completions.create(model="tiny", messages=history, tools=[ADD, WEATHER], max_tokens=1,
                                       tool_choice="none", temperature=0, extra_body=NO_THINKING)
    counted = httpx.post(f"{root}/tokenize", json={"messages": history, "tools": [ADD, WEATHER], **NO_THINKING},
                         timeout=60).json()
    bare = httpx.post(f"{root}/tokenize", json={"messages": history, **NO_THINKING}, timeout=60).json()
    assert counted["count"] == chat.usage.prompt_tokens > bare["count"]
    bad = {"type": "function", "function": {"name": "bad name"}}
    refused = httpx.post(f"{root}/tokenize", json={"messages": history, "tools": [bad]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools[0].function.name"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters.type"),
    ({"tools": [ADD, ADD]}, "tools[1].function.name"),
    ({"tools": [ADD], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [ADD] * 129}, "tools"),
    ({"tools": [ADD], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
])
def test_bad_tools_are_refused_naming_the_field(oai, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="tiny", **{"messages": ASK, "max_tokens": 4, **body})
    error = info.value.body
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}: "), error


# ---------------------------------------------------------------- constrained calls


@pytest.mark.parametrize("seed", SEEDS)
def test_required_gives_calls_that_match_their_schemas(oai, seed):
    out = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                      max_tokens=1500, seed=seed, **SAMPLED, extra_body=NO_THINKING)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        valid_call(call)


@pytest.mark.parametrize("tool", [WEATHER, ADD, BOOK, NO_ARGS], ids=lambda t: t["function"]["name"])
def test_a_named_function_is_called_with_valid_arguments(oai, tool):
    name = tool["function"]["name"]
    for seed in SEEDS[:2]:
        out = oai.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": name}},
            max_tokens=1500, seed=seed, **SAMPLED, extra_body=NO_THINKING)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert [c.function.name for c in choice.message.tool_calls] == [name]  # not parallel: one
        valid_call(choice.message.tool_calls[0])


def test_n_samples_each_make_their_own_valid_calls(oai):
    out = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                      max_tokens=1500, seed=7, **SAMPLED, extra_body=NO_THINKING)
    assert [c.index for c in out.choices] == [0, 1, 2]
    ids = set()
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            valid_call(call)
            ids.add(call.id)
    assert len(ids) == sum(len(c.message.tool_calls) for c in out.choices)  # ids are distinct


def test_max_tokens_inside_a_call_claims_no_call(oai):
    out = oai.chat.completions.create(model="tiny", messages=ASK, tools=[BOOK], tool_choice="required",
                                      max_tokens=12, seed=1, **SAMPLED, extra_body=NO_THINKING)
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert not choice.message.tool_calls
    assert "<tool_call>" not in (choice.message.content or "")


def test_seeded_calls_repeat(oai):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=1500, seed=11,
              **SAMPLED, extra_body=NO_THINKING)
    first, second = (oai.chat.completions.create(**kw).choices[0].message.tool_calls for _ in range(2))
    assert [(c.function.name, c.function.arguments) for c in first] == \
        [(c.function.name, c.function.arguments) for c in second]


def test_logprobs_cover_every_token_of_a_call(oai):
    out = oai.chat.completions.create(model="tiny", messages=ASK, tools=[ADD], tool_choice="required",
                                      parallel_tool_calls=False, max_tokens=1500, seed=3, **SAMPLED, logprobs=True,
                                      extra_body=NO_THINKING)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    tokens = "".join(t.token for t in choice.logprobs.content)
    call = choice.message.tool_calls[0]
    assert tokens.startswith("<tool_call>") and json.loads(call.function.arguments) == \
        json.loads(tokens.split("\n")[1])["arguments"]
    assert len(choice.logprobs.content) == out.usage.completion_tokens


# ---------------------------------------------------------------- auto


def test_auto_blocks_the_model_opens_close_as_valid_calls(oai, tokenizer):
    tag = tokenizer.convert_tokens_to_ids("<tool_call>")
    calls = 0
    for seed in SEEDS:
        out = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=1500, seed=seed,
                                          logit_bias={str(tag): 6}, **SAMPLED, extra_body=NO_THINKING)
        choice = out.choices[0]
        assert "<tool_call>" not in (choice.message.content or "")
        # (the bias keeps the model calling: the output may end by length after some calls)
        for call in choice.message.tool_calls or []:
            valid_call(call)
            calls += 1
        if choice.finish_reason == "stop":
            assert not choice.message.tool_calls
    assert calls > 0  # the bias made the model open blocks


def test_none_never_opens_a_block_however_the_model_leans(oai, tokenizer):
    tag = tokenizer.convert_tokens_to_ids("<tool_call>")
    out = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=40,
                                      seed=1, logit_bias={str(tag): 100}, **SAMPLED, extra_body=NO_THINKING)
    choice = out.choices[0]
    # the bias would make the tag the first token; under none the mask keeps it out
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and "<tool_call>" not in choice.message.content
    # none leaves room for a response_format of the caller's
    shaped = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=400,
                                         seed=1, response_format={"type": "json_schema", "json_schema": {
                                             "name": "answer", "schema": ANSWER}}, **SAMPLED, extra_body=NO_THINKING)
    jsonschema.validate(json.loads(shaped.choices[0].message.content), ANSWER)


def test_auto_without_a_block_is_plain_content(oai, server):
    free = oai.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=20, temperature=0,
                                       extra_body=NO_THINKING)
    choice = free.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content


# ---------------------------------------------------------------- streaming


def test_streamed_call_deltas_reassemble_to_the_calls(oai):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=1500, seed=5,
              **SAMPLED, extra_body=NO_THINKING)
    whole = oai.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    starts = []
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            assert not delta.content, "no call text leaks into content"
            for d in delta.tool_calls or []:
                if d.id is not None:
                    starts.append(d.index)
                    assert d.function.name and d.type == "function"
                    calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    assert d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert reasons == ["tool_calls"]
    assert starts == sorted(set(starts)) == list(range(len(whole.message.tool_calls)))
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_the_sdks_stream_helper_gets_the_same_calls(oai):
    kw = dict(model="tiny", messages=ASK, tools=[ADD, WEATHER], tool_choice="required", max_tokens=1500, seed=2,
              parallel_tool_calls=False,
              **SAMPLED, extra_body=NO_THINKING)
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    with oai.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == \
        [(c.function.name, c.function.arguments) for c in whole]
    for call in got:
        valid_call(call)


# ---------------------------------------------------------------- reasoning


def test_thinking_comes_back_as_reasoning_content_and_the_call_after_it(oai, tokenizer):
    think, close = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    out = oai.chat.completions.create(model="tiny", messages=ASK, tools=[ADD], tool_choice="required",
                                      max_tokens=1500, seed=4, logit_bias={str(think): 30, str(close): 2},
                                      **SAMPLED)
    choice = out.choices[0]
    # the bias opens a reasoning block and soon closes it (neither tag may come inside it, nor
    # in ADD's arguments); the constraint lets the model think first, then call
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content
    assert "<think>" not in (choice.message.content or "") and "</think>" not in choice.message.reasoning_content
    valid_call(choice.message.tool_calls[0])
    assert 0 < out.usage.completion_tokens_details.reasoning_tokens < out.usage.completion_tokens


@pytest.mark.parametrize("thinking", [None, False])
def test_a_response_format_applies_to_the_answer_after_thinking(oai, tokenizer, thinking):
    think, close = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    out = oai.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=1500, seed=4, logit_bias={str(think): 30, str(close): 2}, **SAMPLED,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
        extra_body={} if thinking is None else NO_THINKING)
    message = out.choices[0].message
    jsonschema.validate(json.loads(message.content), ANSWER)
    reasoning = (message.model_extra or {}).get("reasoning_content")
    if thinking is None:  # the template's default, thinking on: the bias opens a free block first
        assert reasoning and "</think>" not in reasoning
    else:  # thinking off: no block may open, however the bias pulls
        assert not reasoning and "<think>" not in message.content


# ---------------------------------------------------------------- interplay


def stream_calls(stream) -> tuple[dict[int, dict[int, dict]], dict[int, str]]:
    """{choice: {call index: {name, arguments}}} and {choice: finish reason} of a stream."""
    calls: dict[int, dict[int, dict]] = {}
    reasons: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            assert not (choice.delta.content or "").strip(), "no call text leaks into content"
            for d in choice.delta.tool_calls or []:
                own = calls.setdefault(choice.index, {})
                if d.id is not None:
                    own[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                else:
                    own[d.index]["arguments"] += d.function.arguments
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return calls, reasons


def test_streamed_samples_each_reassemble_to_valid_calls(oai):
    calls, reasons = stream_calls(oai.chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=2,
        max_tokens=1500, seed=9, **SAMPLED, extra_body=NO_THINKING, stream=True))
    assert reasons == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        [call] = calls[index].values()
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_stop_string_inside_a_block_claims_no_call(oai):
    kw = dict(model="tiny", messages=ASK, tools=[ADD], tool_choice="required", max_tokens=1500, seed=3,
              **SAMPLED, extra_body=NO_THINKING)
    out = oai.chat.completions.create(**kw, stop=['"arguments"'])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert "<tool_call>" not in (choice.message.content or "")
    # a stop string the call never writes changes nothing
    free = oai.chat.completions.create(**kw, stop=["never written"]).choices[0]
    plain = oai.chat.completions.create(**kw).choices[0]
    assert free.finish_reason == "tool_calls"
    assert free.message.tool_calls[0].function.arguments == plain.message.tool_calls[0].function.arguments


def test_a_stream_left_inside_a_call_cancels_its_request(oai, server):
    from qil_client import Client
    from service_fixtures import wait_until

    stream = oai.chat.completions.create(model="tiny", messages=ASK, tools=[BOOK], tool_choice="required",
                                         max_tokens=3000, seed=1, **SAMPLED, extra_body=NO_THINKING, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.tool_calls:
            break  # the call has started: leave
    stream.close()
    with Client(server.target, timeout=30) as c:
        wait_until(lambda: (lambda i: i.num_unfinished == 0 and i.pages.used == 0)(c.info()), timeout=30)
    # and the server serves the next call as before
    again = oai.chat.completions.create(model="tiny", messages=ASK, tools=[ADD], tool_choice="required",
                                        max_tokens=1500, seed=1, **SAMPLED, extra_body=NO_THINKING)
    valid_call(again.choices[0].message.tool_calls[0])


def test_streamed_reasoning_comes_as_reasoning_deltas(oai, tokenizer):
    think, close = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    kw = dict(model="tiny", messages=ASK, tools=[ADD], tool_choice="required", max_tokens=1500, seed=4,
              logit_bias={str(think): 30, str(close): 2}, **SAMPLED)
    whole = oai.chat.completions.create(**kw).choices[0].message
    reasoning, content = "", ""
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert reasoning and reasoning == whole.model_extra["reasoning_content"]
    assert "<think>" not in content and "</think>" not in content and "<think>" not in reasoning
