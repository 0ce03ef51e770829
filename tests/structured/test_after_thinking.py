"""A constraint after the model's reasoning (``ConstraintSpec.after_thinking``,
``structured.thinking``): every kind lets a free ``<think>...</think>`` block come first, then
holds the answer; without the flag the block is refused. Fixed texts through llguidance's
matcher with a local tokenizer, the tags as tokens of their own (Qwen3's) and spelled in text."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")
import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402

from checkpoints import make_tokenizer  # noqa: E402
from qil_worker.engine.spec import RequestSpec  # noqa: E402
from qil_worker.structured.compiler import grammar_text, tags_as_tokens  # noqa: E402
from qil_worker.structured.spec import ConstraintSpec  # noqa: E402
from qil_worker.structured.tool_grammar import TAGS  # noqa: E402

THOUGHT = "<think>\nfree {not json} <b> thoughts\n</think>\n\n"
SPECS = {  # kind → (its value, an answer it takes, one it refuses)
    "json_schema": ('{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
                    '{"a":12}', '{"b":1}'),
    "json_object": (True, '{"x":[1]}', "[1]"),
    "regex": ("[0-9]{3}", "123", "12a"),
    "grammar": ('start: "yes" | "no"', "no", "maybe"),
    "choice": (("red", "green"), "green", "blue"),
}


@pytest.fixture(scope="module", params=["tag tokens", "tags in text"])
def tokenizer(request, tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("think-tok"))
    if request.param == "tag tokens":
        tok.add_tokens(list(TAGS))
    info = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    return tok, info, frozenset(tags_as_tokens(tok, info))


def accepts(tokenizer, spec: ConstraintSpec, text: str) -> bool:
    tok, info, tags = tokenizer
    matcher = llguidance.LLMatcher(info, grammar_text(llguidance, spec, tags), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_kind_holds_the_answer_after_a_free_reasoning_block(tokenizer, kind):
    value, good, bad = SPECS[kind]
    after = ConstraintSpec(kind, value, after_thinking=True)
    assert accepts(tokenizer, after, THOUGHT + good)
    assert accepts(tokenizer, after, good)  # the block may be left out
    assert not accepts(tokenizer, after, THOUGHT + bad)
    assert not accepts(tokenizer, after, THOUGHT + THOUGHT + good)  # one block, first only
    plain = ConstraintSpec(kind, value)
    assert accepts(tokenizer, plain, good) and not accepts(tokenizer, plain, THOUGHT + good)


def test_a_chat_prompt_that_leaves_thinking_on_sets_the_flag():
    ask = [{"role": "user", "content": "hi"}]
    assert RequestSpec.of(messages=ask, json_object=True).constraint.after_thinking
    assert RequestSpec.of(messages=ask, enable_thinking=True, regex="a").constraint.after_thinking
    assert not RequestSpec.of(messages=ask, enable_thinking=False, json_object=True).constraint.after_thinking
    assert not RequestSpec.of(text="hi", json_object=True).constraint.after_thinking
    assert not RequestSpec.of([1, 2], json_object=True).constraint.after_thinking


def test_a_constraint_no_answer_can_match_is_refused_behind_the_block_too(tokenizer):
    """The block alone would match: the compiler probes the answer's start, as it checks a
    plain constraint's first mask."""
    from qil_worker.errors import InvalidRequestError
    from qil_worker.structured.compiler import GrammarCompiler

    tok = tokenizer[0]
    compiler = GrammarCompiler(tok, vocab_size=len(tok), eos_token_ids=[tok.eos_token_id])
    for after in (False, True):
        with pytest.raises(InvalidRequestError) as info:
            compiler.compile(ConstraintSpec("json_schema", '{"$ref": "#"}', after_thinking=after))
        assert info.value.field == "json_schema" and "no output can match" in str(info.value)
        assert compiler.compile(ConstraintSpec("json_object", True, after_thinking=after)) is not None
