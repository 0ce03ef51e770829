"""Tools validated from the API's shapes (``structured.tools``) and the grammar their calls are
held to (``structured.tool_grammar``), fed fixed texts through llguidance's matcher with a
local tokenizer: once with the tags as tokens of their own (Qwen3's), once spelled in text."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402

from checkpoints import make_tokenizer  # noqa: E402
from qil_worker.errors import InvalidRequestError  # noqa: E402
from qil_worker.structured.compiler import tags_as_tokens  # noqa: E402
from qil_worker.structured.thinking import after_thinking  # noqa: E402
from qil_worker.structured.tool_grammar import TAGS, parses_calls, tool_constraint, tool_grammar  # noqa: E402
from qil_worker.structured.tools import tool_request  # noqa: E402
from tool_fixtures import ADD, TOOLS, WEATHER  # noqa: E402

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module", params=["tag tokens", "tags in text"])
def tokenizer(request, tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tool-tok"))
    if request.param == "tag tokens":
        tok.add_tokens(list(TAGS))
    info = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    return tok, info, frozenset(tags_as_tokens(tok, info))


def accepts(tokenizer, text: str, choice="auto", thinking=False, parallel=None, tools=TOOLS) -> bool:
    """Whether the grammar takes ``text`` whole and may end there."""
    tok, info, tags = tokenizer
    grammar = tool_grammar(tool_constraint(tool_request(tools, choice, parallel)), tags)
    if thinking is not False:  # as a chat prompt's ConstraintSpec.after_thinking
        grammar = after_thinking(grammar, tags)
    matcher = llguidance.LLMatcher(info, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for t in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(t):
            return False
    return matcher.is_accepting()


def test_the_tags_are_found_as_tokens_only_where_they_are(tokenizer):
    tok, _, tags = tokenizer
    assert tags == (frozenset(TAGS) if len(tok) > 300 else frozenset())


@pytest.mark.parametrize("text, ok", [
    (CALL, True),
    (CALL + "\n" + WEATHER_CALL, True),  # parallel calls
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', False),  # b is required
    ('<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 2}}\n</tool_call>', False),
    ('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', False),
    ('<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>', False),  # Qwen3's spacing only
    ("no call", False),
    (CALL[:-3], False),  # not closed
])
def test_required_takes_calls_that_match_a_schema_and_nothing_else(tokenizer, text, ok):
    assert accepts(tokenizer, text, "required") is ok


def test_parallel_false_and_a_named_function_take_one_call_of_it(tokenizer):
    assert not accepts(tokenizer, CALL + "\n" + CALL, "required", parallel=False)
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert accepts(tokenizer, WEATHER_CALL, named)
    assert not accepts(tokenizer, CALL, named)
    assert not accepts(tokenizer, WEATHER_CALL + "\n" + WEATHER_CALL, named)


@pytest.mark.parametrize("text, ok", [
    ("just words", True),
    ("", True),
    ("let me add " + CALL + " done", True),
    ("let me add " + CALL + "\n" + WEATHER_CALL, True),
    ('oops <tool_call>\nnot json', False),  # once the block opens, only a call may follow
    ('x <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "2"}}\n</tool_call>', False),
])
def test_auto_is_free_text_until_a_block_opens(tokenizer, text, ok):
    assert accepts(tokenizer, text, "auto") is ok


@pytest.mark.parametrize("text, ok", [
    ("just an answer, no calls", True),
    ("let me add " + CALL, False),  # the tag never opens (as a token it is masked)
    ("<tool_call", True),  # text that only starts like the tag
])
def test_none_is_free_text_that_never_opens_a_block(tokenizer, text, ok):
    assert accepts(tokenizer, text, "none") is ok
    assert not parses_calls(tool_constraint(tool_request(TOOLS, "none")))
    assert parses_calls(tool_constraint(tool_request(TOOLS, "auto")))


def test_thinking_comes_before_the_constrained_answer_unless_turned_off(tokenizer):
    thought = "<think>\nsome {not json} thoughts\n</think>\n\n"
    assert accepts(tokenizer, thought + CALL, "required", thinking=None)
    assert not accepts(tokenizer, thought + CALL, "required", thinking=False)
    assert accepts(tokenizer, thought + "plain answer", "auto", thinking=True)


def test_arguments_match_strict_and_non_strict_schemas(tokenizer):
    # ADD is strict (no other properties); WEATHER's enum and maxLength hold too
    assert not accepts(tokenizer, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}\n</tool_call>',
                       "required", tools=[ADD])
    assert not accepts(tokenizer, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "k"}}\n'
                       "</tool_call>", "required", tools=[WEATHER])


def test_equal_requests_give_equal_constraints():
    a = tool_constraint(tool_request(TOOLS, "required"))
    b = tool_constraint(tool_request(json.loads(json.dumps(TOOLS)), "required"))
    assert a == b and a != tool_constraint(tool_request(TOOLS, "auto"))


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "\ud800"}}}}}], None, "tools[0].function.parameters.properties.s.pattern"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"o": {"type": "object", "properties": {}}},
        "required": ["o"], "additionalProperties": False}}}], None, "tools[0].function.parameters.properties.o"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        f"p{i}": {"type": "string", "description": "d" * 1000} for i in range(120)}}}}], None,
     "tools[0].function.parameters"),
    (None, {"type": "function", "function": {"name": "f"}}, "tool_choice"),
])
def test_bad_tools_name_their_field(tools, choice, field):
    with pytest.raises(InvalidRequestError) as info:
        tool_request(tools, choice)
    assert info.value.field == field, str(info.value)
