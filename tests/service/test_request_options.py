"""``qil_client.options`` is the one list of a request's optional options: the proto, the engine,
the client's keyword arguments, both command lines and the front all agree with it."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

from qil_client import pb
from qil_client.__main__ import _parser as client_parser
from qil_client.__main__ import request_kwargs
from qil_client.constraints import NAMES as CONSTRAINT_NAMES
from qil_client.options import LOGPROBS, NAMES, OPTIONS, SAMPLING, TEXT
from qil_client.results import submit_request
from qil_worker.cli_generate import add_generate_parser, sampling_kwargs
from qil_worker.engine import SamplingParams
from qil_worker.engine.spec import Prompt, RequestSpec, TextOptions
from qil_worker.service.front.submit_spec import submit_spec

# A valid value of each type, none of them a default (so that "set" is observable everywhere).
VALUES = {float: 0.5, int: 3, bool: True}


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def test_the_table_is_the_optional_scalar_fields_of_submit_request():
    # (repeated fields have no presence; a message field would have it without being an option)
    proto = {f.name for f in pb.SubmitRequest.DESCRIPTOR.fields if f.has_presence and f.message_type is None}
    assert len(NAMES) == len(set(NAMES))
    # max_new_tokens is optional on the wire too, but every command line and API gives it a
    # place (and a default) of its own; so do the members of the constraint oneof (at most one
    # of them, qil_client.constraints), which are not options of their own either.
    constraint = {f.name for f in pb.SubmitRequest.DESCRIPTOR.oneofs_by_name["constraint"].fields}
    assert constraint == set(CONSTRAINT_NAMES) and not constraint & set(NAMES)
    assert set(NAMES) == proto - {"max_new_tokens"} - constraint


# SamplingParams fields that are not optional scalars on the wire (a map), handled by name
NON_SCALAR = {"logit_bias"}


def test_sampling_params_has_the_sampling_and_logprobs_options_and_submit_the_text_ones():
    scalar = [f.name for f in fields(SamplingParams) if f.name not in NON_SCALAR]
    assert scalar == [o.name for o in SAMPLING + LOGPROBS]
    assert NON_SCALAR <= {f.name for f in fields(SamplingParams)}
    # the keyword form of a request (RequestSpec.of, which Engine.submit forwards to) takes each
    # text option by name, and the spec keeps it: Prompt.enable_thinking, the TextOptions
    keyword_only = {
        name for name, p in inspect.signature(RequestSpec.of).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert {o.name for o in TEXT} <= keyword_only
    kept = {f.name for f in fields(Prompt)} | {f.name for f in fields(TextOptions)}
    assert {o.name for o in TEXT} <= kept


def test_submit_request_takes_each_option_as_a_keyword_argument():
    keyword_only = {
        name for name, p in inspect.signature(submit_request).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    tools = {"tools", "tool_choice", "parallel_tool_calls"}  # one ToolUse message on the wire
    assert keyword_only - {"text", "messages", "stop_strings", *CONSTRAINT_NAMES} - NON_SCALAR - tools == set(NAMES)
    assert NON_SCALAR <= keyword_only
    assert set(CONSTRAINT_NAMES) <= keyword_only
    req = submit_request([1], **{o.name: VALUES[o.type] for o in OPTIONS})
    assert all(req.HasField(name) for name in NAMES)


def test_both_command_lines_have_a_flag_for_each_sampling_option():
    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    worker = _subparser(parser, "generate")
    client = _subparser(client_parser(), "generate")
    for q in (worker, client):
        flags = {s: a for a in q._actions for s in a.option_strings}
        for o in SAMPLING:
            assert flags[o.flag].dest == o.name and flags[o.flag].default is None, o.flag
    assert set(NAMES) <= {a.dest for a in client._actions}  # the client CLI sends them all
    argv = ["--model", "m", "--prompt", "hi"]
    for o in SAMPLING:
        argv += [o.flag] if o.type is bool else [o.flag, str(VALUES[o.type])]
    assert sampling_kwargs(worker.parse_args(argv)) == {o.name: VALUES[o.type] for o in SAMPLING}


def test_every_option_goes_from_the_client_cli_through_the_front_to_the_engine():
    argv = ["generate", "--prompt", "hi", "--chat", "--thinking", "--logprobs", "--top-logprobs", "2",
            "--prompt-logprobs", "1", "--include-stop-string", "--keep-special-tokens",
            "--max-new-tokens", "8", "--logit-bias", "5=-1.5", "--logit-bias", "2=3"]
    for o in SAMPLING:
        argv += [o.flag] if o.type is bool else [o.flag, str(VALUES[o.type])]
    kw = request_kwargs(client_parser().parse_args(argv))
    assert set(NAMES) <= set(kw)
    spec = submit_spec(submit_request(**kw))
    expected = SamplingParams(
        **{o.name: VALUES[o.type] for o in SAMPLING}, logprobs=True, top_logprobs=2, prompt_logprobs=1,
        logit_bias=((2, 3.0), (5, -1.5)),
    )
    assert spec.sampling == expected
    # every option reached the spec: none is left at its default
    defaults = SamplingParams()
    assert all(getattr(spec.sampling, name) != getattr(defaults, name)
               for name in [o.name for o in SAMPLING + LOGPROBS] + sorted(NON_SCALAR))
    assert spec.prompt.enable_thinking is True and spec.text.skip_special_tokens is False
    assert spec.text.include_stop_string is True and spec.max_new_tokens == 8
