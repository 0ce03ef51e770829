"""logit_bias and prompt_logprobs over gRPC against one real server: what the engine computes
reaches the caller through Generate, a late Subscribe and the CLI, and bad values are
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json
import pickle

import grpc
import pytest
import torch

from checkpoints import load_reference
from qil_client import InvalidArgument
from qil_client.__main__ import main as client_main
from qil_client.results import ResultBuilder, submit_request
from qil_worker.engine.sampling_params import MAX_LOGIT_BIAS
from qil_worker.service import protocol as P
from qil_worker.service.front.request_log import FrontRequest, retained_size
from qil_worker.service.front.streams import build_event
from service_fixtures import ENGINE, reference_outputs, wait_until

ATOL = 1e-4
# longer than the server's prefill chunk, so the prompt is scored over several chunks
PROMPT = [(7 * i + 2) % 97 for i in range(ENGINE["prefill_chunk"] * 2 + 5)]


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' log-probabilities of PROMPT[1:] and the 3 best at each position."""
    ref = load_reference(model_dir)
    with torch.no_grad():
        logprobs = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0, :-1], dim=-1)
    return logprobs.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1), logprobs.topk(3, dim=-1)


def _assert_matches(result, reference):
    own, best = reference
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs), own, atol=ATOL, rtol=0, check_dtype=False)
    assert [[t for t, _ in top] for top in result.prompt_top_logprobs] == best.indices.tolist()
    values = torch.tensor([[v for _, v in top] for top in result.prompt_top_logprobs])
    torch.testing.assert_close(values, best.values, atol=ATOL, rtol=0, check_dtype=False)


def test_generate_returns_prompt_logprobs_on_the_first_event(client, model_dir, reference):
    events = list(client.stream(PROMPT, max_new_tokens=4, prompt_logprobs=3))
    assert events[0].seq == 0 and len(events[0].prompt_logprobs) == len(PROMPT) - 1
    assert len(events[0].prompt_top_logprobs) == len(PROMPT) - 1
    assert all(not e.prompt_logprobs and not e.prompt_top_logprobs for e in events[1:])
    builder = ResultBuilder()
    for e in events:
        builder.add(e)
    result = builder.result()
    _assert_matches(result, reference)
    assert result.token_ids == reference_outputs(model_dir, [PROMPT], 4)[0]
    assert result.num_cached_tokens == 0


def test_a_late_subscriber_from_seq_0_gets_them_too(client, reference):
    rid = client.submit(PROMPT, max_new_tokens=6, prompt_logprobs=3, request_id="late-prompt-logprobs")
    wait_until(lambda: client.info().num_unfinished == 0)
    result = client.result(rid)
    assert result.finish_reason == "length" and len(result.token_ids) == 6
    assert result.num_cached_tokens == 0  # the test above left PROMPT's pages in the cache
    _assert_matches(result, reference)
    tail = list(client.events(rid, from_seq=2))
    assert tail[0].seq == 2 and all(not e.prompt_logprobs for e in tail)
    assert client.info().pages.used == 0


def test_prompt_logprobs_0_give_only_the_prompt_tokens_own(client, reference):
    result = client.generate(PROMPT, max_new_tokens=2, prompt_logprobs=0)
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs), reference[0], atol=ATOL, rtol=0,
                               check_dtype=False)
    assert result.prompt_top_logprobs is None
    plain = client.generate(PROMPT, max_new_tokens=2)
    assert plain.prompt_logprobs is None and plain.token_ids == result.token_ids


def test_logit_bias_forces_and_bans_over_grpc(client, model_dir):
    free = reference_outputs(model_dir, [[1, 2, 3]], 6)[0]
    forced = next(t for t in range(97) if t not in free)
    assert client.generate([1, 2, 3], max_new_tokens=6, logit_bias={forced: 100.0}).token_ids == [forced] * 6
    banned = client.generate([1, 2, 3], max_new_tokens=6, logit_bias={t: -100 for t in free})
    assert not set(banned.token_ids) & set(free)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(logit_bias={97: 1.0}), "logit_bias"),  # the service model's vocabulary is 97
        (dict(logit_bias={3: 100.5}), "logit_bias"),
        (dict(logit_bias={3: float("nan")}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias"),  # the front's count
        (dict(prompt_logprobs=21), "prompt_logprobs"),
    ],
)
def test_bad_values_are_invalid_argument_naming_the_field(client, kwargs, field):
    for call in (client.submit, client.generate):
        with pytest.raises(InvalidArgument) as exc:
            call([1, 2, 3], max_new_tokens=2, **kwargs)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and exc.value.field == field
        assert exc.value.details.startswith(field + ":")


def test_client_cli_json_has_them_and_sends_logit_bias(server, capsys, reference):
    argv = ["--target", server.target, "generate", "--token-ids", json.dumps(PROMPT), "--json",
            "--max-new-tokens", "3", "--prompt-logprobs", "3", "--logit-bias", "11=100"]
    assert client_main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [t for line in lines for t in line["token_ids"]] == [11, 11, 11]
    first = lines[0]
    torch.testing.assert_close(torch.tensor(first["prompt_logprobs"]), reference[0], atol=ATOL, rtol=0,
                               check_dtype=False)
    tops = [[c["token_id"] for c in top["candidates"]] for top in first["prompt_top_logprobs"]]
    assert tops == reference[1].indices.tolist()
    assert all(line["prompt_logprobs"] == [] for line in lines[1:])


def test_submit_request_carries_logit_bias_and_names_what_the_wire_cannot_carry():
    req = submit_request([1], logit_bias={5: -1.5, 2: 100}, prompt_logprobs=0)
    assert dict(req.logit_bias) == {5: -1.5, 2: 100.0} and req.HasField("prompt_logprobs")
    assert not submit_request([1]).logit_bias and not submit_request([1]).HasField("prompt_logprobs")
    for bad, error in (({-1: 1.0}, ValueError), ({"a": 1.0}, TypeError), ([(1, 2.0)], TypeError)):
        with pytest.raises(error, match="^logit_bias: "):
            submit_request([1], logit_bias=bad)


def test_build_event_carries_them_from_seq_0_only_and_retention_counts_them():
    req = FrontRequest("r", prompt_len=3)
    assert retained_size(req) == 1
    req.prompt_logprobs = P.ScoredPrompt([-1.0, -2.0], [[(4, -0.5), (1, -1.0)], [(2, -0.25), (3, -2.0)]])
    req.append(5, None, None, None)
    req.append(6, None, None, None)
    ev, cursor, _ = build_event(req, 0)
    assert list(ev.prompt_logprobs) == [-1.0, -2.0] and cursor == 2
    assert [[(c.token_id, c.logprob) for c in t.candidates] for t in ev.prompt_top_logprobs] == [
        [(4, -0.5), (1, -1.0)], [(2, -0.25), (3, -2.0)]
    ]
    ev, _, _ = build_event(req, 1)
    assert not ev.prompt_logprobs and not ev.prompt_top_logprobs
    assert retained_size(req) == 2 + 2 * 3
    plain = FrontRequest("p", prompt_len=3)
    plain.append(5, None, None, None)
    ev, _, _ = build_event(plain, 0)
    assert not ev.prompt_logprobs


def test_step_batches_carry_them_sparsely_through_a_pickle():
    stats = P.PoolStats(8, 1, 7, 1, 0, 0, 0.0)
    scored = P.ScoredPrompt([-1.0, -0.5], None)
    batch = P.StepBatch([], ["a", "b"], [3, 4], [None, None], [None, None], [None, None], {}, stats, None,
                        {}, {"b": scored})
    back = pickle.loads(pickle.dumps(batch))
    assert back.prompt_logprobs == {"b": scored} and back.token_ids == [3, 4]
    empty = P.StepBatch([], ["a"], [3], [None], [None], [None], {}, stats, None, {}, {})
    assert pickle.loads(pickle.dumps(empty)).prompt_logprobs == {}
