"""Tool calls over gRPC through ``qil_client`` (sync and asyncio) against a real server and
worker, on the tiny random model with a Qwen3-style template with tools (``tool_fixtures``):
the calls come back parsed on the final event and in ``Result.tool_calls``, each matching its
function's schema, and stream as deltas on the events; reasoning and content apart; a
constraint after thinking; ``none`` never opens a block; Tokenize with tools; the interplay
with n, stop strings, max_new_tokens, logprobs, seeds and cancel; bad tools refused naming the
field."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from qil_client import AsyncClient, Client, InvalidArgument, StreamedCalls, pb
from service_fixtures import start_server, wait_until
from tool_fixtures import ADD, BOOK, SCHEMAS, TOOLS, WEATHER, make_tool_checkpoint

ENGINE = dict(num_pages=2048, page_size=8, token_budget=512, prefill_chunk=256, max_active=16)
ASK = [{"role": "user", "content": "hello world"}]
CALLS = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, enable_thinking=False,
             max_new_tokens=1500, temperature=1.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(make_tool_checkpoint(tmp_path_factory.mktemp("svc-tools")), engine=ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with Client(server.target, timeout=120) as c:
        yield c


def check(call) -> None:
    assert call.id.startswith("call_")
    jsonschema.validate(call.args, SCHEMAS[call.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_calls_come_back_parsed_and_valid(client, seed):
    result = client.generate(seed=seed, **CALLS)
    assert result.finish_reason == "stop"
    assert len(result.tool_calls) == 1
    check(result.tool_calls[0])
    assert result.content is not None and not result.content.strip()
    assert "<tool_call>" in result.text  # the whole output is still the text
    assert json.loads(result.text.split("\n")[1])["arguments"] == result.tool_calls[0].args


def test_a_named_function_and_the_async_client(server):
    async def run():
        async with AsyncClient(server.target, timeout=120) as c:
            return await asyncio.gather(*(c.generate(**{**CALLS, "tool_choice": "add", "seed": s}) for s in (4, 5)))

    for result in asyncio.run(run()):
        assert [c.name for c in result.tool_calls] == ["add"]
        check(result.tool_calls[0])


def test_the_final_event_carries_the_calls_for_every_subscriber(client):
    events = list(client.stream(seed=6, **CALLS))
    final = events[-1]
    assert final.finished and len(final.tool_calls) == 1
    again = client.generate(seed=6, **CALLS)
    assert (final.tool_calls[0].name, final.tool_calls[0].arguments) == \
        (again.tool_calls[0].name, again.tool_calls[0].arguments)


def _streamed(events) -> tuple[str, str, list]:
    calls = StreamedCalls()
    for ev in events:
        calls.add(ev)
    return ("".join(e.reasoning_delta for e in events), "".join(e.content_delta for e in events),
            [(c.id, c.name, c.arguments) for c in calls.calls()])


def test_events_stream_the_calls_as_deltas_that_join_to_the_final_ones(server, client):
    events = list(client.stream(seed=9, **{**CALLS, "parallel_tool_calls": True}))
    final = events[-1]
    reasoning, content, calls = _streamed(events)
    assert calls and calls == [(c.id, c.name, c.arguments) for c in final.tool_calls]
    assert (reasoning, content) == (final.reasoning, final.content)
    assert sum(bool(e.tool_call_deltas) for e in events) > 1  # fragments, not only the end
    assert all("<" not in e.content_delta for e in events)

    async def run():
        async with AsyncClient(server.target, timeout=120) as c:
            return [ev async for ev in c.stream(seed=9, **{**CALLS, "parallel_tool_calls": True})]

    # the same seed over the asyncio client: the same calls (ids are per request)
    assert [c[1:] for c in _streamed(asyncio.run(run()))[2]] == [c[1:] for c in calls]


def test_n_samples_each_carry_their_calls(client):
    result = client.generate(seed=8, n=2, **CALLS)
    assert [s.sample_index for s in result.samples] == [0, 1]
    for sample in result.samples:
        check(sample.tool_calls[0])


# ---------------------------------------------------------------- interplay


def test_max_new_tokens_inside_a_call_claims_no_call(client):
    whole = client.generate(**{**CALLS, "tools": [BOOK], "seed": 1})
    assert whole.finish_reason == "stop" and len(whole.token_ids) > 30
    # the same seed cut halfway: inside the arguments (the block's head is a dozen tokens)
    events = list(client.stream(**{**CALLS, "tools": [BOOK], "max_new_tokens": len(whole.token_ids) // 2, "seed": 1}))
    final = events[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and not final.tool_calls
    assert "<tool_call>" not in final.content
    # its start streamed (the deltas say what came), but the final event claims no call
    streamed = StreamedCalls()
    for ev in events:
        streamed.add(ev)
    [partial] = streamed.calls()
    assert partial.name == "book"
    with pytest.raises(ValueError):
        json.loads(partial.arguments)


def test_a_stop_string_inside_a_block_claims_no_call(client):
    cut = client.generate(**{**CALLS, "tools": [ADD], "seed": 3, "stop_strings": ['"arguments"']})
    assert cut.finish_reason == "stop" and cut.stop_reason == '"arguments"' and not cut.tool_calls
    assert "<tool_call>" not in cut.content
    never = client.generate(**{**CALLS, "tools": [ADD], "seed": 3, "stop_strings": ["never written"]})
    plain = client.generate(**{**CALLS, "tools": [ADD], "seed": 3})
    assert [c.arguments for c in never.tool_calls] == [c.arguments for c in plain.tool_calls] != []


def test_logprobs_cover_every_token_of_a_call(client):
    result = client.generate(**{**CALLS, "tools": [ADD], "seed": 3}, logprobs=True)
    check(result.tool_calls[0])
    assert len(result.logprobs) == len(result.token_ids) == result.num_output_tokens
    assert all(lp <= 0.0 for lp in result.logprobs)


def test_a_stream_left_inside_a_call_cancels_its_request(client):
    for ev in client.stream(**{**CALLS, "tools": [BOOK], "max_new_tokens": 3000, "seed": 1}):
        if ev.tool_call_deltas:
            break  # the call has started: leaving the loop cancels the request
    wait_until(lambda: (lambda i: i.num_unfinished == 0 and i.pages.used == 0)(client.info()), timeout=30)
    check(client.generate(**{**CALLS, "tools": [ADD], "seed": 1}).tool_calls[0])


def test_history_with_calls_and_results_is_rendered(client):
    history = [
        {"role": "user", "content": "add 2 and 3"},
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="add", arguments='{"a": 2, "b": 3}')]),
        pb.ChatMessage(role="tool", content="5", tool_call_id="c1"),
    ]
    plain = client.generate(messages=history[:1], tools=[ADD, WEATHER], tool_choice="none", max_new_tokens=1)
    longer = client.generate(messages=history, tools=[ADD, WEATHER], tool_choice="none", max_new_tokens=1)
    assert longer.num_prompt_tokens > plain.num_prompt_tokens
    assert not longer.tool_calls  # choice none: no calls parsed
    # Tokenize with the same tools and history counts what the submit rendered
    counted = client.tokenize(messages=history, tools=[ADD, WEATHER])
    assert counted.num_tokens == longer.num_prompt_tokens > client.tokenize(messages=history).num_tokens
    with pytest.raises(InvalidArgument) as info:
        client.tokenize(messages=history, tools=[{"name": "bad name"}])
    assert info.value.field == "tools[0].function.name"


def test_none_never_opens_a_block_however_the_model_leans(client):
    tag = client.tokenize(text="<tool_call>").token_ids
    assert len(tag) == 1
    out = client.generate(messages=ASK, tools=TOOLS, tool_choice="none", logit_bias={tag[0]: 100.0}, seed=1,
                          temperature=1.0, max_new_tokens=40, enable_thinking=False)
    assert out.finish_reason == "length" and not out.tool_calls
    assert tag[0] not in out.token_ids and "<tool_call>" not in out.content


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_a_constraint_applies_to_the_answer_after_thinking(client):
    think, close = (client.tokenize(text=t).token_ids[0] for t in ("<think>", "</think>"))
    bias = {think: 30.0, close: 2.0}  # opens a reasoning block, soon closes it
    answer = client.generate(messages=ASK, json_schema=ANSWER, logit_bias=bias, seed=4, temperature=1.0,
                             max_new_tokens=1500)
    assert answer.reasoning and answer.text.startswith("<think>")
    jsonschema.validate(json.loads(answer.content), ANSWER)
    called = client.generate(messages=ASK, tools=[ADD], tool_choice="required", logit_bias=bias, seed=4,
                             temperature=1.0, max_new_tokens=1500)
    assert called.reasoning and [c.name for c in called.tool_calls] == ["add"]
    check(called.tool_calls[0])
    off = client.generate(messages=ASK, json_schema=ANSWER, logit_bias=bias, seed=4, temperature=1.0,
                          max_new_tokens=1500, enable_thinking=False)
    assert not off.reasoning and "<think>" not in off.text
    jsonschema.validate(json.loads(off.content), ANSWER)


@pytest.mark.parametrize("kw, field", [
    (dict(tools=[{"name": "bad name"}]), "tools[0].function.name"),
    (dict(tools=[pb.Tool(name="f", parameters="{not json")]), "tools[0].function.parameters"),
    (dict(tools=[ADD], tool_choice="nope"), "tool_choice.function.name"),
    (dict(tools=[ADD], json_object=True), "json_object"),
    (dict(messages=[pb.ChatMessage(role="tool", content="5")]), "messages[0].tool_call_id"),
])
def test_bad_tools_are_invalid_argument_naming_the_field(client, kw, field):
    with pytest.raises(InvalidArgument) as info:
        client.generate(**{"messages": ASK, "max_new_tokens": 2, **kw})
    assert info.value.field == field, str(info.value)
