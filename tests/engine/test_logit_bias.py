"""logit_bias: validated against the vocabulary, applied in the batched sampler as softmax(logits
+ bias), -100 banning and +100 forcing a token, seeded draws independent of the batch."""

import math

import pytest
import torch

from engine_helpers import assert_pool_free, reference_greedy, run_to_completion
from qil_worker import Engine, InvalidRequestError
from qil_worker.engine import sampler as sampler_module
from qil_worker.engine.outputs import RequestMetrics
from qil_worker.engine.request import Request
from qil_worker.engine.sampler import Sampler
from qil_worker.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from qil_worker.kv import PageTable

PROMPT = [7, 8, 9, 10, 11]
VOCAB = 97


def _request(**sampling) -> Request:
    return Request(
        request_id="r", prompt_token_ids=[1], max_new_tokens=8, stop_token_ids=frozenset(),
        page_table=PageTable(4), metrics=RequestMetrics(arrival_time=0.0),
        sampling=SamplingParams(**sampling), seed=sampling.get("seed") or 0,
    )


def test_a_dict_is_kept_as_sorted_pairs_and_the_params_stay_hashable():
    a = SamplingParams(logit_bias={5: 1.5, 2: -3})
    b = SamplingParams.from_kwargs(logit_bias={2: -3, 5: 1.5})
    assert a.logit_bias == ((2, -3), (5, 1.5)) and a == b and hash(a) == hash(b)
    assert SamplingParams().logit_bias == () and SamplingParams(logit_bias={}).logit_bias == ()


def test_biased_distribution_is_softmax_of_logits_plus_bias(model, ref):
    """Greedy with top_logprobs: the engine's log-probabilities at every step are those of
    transformers' logits plus the bias (float32), and the greedy token is their argmax."""
    bias = {3: 2.5, 40: -1.25, 41: 4.0, 96: 0.5}
    engine = Engine(model, num_pages=64, page_size=4)
    rid = engine.submit(PROMPT, max_new_tokens=6, logprobs=True, top_logprobs=20, logit_bias=bias)
    events = run_to_completion(engine)
    tokens = engine.result(rid).output_token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    added = torch.zeros(VOCAB)
    added[list(bias)] = torch.tensor(list(bias.values()))
    want = torch.log_softmax(logits + added, dim=-1)
    assert tokens == want.argmax(dim=-1).tolist()
    for i, e in enumerate(events):
        assert e.logprob == pytest.approx(float(want[i, e.token_id]), abs=1e-4)
        top_values, top_ids = want[i].topk(20)
        assert [t for t, _ in e.top_logprobs] == top_ids.tolist()
        assert [v for _, v in e.top_logprobs] == pytest.approx(top_values.tolist(), abs=1e-4)
    assert_pool_free(engine)


def test_plus_100_forces_a_token_under_greedy(model):
    engine = Engine(model, num_pages=64, page_size=4)
    (free,) = engine.generate([PROMPT], max_new_tokens=8)
    forced = next(t for t in range(VOCAB) if t not in free.output_token_ids)
    (res,) = engine.generate([PROMPT], max_new_tokens=8, logit_bias={forced: 100.0})
    assert res.output_token_ids == [forced] * 8


def test_minus_100_bans_tokens_greedy_and_sampled(model, ref):
    engine = Engine(model, num_pages=64, page_size=4)
    greedy = reference_greedy(ref, PROMPT, 12)
    banned = {t: -100.0 for t in greedy}
    (res,) = engine.generate([PROMPT], max_new_tokens=12, logit_bias=banned)
    assert not set(res.output_token_ids) & set(banned)
    sampled = engine.generate([PROMPT] * 4, max_new_tokens=24, temperature=1.0, seed=5, logit_bias=banned)
    free = engine.generate([PROMPT] * 4, max_new_tokens=24, temperature=1.0, seed=5)
    assert all(not set(r.output_token_ids) & set(banned) for r in sampled)
    assert any(set(r.output_token_ids) & set(banned) for r in free), "the ban was meant to matter"


def test_seeded_biased_request_is_the_same_alone_and_batched(model):
    kwargs = dict(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=77, logit_bias={5: 3.0, 6: -2.0, 50: 1.0})
    (alone,) = Engine(model, num_pages=64, page_size=4).generate([PROMPT], **kwargs)
    crowd = Engine(model, num_pages=64, page_size=4, token_budget=24, prefill_chunk=8)
    others = [
        crowd.submit([3, 1, 4, 1, 5], max_new_tokens=12, temperature=1.0, seed=1),
        crowd.submit([2, 7, 1, 8], max_new_tokens=12, temperature=0.5, seed=2, logit_bias={9: 5.0}),
        crowd.submit(list(range(30)), max_new_tokens=12),
    ]
    rid = crowd.submit(PROMPT, **kwargs)
    run_to_completion(crowd)
    assert crowd.result(rid).output_token_ids == alone.output_token_ids
    assert all(crowd.result(o).finish_reason.value == "length" for o in others)
    assert_pool_free(crowd)


def test_rows_without_a_bias_are_untouched_and_a_step_without_any_skips_the_stage(monkeypatch):
    logits = torch.randn(3, 10)
    rows = [_request(logit_bias={2: 50.0}), _request(), _request(logit_bias={0: -100.0, 9: 100.0})]
    out = Sampler().sample(logits, rows)
    assert out.tokens == [2, int(logits[1].argmax()), 9]
    calls = []
    monkeypatch.setattr(sampler_module, "apply_logit_bias", lambda *a: calls.append(a))
    plain = Sampler().sample(logits, [_request(), _request(), _request()])
    assert calls == [] and plain.tokens == logits.argmax(dim=-1).tolist()


def test_the_bias_is_added_in_one_batched_op():
    logits = torch.zeros(2, 6)
    params = [SamplingParams(logit_bias={1: 2.0, 4: -3.0}), SamplingParams(logit_bias={4: 1})]
    biased = sampler_module.apply_logit_bias(logits, params)
    want = torch.tensor([[0, 2.0, 0, 0, -3.0, 0], [0, 0, 0, 0, 1.0, 0]])
    assert torch.equal(biased, want) and torch.equal(logits, torch.zeros(2, 6))


@pytest.mark.parametrize(
    "bias",
    [
        {VOCAB: 1.0},  # one past the vocabulary
        {-1: 1.0},
        {3: 100.5},
        {3: -101.0},
        {3: math.nan},
        {3: math.inf},
        {3: "high"},
        {3: True},
        {True: 1.0},
        {"3": 1.0},
        {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)},
        ((3, 1.0), (3, 2.0)),  # one id twice (a dict cannot say it; pairs can)
        "3=1",
    ],
)
def test_bad_logit_bias_is_invalid_naming_the_field(model, bias):
    engine = Engine(model, num_pages=16, page_size=4)
    with pytest.raises(InvalidRequestError) as exc:
        engine.submit([1, 2], max_new_tokens=2, logit_bias=bias)
    assert exc.value.field == "logit_bias"
    assert engine.idle


def test_the_range_and_count_limits_themselves_are_accepted(model):
    engine = Engine(model, num_pages=16, page_size=4)
    bias = {i: (100.0 if i % 2 else -100) for i in range(min(MAX_LOGIT_BIAS, VOCAB))}
    engine.submit([1, 2], max_new_tokens=2, logit_bias=bias)
    engine.submit([1, 2], max_new_tokens=2, logit_bias={VOCAB - 1: 0.0})
    run_to_completion(engine)
    assert_pool_free(engine)


def test_both_command_lines_take_repeatable_logit_bias_flags(tiny_dir, capsys):
    import argparse
    import json

    from qil_client.__main__ import _parser as client_parser
    from qil_client.__main__ import request_kwargs
    from qil_worker.cli_generate import add_generate_parser, sampling_kwargs

    parser = argparse.ArgumentParser()
    add_generate_parser(parser.add_subparsers())
    argv = ["generate", "--model", str(tiny_dir), "--token-ids", "[7,8,9]", "--max-new-tokens", "4",
            "--json", "--logit-bias", "5=100", "--logit-bias", "6=-2.5", "--logit-bias", "5=99"]
    args = parser.parse_args(argv)
    assert sampling_kwargs(args) == {"logit_bias": {5: 99.0, 6: -2.5}}  # a later one for an id wins
    assert args.run(args) == 0
    assert json.loads(capsys.readouterr().out)["output_token_ids"] == [5] * 4
    kw = request_kwargs(client_parser().parse_args(["generate", "--token-ids", "[1]", "--logit-bias", "3=-1"]))
    assert kw["logit_bias"] == {3: -1.0}
    assert "logit_bias" not in request_kwargs(client_parser().parse_args(["generate", "--token-ids", "[1]"]))
    for bad in ("5", "x=1", "5=high"):
        with pytest.raises(SystemExit):
            parser.parse_args(argv[:-2] + ["--logit-bias", bad])
    assert "ID=BIAS" in capsys.readouterr().err
