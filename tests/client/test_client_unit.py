"""Client pieces that need no server: targets, status → exception mapping, result assembly, and the
client CLI's output and exit codes against a stand-in client."""

from __future__ import annotations

import json
import re

import grpc
import pytest

import qil_client.__main__ as client_cli
from qil_client import Client, errors, pb
from qil_client._channel import ROUND_ROBIN, channel_options, resolve_target
from qil_client.errors import error_for
from qil_client.results import ResultBuilder


def test_single_target_is_used_as_is():
    assert resolve_target("127.0.0.1:50051") == ("127.0.0.1:50051", False)


def test_list_of_targets_becomes_round_robin_ipv4():
    target, rr = resolve_target(["127.0.0.1:1", "127.0.0.1:2"])
    assert target == "ipv4:127.0.0.1:1,127.0.0.1:2" and rr
    assert resolve_target("127.0.0.1:1,127.0.0.1:2") == (target, True)
    assert resolve_target(["[::1]:5", "[::1]:6"]) == ("ipv6:[::1]:5,[::1]:6", True)


def test_dns_target_uses_round_robin():
    target, rr = resolve_target("dns:///qil.example:50051")
    assert rr and target == "dns:///qil.example:50051"
    assert ("grpc.service_config", ROUND_ROBIN) in channel_options(rr, None)
    assert json.loads(ROUND_ROBIN)["loadBalancingConfig"][0] == {"round_robin": {}}


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (3, errors.InvalidArgument),
    ],
)
def test_status_codes_map_to_typed_errors(code, cls):
    err = errors.error_for(code, "token_ids: bad", "token_ids")
    assert type(err) is cls and isinstance(err, errors.QilError)
    assert err.field == "token_ids"


def test_result_builder_detects_gaps_and_reads_final():
    b = ResultBuilder()
    b.add(pb.Event(request_id="r", seq=0, token_ids=[1, 2]))
    with pytest.raises(RuntimeError):
        b.add(pb.Event(request_id="r", seq=3, token_ids=[4]))
    b.add(pb.Event(request_id="r", seq=2, token_ids=[3], finished=True,
                   finish_reason=pb.FINISH_REASON_STOP, num_output_tokens=3,
                   metrics=pb.RequestMetrics(ttft_s=0.5)))
    r = b.result()
    assert r.token_ids == [1, 2, 3] and r.finish_reason == "stop" and r.metrics.ttft_s == 0.5


def test_submit_request_sets_only_the_options_given():
    from qil_client.results import submit_request

    req = submit_request([1, 2], max_new_tokens=5)
    for name in ("temperature", "top_k", "top_p", "seed", "logprobs", "skip_special_tokens",
                 "enable_thinking", "max_new_tokens"):
        assert req.HasField(name) == (name == "max_new_tokens"), name
    req = submit_request(text="hi", temperature=0.0, top_k=-1, seed=2**64 - 1, skip_special_tokens=False,
                         stop_strings=["\n"], logprobs=True, top_logprobs=5)
    assert req.HasField("temperature") and req.temperature == 0.0  # an explicit zero is sent
    assert req.top_k == -1 and req.seed == 2**64 - 1 and not req.skip_special_tokens
    assert req.text == "hi" and list(req.stop_strings) == ["\n"] and not req.token_ids
    req = submit_request(messages=[{"role": "user", "content": "a"}, ("assistant", "b"),
                                   pb.ChatMessage(role="user", content="c")], enable_thinking=False)
    assert [(m.role, m.content) for m in req.messages] == [("user", "a"), ("assistant", "b"), ("user", "c")]
    assert req.HasField("enable_thinking") and not req.enable_thinking
    with pytest.raises(TypeError):
        submit_request([1], temprature=0.5)  # a typo is not silently dropped
    with pytest.raises(ValueError, match="seed"):
        submit_request([1], seed=-1)  # the wire cannot carry it
    with pytest.raises(TypeError):
        submit_request([1], stop_strings="STOP")
    for bad in ({"role": "user", "content": None}, {"role": "user"}, {"role": "user", "content": 5}, ("user",)):
        with pytest.raises(ValueError, match=r"messages\[1\]: needs a string role and a string content"):
            submit_request(messages=[{"role": "system", "content": "x"}, bad])


@pytest.mark.parametrize("flags", [["--token-ids", "[1]", "--chat"], ["--prompt", "hi", "--system", "be brief"],
                                   ["--prompt", "hi", "--no-thinking"], ["--token-ids", "[1]", "--system", "x"]])
def test_client_cli_refuses_chat_flags_without_a_chat_prompt(flags):
    """--system / --thinking would be dropped silently without --chat (no server is needed to
    refuse them: the check comes before any call)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "qil_client", "--target", "127.0.0.1:1", "generate", *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "go" in proc.stderr and "with --prompt" in proc.stderr, proc.stderr


def test_result_builder_joins_text_logprobs_and_reads_the_stop_reason():
    b = ResultBuilder()
    b.add(pb.Event(request_id="r", seq=0, token_ids=[1, 2], text="ab", logprobs=[-0.1, -0.2],
                   top_logprobs=[pb.TopLogprobs(candidates=[pb.TokenLogprob(token_id=1, logprob=-0.1)]),
                                 pb.TopLogprobs(candidates=[pb.TokenLogprob(token_id=2, logprob=-0.2)])]))
    b.add(pb.Event(request_id="r", seq=2, token_ids=[3], text="", logprobs=[-0.3],
                   top_logprobs=[pb.TopLogprobs(candidates=[pb.TokenLogprob(token_id=3, logprob=-0.3)])]))
    b.add(pb.Event(request_id="r", seq=3, finished=True, text="é", finish_reason=pb.FINISH_REASON_STOP,
                   stop_string="END", num_cached_tokens=16))
    r = b.result()
    assert r.text == "abé" and r.logprobs == [-0.1, -0.2, -0.3]
    assert r.top_logprobs == [[(1, -0.1)], [(2, -0.2)], [(3, -0.3)]]
    assert r.stop_reason == "END" and r.num_cached_tokens == 16
    b = ResultBuilder()
    b.add(pb.Event(request_id="r", seq=0, token_ids=[7], finished=True, finish_reason=pb.FINISH_REASON_STOP,
                   stop_token_id=7))
    r = b.result()
    assert r.stop_reason == 7 and r.text is None and r.logprobs is None


def test_failed_precondition_maps_to_its_own_error():
    err = errors.error_for(grpc.StatusCode.FAILED_PRECONDITION, "text: no tokenizer", "text")
    assert type(err) is errors.FailedPrecondition and err.field == "text"


def _flags(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_client_cli_has_the_sampling_flags_of_the_in_process_cli():
    import argparse

    from qil_client.__main__ import _parser, add_sampling_arguments, request_kwargs
    from qil_worker.cli_generate import add_sampling_arguments as worker_flags

    a, b = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_sampling_arguments(a)
    worker_flags(b)
    assert _flags(a) == _flags(b)
    args = _parser().parse_args([
        "generate", "--prompt", "hi", "--chat", "--system", "be brief", "--no-thinking",
        "--temperature", "0.7", "--top-p", "0.9", "--seed", "3", "--stop", "END", "--stop", "\n",
        "--logprobs", "--top-logprobs", "2", "--keep-special-tokens",
    ])
    kw = request_kwargs(args)
    assert kw["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert kw["enable_thinking"] is False and kw["temperature"] == 0.7 and kw["top_p"] == 0.9
    assert kw["seed"] == 3 and kw["stop_strings"] == ["END", "\n"] and kw["logprobs"] is True
    assert kw["top_logprobs"] == 2 and kw["skip_special_tokens"] is False
    assert "top_k" not in kw and "text" not in kw and "token_ids" not in kw
    kw = request_kwargs(_parser().parse_args(["submit", "--token-ids", "[1,2]"]))
    assert kw["token_ids"] == [1, 2] and "temperature" not in kw and "skip_special_tokens" not in kw


class FakeClient:
    last = None
    status = "SERVING"  # what health() answers

    def __init__(self, target, token=None, tls=None):
        self.target, self.token, self.tls = target, token, tls
        self.calls = []
        FakeClient.last = self

    def wait_ready(self, t, fail_when_refused=False):
        self.calls.append(("wait_ready", t, fail_when_refused))

    def health(self, timeout=None):
        self.calls.append(("health",))
        return self.status

    def cancel(self, *rids, timeout=None):
        return {rids[0]: True, rids[1]: False}

    def stream(self, timeout=None, **kw):
        self.calls.append(("stream", kw))
        return iter(self.events)

    def submit(self, timeout=None, **kw):
        raise error_for(3, "temperature: bad", "temperature")

    def close(self):
        pass


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(client_cli, "Client", FakeClient)
    FakeClient.events = []
    FakeClient.status = "SERVING"
    return FakeClient


def final(seq, reason, **kw):
    return pb.Event(request_id="r", seq=seq, finished=True, finish_reason=reason, **kw)


@pytest.mark.parametrize("reason, rc", [(pb.FINISH_REASON_LENGTH, 0), (pb.FINISH_REASON_STOP, 0),
                                        (pb.FINISH_REASON_CANCELLED, 1), (pb.FINISH_REASON_ERROR, 1)])
def test_generate_exit_code_follows_the_finish_reason(fake, reason, rc):
    fake.events = [pb.Event(request_id="r", seq=0, token_ids=[5]), final(1, reason)]
    assert client_cli.main(["generate", "--token-ids", "[1]"]) == rc


def test_text_mode_prints_only_text_even_for_empty_deltas(fake, capsys):
    fake.events = [pb.Event(request_id="r", seq=0, token_ids=[5], text="a"),
                   pb.Event(request_id="r", seq=1, token_ids=[6], text=""),
                   final(2, pb.FINISH_REASON_LENGTH, text="b")]
    assert client_cli.main(["generate", "--prompt", "x"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "ab"


def test_server_error_exit_code_is_1_and_names_the_field_once(fake, capsys, monkeypatch):
    assert client_cli.main(["submit", "--token-ids", "[1]", "--temperature", "-1"]) == 1
    err = capsys.readouterr().err
    assert err == "error: INVALID_ARGUMENT: temperature: bad\n", err  # the server's details name it

    def submit(self, timeout=None, **kw):  # details that do not start with the field get it added
        raise error_for(3, "out of range", "top_p")

    monkeypatch.setattr(FakeClient, "submit", submit)
    assert client_cli.main(["submit", "--token-ids", "[1]"]) == 1
    assert capsys.readouterr().err == "error: INVALID_ARGUMENT: out of range (field top_p)\n"


def test_cancel_output(fake, capsys):
    assert client_cli.main(["cancel", "a", "b"]) == 0
    assert capsys.readouterr().out == "a\tcancelled\nb\tnot active\n"


def test_health_does_not_wait_for_serving(fake):
    assert client_cli.main(["health"]) == 0
    assert FakeClient.last.calls == [("health",)]


@pytest.mark.parametrize("status, rc", [("SERVING", 0), ("NOT_SERVING", 1), ("SERVICE_UNKNOWN", 1), ("UNKNOWN", 1)])
def test_health_exits_0_only_when_serving(fake, capsys, status, rc):
    """A readiness probe (Docker's HEALTHCHECK runs this command) must fail unless SERVING."""
    fake.status = status
    assert client_cli.main(["--wait-ready", "0", "health"]) == rc
    assert capsys.readouterr().out == status + "\n"


def test_health_waits_when_asked(fake, capsys):
    fake.status = "NOT_SERVING"
    assert client_cli.main(["--wait-ready", "7", "health"]) == 1
    assert FakeClient.last.calls == [("wait_ready", 7.0, True), ("health",)]
    assert capsys.readouterr().out == "NOT_SERVING\n"


def test_other_commands_wait_30_s_unless_told_and_a_refused_connection_ends_the_wait(fake):
    fake.events = [final(0, pb.FINISH_REASON_LENGTH)]
    assert client_cli.main(["generate", "--token-ids", "[1]"]) == 0
    assert FakeClient.last.calls[0] == ("wait_ready", 30.0, True)
    assert client_cli.main(["--wait-ready", "0", "generate", "--token-ids", "[1]"]) == 0
    assert [c[0] for c in FakeClient.last.calls] == ["stream"]


@pytest.mark.parametrize("flag", ["--token-ids", "--stop-token-ids"])
@pytest.mark.parametrize("value", ["garbage", "[1, 2.5]", "{}", "[true]"])
def test_a_token_list_that_is_not_one_names_the_flag(capsys, flag, value):
    argv = ["generate", "--token-ids", "[1]"] if flag == "--stop-token-ids" else ["generate"]
    with pytest.raises(SystemExit) as exc:
        client_cli._parser().parse_args([*argv, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected a JSON list of integers" in err and repr(value) in err, err
    assert "_ids" not in err


@pytest.mark.parametrize("kwargs, field", [
    (dict(token_ids=[-1]), "token_ids"),
    (dict(token_ids=[2**32]), "token_ids"),
    (dict(token_ids=["a"]), "token_ids"),
    (dict(token_ids=[1], max_new_tokens=-1), "max_new_tokens"),
    (dict(token_ids=[1], stop_token_ids=[-5]), "stop_token_ids"),
    (dict(token_ids=[1], stop_strings=[3]), "stop_strings"),
    (dict(token_ids=[1], request_id=7), "request_id"),
    (dict(text=""), "text"),
])
def test_values_the_wire_cannot_carry_name_their_field(kwargs, field):
    """As the server's errors do (its details start with the field)."""
    from qil_client.results import submit_request

    with pytest.raises((TypeError, ValueError), match=f"^{field}: "):
        submit_request(**kwargs)


@pytest.mark.parametrize("argv, field", [
    (["--token-ids", "[-1]"], "token_ids"),
    (["--token-ids", "[1]", "--max-new-tokens", "-1"], "max_new_tokens"),
    (["--token-ids", "[1]", "--stop-token-ids", "[-1]"], "stop_token_ids"),
    (["--prompt", ""], "text"),
])
def test_the_cli_names_the_field_of_a_value_the_wire_cannot_carry(fake, capsys, argv, field):
    for command in ("generate", "submit"):
        assert client_cli.main([command, *argv]) == 2
        assert capsys.readouterr().err.startswith(f"error: {field}: ")
        assert FakeClient.last.calls == []  # refused before any call, and before waiting for one


def test_json_events_carry_every_field_with_integers_as_numbers(fake, capsys):
    fake.events = [pb.Event(request_id="r", seq=0, token_ids=[5], logprobs=[-0.5]),
                   pb.Event(request_id="r", seq=1, token_ids=[0]),
                   final(2, pb.FINISH_REASON_STOP, stop_token_id=0, num_output_tokens=2,
                         metrics=pb.RequestMetrics(ttft_s=0.25, num_preemptions=0))]
    assert client_cli.main(["generate", "--token-ids", "[1]", "--json"]) == 0
    first, second, last = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert first["seq"] == 0 and second["seq"] == 1 and last["seq"] == 2  # numbers, the zero too
    assert first["finished"] is False and first["finish_reason"] == "FINISH_REASON_UNSPECIFIED"
    assert second["token_ids"] == [0] and first["logprobs"] == [-0.5] and second["logprobs"] == []
    assert first["num_output_tokens"] == 0 and set(first) == set(second)  # one shape per event
    assert "text" not in first and "metrics" not in first  # unset: no tokenizer, not the final event
    assert last["stop_token_id"] == 0 and last["num_output_tokens"] == 2
    assert last["metrics"]["ttft_s"] == 0.25 and last["metrics"]["num_preemptions"] == 0


def test_message_to_dict_writes_64_bit_integers_as_numbers_and_json_safe_floats():
    from qil_client.json_output import message_to_dict

    out = message_to_dict(pb.Event(seq=2**63 + 5, logprobs=[float("-inf"), float("nan"), 1.0]))
    assert out["seq"] == 2**63 + 5 and out["logprobs"] == ["-Infinity", "NaN", 1.0]
    assert json.loads(json.dumps(out)) == out
    info = message_to_dict(pb.GetInfoResponse(num_requests_total=7))
    assert info["num_requests_total"] == 7


def test_flags_reach_the_client(fake):
    fake.events = [final(0, pb.FINISH_REASON_LENGTH)]
    assert client_cli.main(["--tls", "--token", "tok", "generate", "--prompt", "hi", "--stop-token-ids", "[7, 8]"]) == 0
    c = FakeClient.last
    assert c.tls is True and c.token == "tok"
    kw = c.calls[-1][1]
    assert kw["stop_token_ids"] == [7, 8] and kw["text"] == "hi" and "messages" not in kw


def test_result_text_is_empty_not_none_when_all_deltas_are_empty():
    b = ResultBuilder()
    b.add(pb.Event(request_id="r", seq=0, token_ids=[1], text=""))
    b.add(final(1, pb.FINISH_REASON_LENGTH, text=""))
    assert b.result().text == ""


def test_result_error_and_metrics():
    b = ResultBuilder()
    b.add(final(0, pb.FINISH_REASON_LENGTH, metrics=pb.RequestMetrics(mean_itl_s=0.1, max_itl_s=0.9)))
    r = b.result()
    assert r.error is None
    assert r.metrics.mean_itl_s == pytest.approx(0.1) and r.metrics.max_itl_s == pytest.approx(0.9)


def test_result_builder_starts_at_a_given_seq_and_still_detects_gaps():
    b = ResultBuilder(start_seq=3)
    with pytest.raises(RuntimeError, match="seq 0, expected 3"):
        b.add(pb.Event(request_id="r", seq=0, token_ids=[1]))
    b.add(pb.Event(request_id="r", seq=3, token_ids=[4, 5]))
    with pytest.raises(RuntimeError, match="seq 6, expected 5"):
        b.add(pb.Event(request_id="r", seq=6, token_ids=[7]))
    b.add(pb.Event(request_id="r", seq=5, token_ids=[6], finished=True,
                   finish_reason=pb.FINISH_REASON_LENGTH, num_output_tokens=6))
    r = b.result()
    assert r.token_ids == [4, 5, 6] and r.num_output_tokens == 6 and r.finish_reason == "length"


@pytest.mark.parametrize("entries, bad", [
    ("127.0.0.1:1,127.0.0.1", "'127.0.0.1'"),
    (["127.0.0.1:1", "127.0.0.1:http"], "'127.0.0.1:http'"),
    (["[::1]:1", "[::1]"], "'[::1]'"),
    (["127.0.0.1:1", ":2"], "':2'"),
])
def test_a_target_list_entry_that_is_not_host_port_is_a_clear_value_error(entries, bad):
    with pytest.raises(ValueError, match=re.escape(bad) + ".*expected HOST:PORT"):
        resolve_target(entries)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        Client(entries)


def test_an_unresolvable_name_in_a_target_list_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'nonexistent.invalid:1'"):
        resolve_target("nonexistent.invalid:1,other.invalid:2")


def test_port_65535_is_a_valid_target_port():
    from qil_client._channel import resolve_target
    assert resolve_target(["127.0.0.1:65535", "127.0.0.1:1"]) == ("ipv4:127.0.0.1:65535,127.0.0.1:1", True)


def test_an_error_without_a_field_has_field_none():
    from qil_client.errors import error_for
    assert error_for(14, "worker is restarting", "").field is None


def test_submit_request_carries_one_constraint_in_the_oneof():
    from qil_client.results import submit_request

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    req = submit_request([1], json_schema=schema)
    assert req.WhichOneof("constraint") == "json_schema"
    assert req.json_schema == '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'
    assert submit_request([1], json_schema='{"type": "object"}').json_schema == '{"type": "object"}'
    assert submit_request([1], json_object=True).json_object is True
    assert submit_request([1], json_object=False).WhichOneof("constraint") is None  # False asks for none
    assert submit_request([1], regex="[0-9]+").regex == "[0-9]+"
    assert submit_request([1], grammar='start: "a"').grammar == 'start: "a"'
    assert list(submit_request([1], choice=("a", "b")).choice.choices) == ["a", "b"]
    empty = submit_request([1], choice=[])  # sent: the server names the empty list
    assert empty.WhichOneof("constraint") == "choice" and not empty.choice.choices
    assert submit_request([1]).WhichOneof("constraint") is None


@pytest.mark.parametrize("kwargs, error, field", [
    (dict(regex="a", choice=["a"]), ValueError, "choice"),
    (dict(json_schema={}, json_object=True), ValueError, "json_object"),
    (dict(json_schema=5), TypeError, "json_schema"),
    (dict(json_schema={"a": object()}), TypeError, "json_schema"),
    (dict(json_schema={"a": float("nan")}), TypeError, "json_schema"),
    (dict(json_object="yes"), TypeError, "json_object"),
    (dict(regex=3), TypeError, "regex"),
    (dict(grammar=b"start"), TypeError, "grammar"),
    (dict(choice="abc"), TypeError, "choice"),
    (dict(choice=[1, 2]), TypeError, "choice"),
    (dict(choice=7), TypeError, "choice"),
])
def test_a_constraint_the_wire_cannot_carry_names_its_field(kwargs, error, field):
    from qil_client.results import submit_request

    with pytest.raises(error, match=f"^{field}: "):
        submit_request([1], **kwargs)


def test_client_cli_sends_the_structured_output_flags(fake, tmp_path, capsys):
    fake.events = [final(0, pb.FINISH_REASON_STOP)]
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "a"')
    for flags, want in [
        (["--choice", "a", "--choice", "b"], {"choice": ["a", "b"]}),
        (["--json-schema", str(schema)], {"json_schema": '{"type": "object"}'}),
        (["--json-schema", '{"enum": [1]}'], {"json_schema": '{"enum": [1]}'}),
        (["--json-object"], {"json_object": True}),
        (["--regex", "[0-9]"], {"regex": "[0-9]"}),
        (["--grammar", str(grammar)], {"grammar": 'start: "a"'}),
        ([], {}),
    ]:
        assert client_cli.main(["generate", "--prompt", "x", *flags]) == 0
        kw = FakeClient.last.calls[-1][1]
        assert {k: kw[k] for k in ("json_schema", "json_object", "regex", "grammar", "choice") if k in kw} == want
    with pytest.raises(SystemExit) as exc:
        client_cli._parser().parse_args(["submit", "--prompt", "x", "--regex", "a", "--json-object"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
