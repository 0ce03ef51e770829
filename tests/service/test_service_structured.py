"""Structured output over gRPC: json_schema, json_object, regex, grammar and choice constraints.

One real server (front in a thread, worker in a spawned process) on a tiny random model whose
vocabulary is a locally trained byte-level BPE. Its outputs mean nothing, so every test checks
what the constraint guarantees: a finished output parses and validates (``jsonschema``), matches
the regex, is one of the choices. Bad constraints are INVALID_ARGUMENT naming their field with
the grammar library's message; a server that cannot run them says FAILED_PRECONDITION. The
compile runs beside the step loop: a slow one stalls no other request.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading

import grpc
import jsonschema
import pytest

from checkpoints import make_text_checkpoint
from qil_client import Client, FailedPrecondition, InvalidArgument, pb
from qil_client.results import ResultBuilder
from qil_worker.service.errors import ServiceError
from service_fixtures import start_server, wait_until

ENGINE = dict(num_pages=256, page_size=8, token_budget=256, prefill_chunk=64, max_active=16)
PROMPT = "hello world, qil serves"
SEEDS = (1, 2, 3)
SAMPLED = dict(temperature=1.0, top_k=40)  # varied outputs, each seeded

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "integer", "minimum": 1000, "maximum": 9999},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "arrays_and_enums": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "minItems": 1,
                "maxItems": 4,
            },
            "note": {"type": "string", "maxLength": 5},
        },
        "required": ["colour", "tags", "scores"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "ok": {"type": "boolean"}},
            "required": ["id", "ok"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("svc-structured"))


@pytest.fixture(scope="module")
def server(text_dir):
    srv = start_server(text_dir, engine=ENGINE)
    yield srv
    srv.stop()


def all_free(client) -> bool:
    info = client.info()
    return info.num_unfinished == 0 and info.pages.used == 0 and info.num_running == 0


def assert_compact(text: str, value) -> None:
    """No free whitespace: the text is the compact serialisation (where no escape could differ)."""
    if "\\" not in text:
        assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_get_info_says_structured_output_can_run(client):
    assert client.info().model.structured_output


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(client, name):
    schema = SCHEMAS[name]
    for as_text, seed in zip((False, True, False), SEEDS):
        r = client.generate(text=PROMPT, max_new_tokens=160, seed=seed, **SAMPLED,
                            json_schema=json.dumps(schema) if as_text else schema)
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        value = json.loads(r.text)
        jsonschema.validate(value, schema)
        assert_compact(r.text, value)
    assert wait_until(lambda: all_free(client))


def test_json_object_output_is_a_json_object(client):
    # unbounded: a random model may not close it, so only a finished output is checked whole
    for seed in SEEDS:
        r = client.generate(text=PROMPT, max_new_tokens=48, seed=seed, **SAMPLED, json_object=True)
        assert r.text.startswith("{")
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)
        else:
            assert r.finish_reason == "length"


def test_a_length_cut_output_is_a_valid_prefix(client):
    r = client.generate(text=PROMPT, max_new_tokens=3, json_schema=SCHEMAS["nested"])
    assert r.finish_reason == "length" and r.num_output_tokens == 3
    forced = '{"name":"'  # compact, properties in the schema's order
    assert forced.startswith(r.text) or r.text.startswith(forced), r.text


def test_regex_outputs_full_match(client):
    pattern = r"[a-z]{2,6}-[0-9]{1,3}"
    for seed in SEEDS:
        r = client.generate(text=PROMPT, max_new_tokens=24, seed=seed, **SAMPLED, regex=pattern)
        assert r.finish_reason == "stop"
        assert re.fullmatch(pattern, r.text), r.text


def test_choice_returns_exactly_one_choice(client):
    choices = ["red", "green", "blue", "dark red"]
    for seed in range(8):
        r = client.generate(text=PROMPT, max_new_tokens=16, seed=seed, **SAMPLED, choice=choices)
        assert r.finish_reason == "stop" and r.text in choices, r.text
    r = client.generate([1, 2, 3], max_new_tokens=16, choice=choices)  # a token-id prompt too
    assert r.text in choices


def test_grammar_output_is_a_derivation(client):
    grammar = 'start: item ("," item)*\nitem: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,2}/'
    r = client.generate(text=PROMPT, max_new_tokens=32, seed=5, **SAMPLED, grammar=grammar)
    assert re.fullmatch(r"(yes|no|[0-9]{1,2})(,(yes|no|[0-9]{1,2}))*", r.text), r.text


def test_logprobs_are_of_the_masked_distribution(client, text_dir):
    from qil_worker.text import load_tokenizer

    tokenizer = load_tokenizer(text_dir)
    choices = ["red", "green", "blue"]
    starts = [t for t in range(len(tokenizer))
              if (piece := tokenizer.decode([t])) and any(c.startswith(piece) for c in choices)]
    assert 1 < len(starts) <= 20  # so the top 20 holds every allowed first token
    r = client.generate(text=PROMPT, max_new_tokens=8, choice=choices, logprobs=True, top_logprobs=20)
    assert r.text in choices
    allowed = [(t, lp) for t, lp in r.top_logprobs[0] if lp > float("-inf")]
    # the mask came first: only tokens that start a choice have probability, and theirs sum to 1
    assert {t for t, _ in allowed} <= set(starts)
    assert abs(sum(math.exp(lp) for _, lp in allowed) - 1.0) < 1e-4
    assert r.logprobs[0] == max(lp for _, lp in allowed)  # greedy: the most likely allowed token


def test_submit_frames_of_a_session_carry_the_constraint(client):
    with client.session() as s:
        s.submit(text=PROMPT, max_new_tokens=16, choice=["alpha", "beta"], request_id="s-choice")
        s.submit(text=PROMPT, max_new_tokens=160, seed=4, **SAMPLED, json_schema=SCHEMAS["nested"],
                 request_id="s-schema")
        s.submit(text=PROMPT, max_new_tokens=16, regex="([a-z", request_id="s-bad")
        s.close()
        builders: dict[str, ResultBuilder] = {}
        errors = []
        for resp in s:
            kind = resp.WhichOneof("frame")
            if kind == "event":
                builders.setdefault(resp.event.request_id, ResultBuilder()).add(resp.event)
            elif kind == "error":
                errors.append(resp.error)
    results = {rid: b.result() for rid, b in builders.items()}
    assert set(results) == {"s-choice", "s-schema"}
    assert results["s-choice"].text in ("alpha", "beta")
    assert results["s-schema"].finish_reason == "stop"
    jsonschema.validate(json.loads(results["s-schema"].text), SCHEMAS["nested"])
    assert len(errors) == 1 and errors[0].request_id == "s-bad" and errors[0].field == "regex"
    assert errors[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "unclosed character class" in errors[0].message


def test_the_oneof_carries_each_constraint_to_the_front_and_an_empty_choice_list_too():
    from qil_client.results import submit_request
    from qil_worker.service.front.submit_spec import submit_spec
    from qil_worker.structured.spec import ConstraintSpec

    assert submit_spec(submit_request([1], json_object=True)).constraint == ConstraintSpec("json_object", True)
    assert submit_spec(pb.SubmitRequest(token_ids=[1], json_object=False)).constraint is None
    assert submit_spec(submit_request([1], choice=["a", "b"])).constraint == ConstraintSpec("choice", ("a", "b"))
    with pytest.raises(ServiceError) as exc:
        submit_spec(submit_request([1], choice=[]))
    assert exc.value.field == "choice" and exc.value.code == grpc.StatusCode.INVALID_ARGUMENT


BIG_ENUM = json.dumps({"enum": ["v%06d" % i for i in range(12000)]})  # over 100,000 characters


@pytest.mark.parametrize(
    "kwargs, field, says",
    [
        (dict(json_schema="{not json"), "json_schema", "not valid JSON"),
        (dict(json_schema="[1, 2]"), "json_schema", "must be a JSON object"),
        (dict(json_schema={"type": "strin"}), "json_schema", "Invalid type: strin"),
        (dict(json_schema={"not": {"type": "string"}}), "json_schema", 'Unimplemented keys: ["not"]'),
        (dict(json_schema={"type": "integer", "minimum": 10, "maximum": 1}), "json_schema",
         "minimum (10) is greater than maximum (1)"),
        (dict(json_schema={"type": "string", "format": "uri-template"}), "json_schema", "Unknown format"),
        (dict(json_schema=BIG_ENUM), "json_schema", "at most 100000"),
        (dict(regex="([a-z"), "regex", "unclosed character class"),
        (dict(regex="(?=a)b"), "regex", "look-around"),
        (dict(regex=""), "regex", "non-empty"),
        (dict(grammar='root ::= "a"'), "grammar", "Expected token"),
        (dict(grammar="start: foo"), "grammar", 'unknown name: "foo"'),
        (dict(choice=[]), "choice", "empty"),
        (dict(choice=["a", "a"]), "choice", "distinct"),
        (dict(choice=["x" * 1025]), "choice", "at most 1024"),
        # a long prompt that cannot fit is refused before its constraint is compiled: from its
        # size, by the front (#20; this model's 512 positions hold no prompt long enough to be
        # encoded on the worker's thread), blaming the prompt, which alone cannot fit
        (dict(text="hello " * 4000, regex="([a-z"), "text", "prompt (at least"),
        (dict(text="hello " * 4000, choice=["a", "b"]), "text", "positions"),
    ],
)
def test_bad_constraints_are_invalid_argument_naming_the_field(client, kwargs, field, says):
    for call in (client.submit, client.generate):
        with pytest.raises(InvalidArgument) as exc:
            call(**{"text": PROMPT, "max_new_tokens": 8, **kwargs})
        assert exc.value.field == field
        assert exc.value.details.startswith(field + ":") and says in exc.value.details, exc.value.details
    assert client.info().num_unfinished == 0


def test_two_constraints_are_refused_by_the_client():
    from qil_client.results import submit_request

    with pytest.raises(ValueError, match="^choice: give at most one"):
        submit_request([1], regex="a", choice=["a"])


def _slow_schema(tag: str) -> dict:
    """A legal schema that takes the library a few tenths of a second to compile (any of 1,000
    one-key objects; its output is still quick to make), near the size limit; ``tag`` (a letter)
    makes it new to the worker's compile cache."""
    return {"anyOf": [
        {"type": "object", "properties": {f"{tag}{i}": {"type": "integer"}}, "required": [f"{tag}{i}"]}
        for i in range(1000)
    ]}


def _submit_in_thread(client, order: list, name: str, **kw) -> threading.Thread:
    def run() -> None:
        try:
            client.submit(**kw)
            order.append(name)
        except Exception as exc:  # noqa: BLE001 - the test reads it from the list
            order.append((name, exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# Slow compiles queued one behind another: their total (about a quarter second each) is the
# window in which the free and the cached request must end; twelve keep it wide on a loaded machine.
SLOW_TAGS = "abcfghijklmn"


def test_a_slow_compile_stalls_no_other_request(client):
    # a constraint compiled already: looked up in the loop, so it too passes the slow compiles
    cached = {"enum": ["cached-a", "cached-b"]}
    client.generate(text=PROMPT, max_new_tokens=16, json_schema=cached)
    order: list = []
    slow = [_submit_in_thread(client, order, f"slow-{tag}", text=PROMPT, max_new_tokens=4,
                              json_schema=_slow_schema(tag), request_id=f"slow-{tag}") for tag in SLOW_TAGS]
    # their Submits are on the pipe first: all of them unfinished at once, or (on a fast machine,
    # where the first can end before the last is sent) the first already answered
    wait_until(lambda: client.info().num_unfinished == len(SLOW_TAGS) or order)
    free = client.generate(text=PROMPT, max_new_tokens=12, ignore_eos=True)
    order.append("free done")
    again = client.generate(text=PROMPT, max_new_tokens=16, json_schema=cached)
    order.append("cached done")
    for t in slow:
        t.join(60)
    assert free.num_output_tokens == 12 and json.loads(again.text) in cached["enum"]
    assert sorted(map(str, order)) == ["cached done", "free done", *(f"slow-{tag}" for tag in SLOW_TAGS)], order
    # the free and the cached request ran while the slow constraints were still compiling
    last_slow = max(order.index(f"slow-{tag}") for tag in SLOW_TAGS)
    assert order.index("free done") < order.index("cached done") < last_slow, order
    for tag in SLOW_TAGS:
        r = client.result(f"slow-{tag}")
        assert r.finish_reason in ("stop", "length") and r.text.startswith('{"'[: len(r.text)]), r
    assert wait_until(lambda: all_free(client))


def test_a_cancel_during_the_compile_ends_the_request_and_frees_everything(client):
    with client.session() as s:
        # the second waits behind the first's compile, then compiles itself: a wide window.
        # The cancel goes at once: a session's frames are answered in order, so c-slow is in the
        # front (and its Submit on the worker's pipe) before the cancel is looked at.
        s.submit(text=PROMPT, max_new_tokens=4, json_schema=_slow_schema("d"), request_id="c-first")
        s.submit(text=PROMPT, max_new_tokens=64, json_schema=_slow_schema("e"), request_id="c-slow")
        s.cancel("c-slow")
        s.close()
        builders: dict[str, ResultBuilder] = {}
        answers = []
        for resp in s:
            kind = resp.WhichOneof("frame")
            if kind == "event":
                builders.setdefault(resp.event.request_id, ResultBuilder()).add(resp.event)
            else:
                answers.append(kind)
                if kind == "cancelled":
                    assert [(c.request_id, c.was_active) for c in resp.cancelled.results] == [("c-slow", True)]
    assert answers == ["submitted", "submitted", "cancelled"]
    cancelled = builders["c-slow"].result()
    assert cancelled.finish_reason == "cancelled" and cancelled.num_output_tokens == 0
    assert builders["c-first"].result().finish_reason in ("stop", "length")
    assert wait_until(lambda: all_free(client))


NO_LLGUIDANCE_SHIM = "import sys\nsys.modules['llguidance'] = None  # import llguidance: ImportError\n"


@pytest.mark.parametrize("missing", ["tokenizer", "llguidance"])
def test_a_server_that_cannot_run_constraints_says_failed_precondition(text_dir, tmp_path, monkeypatch, missing):
    kw = {}
    if missing == "tokenizer":
        kw["use_tokenizer"] = False
    else:  # the worker (spawned with this environment) cannot import the library
        (tmp_path / "sitecustomize.py").write_text(NO_LLGUIDANCE_SHIM)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    srv = start_server(text_dir, engine=ENGINE, **kw)
    try:
        c = Client(srv.target, timeout=60)
        info = c.info()
        assert not info.model.structured_output
        assert info.model.has_tokenizer == (missing != "tokenizer")
        for constraint in (dict(regex="[a-z]+"), dict(choice=["a", "b"]), dict(json_object=True)):
            with pytest.raises(FailedPrecondition) as exc:
                c.generate([1, 2, 3], max_new_tokens=4, **constraint)
            assert exc.value.field == next(iter(constraint))
            assert missing in exc.value.details
        assert c.generate([1, 2, 3], max_new_tokens=4).num_output_tokens == 4  # the rest still runs
        c.close()
    finally:
        srv.stop()


def test_the_specs_the_worker_looks_up_in_its_loop_are_still_in_the_compilers_cache():
    from qil_worker.service.worker.constraint_compiles import INLINE_RECENT
    from qil_worker.structured.compiler import CACHE_SIZE

    assert 0 < INLINE_RECENT <= CACHE_SIZE  # recent ones compile inline: a hit, never a rebuild
