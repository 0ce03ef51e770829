"""Qwen3's assistant output split into reasoning, content and tool calls, on fixed strings: whole
and streamed across every possible boundary, with cut-off and malformed blocks."""

from __future__ import annotations

import json

import pytest

from qil_worker.text.assistant_output import (
    AssistantOutput, CallArguments, CallEnd, CallStart, Content, Reasoning, ToolCall, parse,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "when": {"day": 2}}}\n</tool_call>'
TWO = CALL + "\n" + '<tool_call>\n{"name": "search", "arguments": {"q": "a \\"}\\" b"}}\n</tool_call>'


def streamed(text: str, cuts: list[int], thinking: bool = False, tools: bool = True) -> list:
    """The parts of ``text`` fed in pieces cut at ``cuts``."""
    out, parts, start = AssistantOutput(thinking, tools), [], 0
    for cut in [*cuts, len(text)]:
        parts += out.feed(text[start:cut])
        start = cut
    return parts + out.finish()


def joined(parts: list) -> tuple[str, str, list[tuple[str, str]], list]:
    """(reasoning, content, [(name, arguments streamed)], ends) of a part stream."""
    reasoning = "".join(p.text for p in parts if isinstance(p, Reasoning))
    content = "".join(p.text for p in parts if isinstance(p, Content))
    names = {p.index: p.name for p in parts if isinstance(p, CallStart)}
    args: dict[int, str] = {}
    for p in parts:
        if isinstance(p, CallArguments):
            args[p.index] = args.get(p.index, "") + p.text
    ends = [(p.index, p.arguments) for p in parts if isinstance(p, CallEnd)]
    return reasoning, content, [(names[i], args.get(i, "")) for i in sorted(names)], ends


def test_calls_text_around_them_and_reasoning():
    text = "<think>\nthe user wants weather\n</think>\n\nLet me look." + TWO + " Done."
    out = parse(text)
    assert out.reasoning == "\nthe user wants weather\n"
    assert out.content == "Let me look.\n Done."
    assert out.tool_calls == [
        ToolCall("get_weather", '{"city": "Paris", "when": {"day": 2}}'),
        ToolCall("search", '{"q": "a \\"}\\" b"}', 1),
    ]
    assert [json.loads(c.arguments) for c in out.tool_calls] == [{"city": "Paris", "when": {"day": 2}}, {"q": 'a "}" b'}]
    assert not out.broken_calls


def test_a_prompt_that_opened_the_reasoning():
    out = parse("still thinking</think>\n\nthe answer", thinking=True)
    assert (out.reasoning, out.content) == ("still thinking", "the answer")
    assert parse("no reasoning here").reasoning == ""
    assert parse("a <think> later is text").content == "a <think> later is text"


def test_every_streaming_boundary_gives_the_whole_parse():
    text = "<think>x</think>\n\nbefore " + TWO + " after <tool_"
    whole = parse(text)
    for cut in range(len(text) + 1):
        reasoning, content, calls, ends = joined(streamed(text, [cut]))
        assert (reasoning, content) == (whole.reasoning, whole.content), cut
        assert calls == [(c.name, c.arguments) for c in whole.tool_calls], cut
        assert ends == [(0, whole.tool_calls[0].arguments), (1, whole.tool_calls[1].arguments)], cut
    # one character at a time: no tag ever leaks into content or reasoning
    parts = streamed(text, list(range(1, len(text))))
    assert all("<tool_call" not in p.text and "</think" not in p.text for p in parts if isinstance(p, (Content, Reasoning)))
    assert joined(parts)[1] == whole.content == "before \n after <tool_"


def test_the_name_goes_out_before_the_arguments_and_they_stream():
    parts = streamed(CALL, list(range(1, len(CALL))))
    kinds = [type(p).__name__ for p in parts]
    assert kinds[0] == "CallStart" and kinds[-1] == "CallEnd"
    assert kinds.count("CallArguments") > 10  # fragments, not one piece at the end
    first_arguments = next(i for i, p in enumerate(parts) if isinstance(p, CallArguments))
    assert first_arguments < len(parts) - 2


def test_a_block_cut_off_or_malformed_is_no_call():
    cut = CALL[: len(CALL) // 2]
    out = parse("x " + cut)
    assert out.tool_calls == [] and out.content == "x " and out.broken_calls == [cut[len("<tool_call>"):]]
    parts = streamed(cut, [5, 20])
    assert [p for p in parts if isinstance(p, CallEnd)] == [CallEnd(0, None, cut[len("<tool_call>"):])]
    bad = parse('<tool_call>{"name": "f", "arguments": [1]}</tool_call><tool_call>not json</tool_call>')
    assert bad.tool_calls == [] and bad.broken_calls == ['{"name": "f", "arguments": [1]}', "not json"]


def test_keys_in_the_other_order_still_make_a_call():
    out = streamed('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', [7, 30])
    assert joined(out)[2] == [("f", '{"a": 1}')] and joined(out)[3] == [(0, '{"a": 1}')]


@pytest.mark.parametrize("text", ["plain", "<tool_call> is not a call without tools"])
def test_without_tools_blocks_are_content(text):
    assert parse(text, tools=False).content == text and parse(text, tools=False).tool_calls == []
