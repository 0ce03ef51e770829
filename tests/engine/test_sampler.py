"""The batched sampler against transformers' logits processors, and its draw frequencies."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from qil_worker.engine.outputs import RequestMetrics
from qil_worker.engine.request import Request
from qil_worker.engine.sampler import Sampler, apply_penalties, truncate
from qil_worker.engine.sampling_params import SamplingParams
from qil_worker.errors import InvalidRequestError
from qil_worker.kv import PageTable


def _request(prompt=(1, 2), output=(), seed=0, stops=(), **params):
    r = Request("r", list(prompt), 100, frozenset(stops), PageTable(4), RequestMetrics(0.0),
                sampling=SamplingParams(**params), seed=seed)
    r.output_token_ids.extend(output)
    return r


PARAM_ROWS = [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=0.5, top_k=20, top_p=0.6, min_p=0.05),
    dict(temperature=1.0, top_k=1),
]


def _reference(logits_row, p):
    warpers = [TemperatureLogitsWarper(p["temperature"])]
    if p.get("top_k"):
        warpers.append(TopKLogitsWarper(p["top_k"]))
    if p.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(p["top_p"]))
    if p.get("min_p", 0.0) > 0:
        warpers.append(MinPLogitsWarper(p["min_p"]))
    scores = logits_row[None].clone()
    for w in warpers:
        scores = w(None, scores)
    return scores[0]


def test_masks_match_transformers_processors_in_one_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(len(PARAM_ROWS), 50) * 3
    params = [SamplingParams(**p) for p in PARAM_ROWS]
    temps = torch.tensor([p.temperature for p in params])[:, None]
    got = truncate(logits / temps, params)
    for i, p in enumerate(PARAM_ROWS):
        want = _reference(logits[i], p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), p
        kept = ~torch.isinf(want)
        torch.testing.assert_close(got[i][kept], want[kept])


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(1)
    logits = torch.randn(2, 30) * 2
    reqs = [_request(prompt=[1, 5, 7], output=[7, 9], repetition_penalty=1.3),
            _request(prompt=[2], output=[3], repetition_penalty=0.8)]
    got = apply_penalties(logits, reqs)
    for i, r in enumerate(reqs):
        ids = torch.tensor([r.prompt_token_ids + r.output_token_ids])
        want = RepetitionPenaltyLogitsProcessor(r.sampling.repetition_penalty)(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(got[i], want[0])


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros(1, 6)
    r = _request(prompt=[0], output=[2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, [r])[0]
    assert got.tolist() == [0.0, 0.0, -1.0, -0.75, 0.0, 0.0]


def test_greedy_rows_take_argmax_beside_sampled_rows():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    reqs = [_request(), _request(temperature=1.0, seed=5), _request()]
    out = Sampler().sample(logits, reqs)
    assert out.tokens[0] == int(logits[0].argmax()) and out.tokens[2] == int(logits[2].argmax())


def test_min_new_tokens_masks_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    r = _request(stops=[1], min_new_tokens=2, output=[2])
    assert Sampler().sample(logits, [r]).tokens == [2]
    r.output_token_ids.append(2)
    assert Sampler().sample(logits, [r]).tokens == [1]


def test_logprobs_after_temperature_before_truncation():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    r = _request(temperature=0.5, top_k=1, seed=3, logprobs=True, top_logprobs=3)
    out = Sampler().sample(logits, [r])
    expected = torch.log_softmax(logits / 0.5, dim=-1)[0]
    assert out.tokens == [0]  # top_k=1 leaves one choice
    assert out.logprobs[0] == pytest.approx(float(expected[0]), abs=1e-6)
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1, 2]
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(expected[:3].tolist(), abs=1e-6)


# chi-square critical values at p = 0.001 for 1..10 degrees of freedom
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59]


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.2, top_p=0.85),
                                    dict(temperature=1.0, top_k=4, min_p=0.05)])
def test_draw_frequencies_follow_the_distribution(params):
    torch.manual_seed(3)
    logits = torch.randn(1, 8)
    want = _reference(logits[0], params).softmax(-1)
    n = 4000
    reqs = [_request(seed=s, **params) for s in range(n)]  # distinct seeds, a batch of rows
    tokens = Sampler().sample(logits.expand(n, -1), reqs).tokens
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    assert counts[want == 0].sum() == 0, "a truncated token was drawn"
    support = want > 0
    expected = want[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < CHI2_999[dof - 1], (chi2, counts, expected)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=float("inf")), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(frequency_penalty=-2.5), "frequency_penalty"),
        (dict(seed=-1), "seed"),
        (dict(min_new_tokens=11), "min_new_tokens"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate(max_new_tokens=10)
    assert info.value.field == field


# -- boundaries and independence: off-by-ones and cross-row leaks the tests above let pass --


def test_top_p_boundary_matches_transformers():
    logits = torch.zeros(1, 4)  # probabilities exactly 0.25: cumulative 0.25, 0.5, 0.75, 1
    ours = truncate(logits, [SamplingParams(temperature=1.0, top_p=0.75)])
    theirs = TopPLogitsWarper(0.75)(None, logits.clone())
    assert int(torch.isfinite(ours).sum()) == int(torch.isfinite(theirs).sum()) == 3


def test_min_p_boundary_matches_transformers():
    logits = torch.log(torch.tensor([[4.0, 2.0, 1.0, 1.0]]))  # p / p_max = 1, .5, .25, .25
    ours = truncate(logits, [SamplingParams(temperature=1.0, min_p=0.5)])
    theirs = MinPLogitsWarper(0.5)(None, logits.clone())
    assert torch.isfinite(ours).tolist() == torch.isfinite(theirs).tolist() == [[True, True, False, False]]


def test_a_tiny_top_p_keeps_the_most_likely_token():
    torch.manual_seed(0)
    for vocab in (3, 97, 1000, 151936):
        logits = torch.randn(4, vocab)
        out = truncate(logits, [SamplingParams(temperature=1.0, top_p=1e-9)] * 4)
        assert torch.isfinite(out).sum(dim=1).tolist() == [1] * 4
        assert (out.argmax(dim=1) == logits.argmax(dim=1)).all()




def test_a_greedy_rows_logprobs_do_not_depend_on_its_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(2, 10)
    alone = Sampler().sample(logits[:1], [_request(seed=1, logprobs=True)])
    mixed = Sampler().sample(logits, [_request(seed=1, logprobs=True), _request(temperature=0.7, seed=3)])
    assert mixed.tokens[0] == alone.tokens[0]
    assert mixed.logprobs[0] == pytest.approx(alone.logprobs[0], abs=1e-6)
    assert alone.logprobs[0] == pytest.approx(float(torch.log_softmax(logits[0], -1).max()), abs=1e-6)


def test_top_logprobs_alone_also_give_the_chosen_logprob():
    out = Sampler().sample(torch.tensor([[2.0, 1.0, 0.0]]), [_request(seed=1, top_logprobs=2)])
    assert out.logprobs[0] == pytest.approx(float(torch.log_softmax(torch.tensor([2.0, 1.0, 0.0]), -1)[0]))


@pytest.mark.parametrize("kwargs, field", [(dict(seed=2**64), "seed"), (dict(logprobs=1), "logprobs")])
def test_more_bad_values_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate(max_new_tokens=10)
    assert info.value.field == field
