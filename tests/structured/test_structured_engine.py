"""Structured output in the engine: JSON schema / JSON object / regex / Lark grammar / choice
constraints on a random model with a locally trained tokenizer.

Random models write junk, so outputs are sampled with seeds: whenever a request ends with STOP
its output must be valid (jsonschema, re.fullmatch, one of the choices), and enough of them
must stop for the check to mean something. Then the interplay with the rest of the engine:
stop strings and ids, min/max_new_tokens, logprobs, seeds, batching, the prefix cache,
preemption, failures, and every KV page free afterwards.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import jsonschema
import pytest
import torch

from checkpoints import make_text_checkpoint
from engine_helpers import assert_pool_free, run_to_completion
from qil_worker import Engine, FinishReason, InvalidRequestError, Qwen3
from qil_worker.errors import FeatureUnavailableError
from qil_worker.service.errors import classify_engine_error
from qil_worker.service.protocol import RejectKind
from qil_worker.structured import MAX_CHOICES, MAX_CONSTRAINT_CHARS, ConstraintSpec
from qil_worker.structured.bitmask import GrammarMasks
from qil_worker.structured.compiler import GrammarCompiler
from qil_worker.text import load_tokenizer

PROMPTS = [[5, 6, 7], [11, 12], [40, 41, 42, 43], [7], [90, 91, 92], [30, 31]]
SAMPLED = dict(temperature=1.0)
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')

SCHEMAS = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "name": {"type": "string", "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array_of_enums": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
        "additionalProperties": False,
    },
    "bounded_integer": {"type": "integer", "minimum": -5, "maximum": 42},
    "array_of_objects": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
            },
            "label": {"enum": ["a", "b"]},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["points", "label"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def tokenizer(text_dir):
    return load_tokenizer(text_dir)


@pytest.fixture(scope="module")
def model(text_dir):
    return Qwen3.from_directory(text_dir)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return Engine(model, num_pages=128, page_size=8, tokenizer=tokenizer)


def new_engine(model, tokenizer, **kwargs) -> Engine:
    return Engine(model, **{"num_pages": 128, "page_size": 8, "tokenizer": tokenizer, **kwargs})


def stopped(results) -> list:
    return [r for r in results if r.finish_reason is FinishReason.STOP]


# -- outputs are valid -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_whenever_they_stop(engine, name):
    schema = SCHEMAS[name]
    results = []
    for seed in range(4):
        results += engine.generate(PROMPTS, max_new_tokens=96, json_schema=schema, seed=seed, **SAMPLED)
    done = stopped(results)
    assert len(done) >= len(results) // 2, [r.finish_reason for r in results]
    for r in done:
        value = json.loads(r.output_text)
        jsonschema.validate(value, schema)
        assert not re.search(r"\s", JSON_STRING.sub("", r.output_text)), "compact: no whitespace outside strings"
    assert len({r.output_text for r in done}) > 1, "seeds should give different outputs"
    assert_pool_free(engine)


def test_json_is_compact_and_in_the_schemas_property_order(engine):
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    done = stopped(engine.generate(PROMPTS, max_new_tokens=64, json_schema=schema, seed=1, **SAMPLED))
    assert done
    for r in done:
        assert re.fullmatch(r'\{"zeta":-?[0-9]+,"alpha":(true|false)\}', r.output_text), r.output_text


def test_json_object_outputs_parse_as_objects(engine):
    results = []
    for seed in range(3):  # a cooler temperature: free-form JSON strings end sooner
        results += engine.generate(PROMPTS, max_new_tokens=128, json_object=True, seed=seed, temperature=0.7)
    done = stopped(results)
    assert len(done) >= len(results) // 2
    values = [json.loads(r.output_text) for r in done]
    assert all(isinstance(v, dict) for v in values) and any(values), "some object is not empty"


@pytest.mark.parametrize(
    "pattern", [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)", r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5})?"]
)
def test_regex_outputs_full_match(engine, pattern):
    results = []
    for seed in range(3):
        results += engine.generate(PROMPTS, max_new_tokens=32, regex=pattern, seed=seed, **SAMPLED)
    done = stopped(results)
    assert len(done) >= len(results) // 2
    for r in done:
        assert re.fullmatch(pattern, r.output_text), r.output_text


def test_choice_returns_exactly_one_choice(engine):
    choices = ["yes", "no", "maybe so", 'a "quoted" \\ one', "中文 🙂"]
    results = []
    for seed in range(4):
        results += engine.generate(PROMPTS, max_new_tokens=32, choice=choices, seed=seed, **SAMPLED)
    assert all(r.finish_reason is FinishReason.STOP for r in results)
    assert all(r.output_text in choices for r in results)
    assert all(r.stop_reason is None for r in results)  # ended by the grammar, not by EOS
    assert len({r.output_text for r in results}) > 1


def test_lark_grammar_outputs_match(engine):
    grammar = 'start: "SELECT " COL (", " COL)* " FROM t"\nCOL: /[a-z]{1,4}/\n'
    results = []
    for seed in range(3):
        results += engine.generate(PROMPTS, max_new_tokens=48, grammar=grammar, seed=seed, **SAMPLED)
    done = stopped(results)
    assert len(done) >= len(results) // 2
    for r in done:
        assert re.fullmatch(r"SELECT [a-z]{1,4}(, [a-z]{1,4})* FROM t", r.output_text), r.output_text


def test_greedy_constrained_output_is_deterministic(engine):
    one = engine.generate(PROMPTS[:2], max_new_tokens=64, json_schema=SCHEMAS["nested_objects"])
    two = engine.generate(PROMPTS[:2], max_new_tokens=64, json_schema=SCHEMAS["nested_objects"])
    assert [r.output_token_ids for r in one] == [r.output_token_ids for r in two]


# -- the mask --------------------------------------------------------------------------------


def test_ids_beyond_the_tokenizer_are_never_allowed_and_eos_only_at_the_end(tokenizer):
    vocab = len(tokenizer) + 45  # a model's padded vocabulary
    eos = tokenizer.eos_token_id
    compiler = GrammarCompiler(tokenizer, vocab, [eos])
    masks = GrammarMasks()
    digits = compiler.compile(ConstraintSpec("regex", "[0-9]+")).new_matcher()
    anything = compiler.compile(ConstraintSpec("json_object", True)).new_matcher()
    logits = masks.apply(torch.zeros(3, vocab), [digits, None, anything])
    assert torch.isinf(logits[0, len(tokenizer):]).all() and torch.isinf(logits[2, len(tokenizer):]).all()
    assert (logits[1] == 0).all(), "a row without a constraint is untouched"
    assert torch.isinf(logits[0, eos]), "EOS before the grammar can end"
    allowed = (logits[0] == 0).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)
    assert digits.advance(allowed[0]) is None
    logits = masks.apply(torch.zeros(1, vocab), [digits])
    assert logits[0, eos] == 0, "EOS once the output is complete"
    assert not digits.stopped and digits.accepting


def test_a_step_without_constrained_rows_does_not_touch_the_grammar_code(model, tokenizer, monkeypatch):
    engine = new_engine(model, tokenizer)

    def forbidden(*args, **kwargs):
        raise AssertionError("the grammar stage ran for free requests")

    monkeypatch.setattr(engine.runner.sampler.grammar_masks, "apply", forbidden)
    results = engine.generate(PROMPTS, max_new_tokens=8, **SAMPLED, seed=1)
    assert all(r.finish_reason is not FinishReason.ERROR for r in results)
    assert engine._grammars is None, "no compiler is built for free requests"


# -- interplay -------------------------------------------------------------------------------


def test_free_requests_keep_their_greedy_tokens_beside_constrained_ones(model, tokenizer):
    alone = new_engine(model, tokenizer).generate(PROMPTS, max_new_tokens=20)
    mixed = new_engine(model, tokenizer)
    free_ids = [mixed.submit(p, max_new_tokens=20) for p in PROMPTS]
    constrained = [
        mixed.submit(p, max_new_tokens=40, json_schema=SCHEMAS["array_of_objects"], seed=i, **SAMPLED)
        for i, p in enumerate(PROMPTS)
    ]
    constrained += [mixed.submit(p, max_new_tokens=20, regex="[a-z]+") for p in PROMPTS]
    run_to_completion(mixed)
    assert [mixed.result(i).output_token_ids for i in free_ids] == [r.output_token_ids for r in alone]
    assert all(mixed.result(i).finish_reason is not FinishReason.ERROR for i in constrained)
    assert_pool_free(mixed)


def test_seeded_constrained_sampling_is_the_same_alone_and_batched(model, tokenizer):
    schema = SCHEMAS["nested_objects"]
    alone = new_engine(model, tokenizer).generate(
        [PROMPTS[0]], max_new_tokens=64, json_schema=schema, seed=7, top_k=20, **SAMPLED
    )[0]
    batched = new_engine(model, tokenizer)
    noise = [batched.submit(p, max_new_tokens=30, seed=i, **SAMPLED) for i, p in enumerate(PROMPTS)]
    noise += [batched.submit(p, max_new_tokens=30, regex="[0-9a-f]{4,40}", seed=i, **SAMPLED) for i, p in enumerate(PROMPTS)]
    rid = batched.submit(PROMPTS[0], max_new_tokens=64, json_schema=schema, seed=7, top_k=20, **SAMPLED)
    noise += [batched.submit(p, max_new_tokens=30, json_schema=schema, seed=i + 50, **SAMPLED) for i, p in enumerate(PROMPTS)]
    run_to_completion(batched)
    assert batched.result(rid).output_token_ids == alone.output_token_ids
    assert_pool_free(batched)


def test_preemption_in_the_middle_of_a_structure_keeps_the_grammar_in_step(model, tokenizer):
    schema = SCHEMAS["array_of_objects"]
    kwargs = dict(max_new_tokens=60, json_schema=schema, **SAMPLED)
    roomy = new_engine(model, tokenizer)
    expected = [roomy.submit(p * 4, seed=i, **kwargs) for i, p in enumerate(PROMPTS)]
    run_to_completion(roomy)
    expected = [roomy.result(i) for i in expected]

    tight = new_engine(model, tokenizer, num_pages=24, page_size=4, token_budget=64, prefill_chunk=16)
    ids = [tight.submit(p * 4, seed=i, **kwargs) for i, p in enumerate(PROMPTS)]
    mid_structure = 0
    while not tight.idle:
        before = {i: (tight.result(i).num_preemptions, len(tight.result(i).output_token_ids)) for i in ids}
        tight.step()
        for i in ids:
            preempted, produced = before[i]
            if tight.result(i).num_preemptions > preempted and produced > 0:
                mid_structure += 1
    assert mid_structure > 0, "the pool was meant to preempt requests in the middle of their output"
    results = [tight.result(i) for i in ids]
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in expected]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in expected]
    for r in stopped(results):
        jsonschema.validate(json.loads(r.output_text), schema)
    assert_pool_free(tight)


def test_a_request_cut_by_length_holds_a_valid_prefix(engine):
    schema = SCHEMAS["array_of_objects"]
    results = engine.generate(PROMPTS, max_new_tokens=7, json_schema=schema, seed=2, **SAMPLED)
    compiled = engine.compile_constraint(ConstraintSpec("json_schema", json.dumps(schema)))
    assert any(r.finish_reason is FinishReason.LENGTH for r in results)
    for r in results:
        assert r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        matcher = compiled.new_matcher()
        assert all(matcher.advance(t) is None for t in r.output_token_ids)
        if r.finish_reason is FinishReason.LENGTH:
            assert len(r.output_token_ids) == 7 and not matcher.stopped


def test_stop_strings_end_a_constrained_request(engine, tokenizer):
    # choose a stop string the constrained output will contain: the text after the first digit
    pattern = "[a-z]{3}[0-9]{2}[a-z]{3}"
    free = engine.generate([PROMPTS[0]], max_new_tokens=24, regex=pattern, seed=4, **SAMPLED)[0]
    assert free.finish_reason is FinishReason.STOP and re.fullmatch(pattern, free.output_text)
    stop = free.output_text[3:5]  # the two digits
    rid = engine.submit(PROMPTS[0], max_new_tokens=24, regex=pattern, seed=4, stop_strings=[stop], **SAMPLED)
    run_to_completion(engine)
    r = engine.result(rid)
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == stop
    assert r.output_text == free.output_text[:3], "the text before the stop string: a valid prefix"


def test_stop_ids_stop_where_the_grammar_allows_them_and_cannot_be_sampled_where_not(engine, tokenizer):
    pattern = "[a-z]{2,10}"
    free = engine.generate([PROMPTS[1]], max_new_tokens=24, regex=pattern, seed=5, **SAMPLED)[0]
    assert len(free.output_token_ids) > 2
    stop_id = free.output_token_ids[1]
    cut = engine.generate(
        [PROMPTS[1]], max_new_tokens=24, regex=pattern, seed=5, stop_token_ids=[stop_id], **SAMPLED
    )[0]
    first = free.output_token_ids.index(stop_id)
    assert cut.output_token_ids == free.output_token_ids[: first + 1]
    assert cut.finish_reason is FinishReason.STOP and cut.stop_reason == stop_id
    # a stop id the grammar forbids is simply never produced
    digit_ids = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    never = engine.generate(
        PROMPTS, max_new_tokens=16, regex=pattern, seed=6, stop_token_ids=digit_ids, **SAMPLED
    )
    for r in never:
        assert not set(r.output_token_ids) & set(digit_ids) and r.stop_reason not in digit_ids


def test_min_new_tokens_masks_eos_and_a_complete_grammar_still_ends_the_request(engine, tokenizer):
    eos = tokenizer.eos_token_id
    # "[0-9]+" can end after one digit: EOS stays masked until min_new_tokens
    results = engine.generate(PROMPTS, max_new_tokens=12, regex="[0-9]+", min_new_tokens=6, seed=8, **SAMPLED)
    for r in results:
        assert len(r.output_token_ids) >= 6
        assert eos not in r.output_token_ids[:6]
        assert re.fullmatch("[0-9]+", r.output_text)
    # a choice complete before min_new_tokens ends there (the grammar allows nothing more)
    short = engine.generate(PROMPTS, max_new_tokens=12, choice=["no", "ok"], min_new_tokens=10, seed=8, **SAMPLED)
    for r in short:
        assert r.finish_reason is FinishReason.STOP and r.output_text in ("no", "ok")
        assert len(r.output_token_ids) < 10


def test_logprobs_are_those_of_the_masked_distribution(engine, tokenizer):
    # one choice: every step has a single allowed token, so its probability is 1
    rid = engine.submit(PROMPTS[0], max_new_tokens=16, choice=["hello world"], logprobs=True, top_logprobs=3, **SAMPLED)
    events = [e for e in run_to_completion(engine) if e.request_id == rid and e.token_id is not None]
    assert events and engine.result(rid).output_text == "hello world"
    for e in events:
        assert e.logprob == 0.0
        assert e.top_logprobs[0] == (e.token_id, 0.0)
        assert all(lp == float("-inf") for _, lp in e.top_logprobs[1:])
    # several allowed tokens: the probabilities of the allowed ones add up to one
    rid = engine.submit(PROMPTS[2], max_new_tokens=8, regex="[ab]{8}", logprobs=True, top_logprobs=5, **SAMPLED)
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")
    for e in [e for e in run_to_completion(engine) if e.request_id == rid and e.token_id is not None]:
        finite = {t: lp for t, lp in e.top_logprobs if lp != float("-inf")}
        assert set(finite) <= {a, b} and e.token_id in finite
        assert sum(torch.tensor(list(finite.values())).exp().tolist()) == pytest.approx(1.0, abs=1e-5)


def test_a_cached_prompt_with_a_constraint_gives_the_same_output(model, tokenizer):
    engine = new_engine(model, tokenizer)
    prompt = list(range(20, 60))
    kwargs = dict(max_new_tokens=48, json_schema=SCHEMAS["nested_objects"], seed=9, **SAMPLED)
    first = engine.generate([prompt], **kwargs)[0]
    second = engine.generate([prompt], **kwargs)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens > 0
    assert second.output_token_ids == first.output_token_ids
    assert_pool_free(engine)


def test_ignore_eos_does_not_extend_a_complete_structure(engine):
    results = engine.generate(PROMPTS, max_new_tokens=16, choice=["yes", "no"], ignore_eos=True, seed=1, **SAMPLED)
    assert all(r.finish_reason is FinishReason.STOP and r.output_text in ("yes", "no") for r in results)


# -- failures, cancellation, pages -----------------------------------------------------------


def test_a_failed_matcher_fails_its_request_only(model, tokenizer):
    engine = new_engine(model, tokenizer)
    victim = engine.submit(PROMPTS[0], max_new_tokens=30, regex="[a-z]{1,40}", seed=1, **SAMPLED)
    others = [engine.submit(p, max_new_tokens=10, regex="[0-9]{10}", seed=2, **SAMPLED) for p in PROMPTS[1:]]
    free = engine.submit(PROMPTS[1], max_new_tokens=10)
    engine.step()
    engine.step()
    # a token its grammar forbids puts the matcher in its permanent error state, as a lexer
    # limit would mid-generation
    assert not engine._requests[victim].grammar.llmatcher.consume_token(tokenizer.convert_tokens_to_ids("7"))
    run_to_completion(engine)
    failed = engine.result(victim)
    assert failed.finish_reason is FinishReason.ERROR and failed.error.startswith("constraint: ")
    assert all(engine.result(i).finish_reason is FinishReason.STOP for i in others)
    assert all(re.fullmatch("[0-9]{10}", engine.result(i).output_text) for i in others)
    assert engine.result(free).finish_reason is FinishReason.LENGTH
    assert_pool_free(engine)


def test_a_lexer_limit_mid_generation_fails_that_request_with_the_librarys_message(model, tokenizer):
    engine = new_engine(model, tokenizer)
    tight = GrammarCompiler(tokenizer, model.config.vocab_size, [tokenizer.eos_token_id])
    tight._limits = tight._ll.LLParserLimits(max_lexer_states=40)  # the DFA of this regex blows up
    constraint = tight.compile(ConstraintSpec("regex", "(a|b)*a(a|b){12}"))
    victim = engine.submit(PROMPTS[0], max_new_tokens=60, constraint=constraint, seed=3, **SAMPLED)
    free = engine.submit(PROMPTS[1], max_new_tokens=20)
    run_to_completion(engine)
    failed = engine.result(victim)
    assert failed.finish_reason is FinishReason.ERROR, failed
    assert "lexer" in failed.error and "states" in failed.error, failed.error
    assert engine.result(free).finish_reason is FinishReason.LENGTH
    assert_pool_free(engine)


def test_cancelled_and_preempted_constrained_requests_free_every_page(model, tokenizer):
    engine = new_engine(model, tokenizer, num_pages=22, page_size=4, token_budget=64, prefill_chunk=16)
    ids = [
        engine.submit(p * 4, max_new_tokens=60, json_schema=SCHEMAS["array_of_objects"], seed=i, **SAMPLED)
        for i, p in enumerate(PROMPTS)
    ]
    for _ in range(6):
        engine.step()
    assert engine.cancel(ids[0]) and engine.cancel(ids[-1])
    run_to_completion(engine)
    assert engine.result(ids[0]).finish_reason is FinishReason.CANCELLED
    assert any(engine.result(i).num_preemptions for i in ids)
    assert_pool_free(engine)


# -- bad input -------------------------------------------------------------------------------


def test_two_constraints_name_the_second():
    with pytest.raises(InvalidRequestError) as err:
        ConstraintSpec.from_kwargs(regex="a", choice=["b"])
    assert err.value.field == "choice"
    with pytest.raises(InvalidRequestError) as err:
        ConstraintSpec.from_kwargs(json_schema={"type": "object"}, json_object=True)
    assert err.value.field == "json_object"
    assert ConstraintSpec.from_kwargs(json_object=False) is None
    assert ConstraintSpec.from_kwargs() is None


def test_specs_are_normalised():
    spec = ConstraintSpec.from_kwargs(json_schema={"type": "object", "properties": {}})
    assert spec == ConstraintSpec("json_schema", '{"type": "object", "properties": {}}')
    assert ConstraintSpec.from_kwargs(choice=["a", "b"]) == ConstraintSpec("choice", ("a", "b"))
    assert hash(ConstraintSpec.from_kwargs(choice=["a", "b"])) == hash(ConstraintSpec("choice", ("a", "b")))
    assert ConstraintSpec.from_kwargs(json_object=True) == ConstraintSpec("json_object", True)


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (dict(json_schema='{"type": '), "json_schema", "not valid JSON"),
        (dict(json_schema="[1, 2]"), "json_schema", "must be a JSON object"),
        (dict(json_schema=42), "json_schema", "must be a JSON object"),
        (dict(json_schema={"x": float("nan")}), "json_schema", "not serialisable"),
        (dict(json_schema="{" + " " * MAX_CONSTRAINT_CHARS + "}"), "json_schema", "at most"),
        (dict(json_object="yes"), "json_object", "boolean"),
        (dict(regex=""), "regex", "non-empty"),
        (dict(regex=b"abc"), "regex", "non-empty string"),
        (dict(grammar="x" * (MAX_CONSTRAINT_CHARS + 1)), "grammar", "at most"),
        (dict(choice=[]), "choice", "empty"),
        (dict(choice="yes"), "choice", "list of strings"),
        (dict(choice=["a", ""]), "choice", "non-empty string"),
        (dict(choice=["a", 3]), "choice", "non-empty string"),
        (dict(choice=["a", "b", "a"]), "choice", "'a' is given twice"),
        (dict(choice=[str(i) for i in range(MAX_CHOICES + 1)]), "choice", "at most"),
        (dict(choice=["x" * 2000]), "choice", "at most"),
    ],
)
def test_malformed_constraints_name_their_field(kwargs, field, words):
    with pytest.raises(InvalidRequestError) as err:
        ConstraintSpec.from_kwargs(**kwargs)
    assert err.value.field == field and words in str(err.value)


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        (dict(json_schema={"type": "strin"}), "json_schema", "strin"),
        (dict(json_schema={"type": "integer", "minimum": 10, "maximum": 1}), "json_schema", "minimum"),
        (dict(json_schema={"allOf": [{"type": "string"}, {"type": "integer"}]}), "json_schema", "Unsatisfiable"),
        (dict(json_schema={"$ref": "#/$defs/missing"}), "json_schema", "missing"),
        (dict(json_schema=_deep_schema(200)), "json_schema", "nested deeper than 128 levels"),  # refused before compiling
        (dict(regex="([a-z"), "regex", "unclosed"),
        (dict(grammar='root ::= "a"'), "grammar", "GBNF converts with llguidance.gbnf_to_lark"),
        (dict(grammar="start: undefined_rule"), "grammar", "undefined_rule"),
    ],
)
def test_constraints_that_do_not_compile_name_their_field_with_the_librarys_message(engine, kwargs, field, words):
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(PROMPTS[0], max_new_tokens=8, **kwargs)
    assert err.value.field == field and words in str(err.value), str(err.value)
    assert classify_engine_error(err.value)[:2] == (RejectKind.INVALID, field)
    assert engine.idle


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(json_schema={
            "type": "object",
            "properties": {f"p{i}": {"type": "integer"} for i in range(2000)},
            "required": [f"p{i}" for i in range(2000)],
        }),
        dict(json_schema={"enum": [f"value-{i}" for i in range(5000)]}),
        dict(regex="[a-z]{1,5000}"),
        dict(regex="((a{1,50}){1,50}){1,50}"),
        dict(regex="(a|b)*a(a|b){30}"),
        # built recursively by the library: on a default thread stack this killed the process
        dict(grammar="start:a0\n" + "".join(f'a{i}:"x"a{(i + 1) % 5500}?\n' for i in range(5500))),
    ],
    ids=[
        "2000-properties", "5000-enum", "long-counted-repeat", "nested-repeats", "exponential-dfa",
        "5500-recursive-rules",
    ],
)
def test_hostile_constraints_compile_or_fail_cleanly(engine, kwargs):
    """These returned (a matcher or a clean error), and promptly enough for the suite; the
    limits in the compiler are what bound them."""
    kind = next(iter(kwargs))
    try:
        rid = engine.submit(PROMPTS[0], max_new_tokens=4, **kwargs)
    except InvalidRequestError as err:
        assert err.field == kind and str(err)
    else:
        run_to_completion(engine)
        assert engine.result(rid).finish_reason is not None
    assert_pool_free(engine)


def test_a_constraint_and_a_compiled_constraint_are_not_both_given(engine):
    compiled = engine.compile_constraint(ConstraintSpec("regex", "[a-z]+"))
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(PROMPTS[0], max_new_tokens=4, regex="[a-z]+", constraint=compiled)
    assert err.value.field == "regex"
    with pytest.raises(TypeError):
        engine.submit(PROMPTS[0], max_new_tokens=4, constraint="[a-z]+")


def test_a_bad_request_is_refused_before_its_constraint_is_compiled(engine):
    before = len(engine.grammars._cache)
    with pytest.raises(InvalidRequestError) as err:
        engine.submit([], max_new_tokens=4, regex="[a-q]{1,3}x")
    assert err.value.field == "token_ids" and len(engine.grammars._cache) == before


def test_a_bad_spec_sent_again_is_answered_from_the_cache(engine):
    spec = ConstraintSpec("regex", "(unclosed")
    for _ in range(2):
        with pytest.raises(InvalidRequestError) as err:
            engine.compile_constraint(spec)
        assert err.value.field == "regex"
    assert spec in engine.grammars._cache


# -- what is missing -------------------------------------------------------------------------


def test_without_a_tokenizer_structured_output_is_unavailable(model):
    engine = Engine(model, num_pages=16, page_size=8)
    with pytest.raises(FeatureUnavailableError) as err:
        engine.submit(PROMPTS[0], max_new_tokens=4, regex="[a-z]+")
    assert err.value.field == "regex" and "tokenizer" in str(err.value)
    assert classify_engine_error(err.value)[:2] == (RejectKind.PRECONDITION, "regex")
    with pytest.raises(FeatureUnavailableError):
        engine.grammars
    assert engine.idle


def test_without_llguidance_structured_output_is_unavailable(model, tokenizer, monkeypatch):
    engine = new_engine(model, tokenizer)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now fails
    with pytest.raises(FeatureUnavailableError) as err:
        engine.submit(PROMPTS[0], max_new_tokens=4, choice=["a", "b"])
    assert err.value.field == "choice"
    assert "llguidance" in str(err.value) and "pip install 'qil[structured]'" in str(err.value)
    assert classify_engine_error(err.value)[0] == RejectKind.PRECONDITION
    # free requests are served as before
    assert engine.generate([PROMPTS[0]], max_new_tokens=3)[0].finish_reason is FinishReason.LENGTH


def test_importing_the_engine_does_not_import_llguidance():
    code = (
        "import sys, qil_worker.engine, qil_worker.structured.spec, qil_worker.structured.bitmask; "
        "assert 'llguidance' not in sys.modules, 'llguidance imported'; "
        "import qil_worker.structured.compiler; assert 'llguidance' not in sys.modules; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_the_spec_module_imports_neither_torch_nor_llguidance():
    code = (
        "import sys, qil_worker.structured.spec; "
        "bad = [m for m in ('torch', 'llguidance') if m in sys.modules]; assert not bad, bad; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


# -- threads ---------------------------------------------------------------------------------


def test_compiling_beside_the_step_loop(model, tokenizer):
    """The worker compiles on another thread while the loop steps: one compiler, one tokenizer
    info, cached results shared, and requests using them come out valid."""
    engine = new_engine(model, tokenizer)
    specs = [ConstraintSpec("regex", f"[a-z]{{{n}}}") for n in range(2, 8)] * 3
    compiled: dict[int, object] = {}
    errors: list[BaseException] = []

    def compile_all(offset: int) -> None:
        try:
            for i in range(offset, len(specs), 3):
                compiled[i] = engine.compile_constraint(specs[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    free = [engine.submit(p, max_new_tokens=12) for p in PROMPTS]
    threads = [threading.Thread(target=compile_all, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or not engine.idle:
        engine.step()
    for t in threads:
        t.join()
    assert not errors and len(compiled) == len(specs)
    assert compiled[0] is compiled[6] is compiled[12], "one compile per spec, shared"
    ids = [engine.submit(PROMPTS[0], max_new_tokens=10, constraint=compiled[i]) for i in range(6)]
    run_to_completion(engine)
    for n, rid in zip(range(2, 8), ids):
        assert re.fullmatch(f"[a-z]{{{n}}}", engine.result(rid).output_text)
    assert all(engine.result(i).finish_reason is FinishReason.LENGTH for i in free)


def test_masks_filled_beside_the_forward_equal_masks_filled_inline(model, tokenizer):
    assert not new_engine(model, tokenizer).runner.sampler.grammar_masks.overlap, "CPU: inline"
    outputs = []
    for overlap in (True, False):
        engine = new_engine(model, tokenizer)
        engine.runner.sampler.grammar_masks.overlap = overlap
        ids = [
            engine.submit(p, max_new_tokens=40, json_schema=SCHEMAS["array_of_objects"], seed=i, **SAMPLED)
            for i, p in enumerate(PROMPTS)
        ]
        ids += [engine.submit(p, max_new_tokens=20, seed=i, **SAMPLED) for i, p in enumerate(PROMPTS)]
        run_to_completion(engine)
        outputs.append([engine.result(i).output_token_ids for i in ids])
        assert (engine.runner.sampler.grammar_masks._pool is not None) == overlap
        assert_pool_free(engine)
    assert outputs[0] == outputs[1]
