"""Prefill-only requests: embeddings (last-token pooling, Matryoshka ``dimensions``) and yes/no
scores, against transformers' hidden states and logits, batched with generation traffic,
chunked, prefix-cached, preempted, cancelled and overlapped; every page free afterwards."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_text_checkpoint
from engine_helpers import assert_pool_free, random_prompts, reference_greedy, run_to_completion
from qil_worker import Engine, FinishReason, InvalidRequestError, Qwen3
from qil_worker.engine.sampling_params import SamplingParams
from qil_worker.engine.spec import Pooling, Prompt, RequestSpec
from qil_worker.structured.spec import ConstraintSpec
from qil_worker.text import load_tokenizer
from qil_worker.text.prompt import encode_document

COSINE = 0.99999  # float32 against float32: the same math in another order
ATOL = 1e-5
YES, NO = 11, 42


def reference_hidden(ref, prompt: list[int]) -> torch.Tensor:
    """transformers' final (normed) hidden state of the prompt's last token."""
    with torch.no_grad():
        return ref.model(torch.tensor([prompt])).last_hidden_state[0, -1]


def reference_score(ref, prompt: list[int]) -> float:
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, -1]
    return torch.softmax(logits[[NO, YES]], dim=-1)[1].item()


def assert_embedding(got: list[float], expected: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == expected.shape
    assert F.cosine_similarity(got_t, expected, dim=0).item() >= COSINE
    torch.testing.assert_close(got_t, expected, atol=ATOL, rtol=1e-4)


def engine_for(model, **kwargs) -> Engine:
    settings = dict(num_pages=64, page_size=4, token_budget=32, prefill_chunk=8, max_active=8)
    return Engine(model, **{**settings, **kwargs})


def test_embeddings_are_transformers_last_token_pooling_alone_and_batched(model, ref):
    prompts = random_prompts([1, 3, 17, 40], seed=2)
    expected = [F.normalize(reference_hidden(ref, p), dim=-1) for p in prompts]
    engine = engine_for(model)
    alone = [engine.embed([p])[0] for p in prompts]
    batched = engine.embed(prompts)
    for got_alone, got_batched, want in zip(alone, batched, expected):
        assert_embedding(got_alone, want)
        assert_embedding(got_batched, want)
    assert_pool_free(engine)


def test_embeddings_beside_generation_leave_its_tokens_unchanged(model, ref):
    engine = engine_for(model)
    generated = random_prompts([5, 30], seed=7)
    embedded = random_prompts([25, 2, 12], seed=8)
    gen_ids = [engine.submit(p, max_new_tokens=8) for p in generated]
    emb_ids = [engine.submit(RequestSpec.pooled(Pooling("embed"), p)) for p in embedded]
    events = run_to_completion(engine)
    for rid, prompt in zip(gen_ids, generated):
        assert engine.result(rid).output_token_ids == reference_greedy(ref, prompt, 8)
    for rid, prompt in zip(emb_ids, embedded):
        result = engine.result(rid)
        assert result.finish_reason is FinishReason.STOP and result.output_token_ids == []
        assert result.ttft is not None and result.score is None
        assert_embedding(result.embedding, F.normalize(reference_hidden(ref, prompt), dim=-1))
        # one event per pooled request: its final one, carrying no token
        mine = [e for e in events if e.request_id == rid]
        assert len(mine) == 1 and mine[0].finished and mine[0].token_id is None
    assert_pool_free(engine)


def test_a_warm_prefix_cache_gives_the_same_embedding(model, ref):
    engine = engine_for(model)
    prompt = random_prompts([33], seed=4)[0]
    first = engine.submit(RequestSpec.pooled(Pooling("embed"), prompt))
    run_to_completion(engine)
    second = engine.submit(RequestSpec.pooled(Pooling("embed"), prompt))
    run_to_completion(engine)
    cached = engine.result(second)
    assert cached.num_cached_tokens >= 28, "the second request was meant to start from cached pages"
    assert_embedding(cached.embedding, torch.tensor(engine.result(first).embedding))
    assert_embedding(cached.embedding, F.normalize(reference_hidden(ref, prompt), dim=-1))
    assert_pool_free(engine)


@pytest.mark.parametrize("dimensions", [1, 8, 63, 64])
def test_dimensions_truncate_then_renormalise(model, ref, dimensions):
    prompt = random_prompts([9], seed=dimensions)[0]
    got = engine_for(model).embed([prompt], dimensions=dimensions)[0]
    assert_embedding(got, F.normalize(reference_hidden(ref, prompt)[:dimensions], dim=-1))


def test_normalize_false_gives_the_raw_hidden_state(model, ref):
    prompt = random_prompts([6], seed=1)[0]
    got = engine_for(model).embed([prompt], dimensions=16, normalize=False)[0]
    assert_embedding(got, reference_hidden(ref, prompt)[:16])


def test_scores_are_the_yes_probability_of_transformers_logits(model, ref):
    prompts = random_prompts([4, 21, 1], seed=9)
    engine = engine_for(model)
    scores = engine.score(prompts, yes_token_id=YES, no_token_id=NO)
    assert scores == pytest.approx([reference_score(ref, p) for p in prompts], abs=1e-6)
    assert all(0.0 < s < 1.0 for s in scores)
    # mixed with embeddings in one step: each gets its own kind of answer
    e_id = engine.submit(RequestSpec.pooled(Pooling("embed"), prompts[1]))
    s_id = engine.submit(RequestSpec.pooled(Pooling("score", yes_token_id=YES, no_token_id=NO), prompts[1]))
    run_to_completion(engine)
    assert engine.result(s_id).score == pytest.approx(scores[1], abs=1e-6) and engine.result(s_id).embedding is None
    assert_embedding(engine.result(e_id).embedding, F.normalize(reference_hidden(ref, prompts[1]), dim=-1))
    assert_pool_free(engine)


def test_preempted_and_cancelled_pooled_requests_free_every_page(model, ref):
    """A pool too small for all of them at once: pooled and generating requests preempt each
    other; one pooled request is cancelled mid-prompt; answers and tokens stay exact."""
    engine = engine_for(model, num_pages=14, token_budget=16, prefill_chunk=4)
    embedded = random_prompts([30, 22, 26], seed=12)
    generated = random_prompts([10, 14], seed=13)
    emb_ids = [engine.submit(RequestSpec.pooled(Pooling("embed"), p)) for p in embedded]
    gen_ids = [engine.submit(p, max_new_tokens=12) for p in generated]
    victim = engine.submit(RequestSpec.pooled(Pooling("embed"), random_prompts([40], seed=14)[0]))
    for _ in range(3):
        engine.step()
    assert engine.cancel(victim)
    run_to_completion(engine)
    assert engine.result(victim).finish_reason is FinishReason.CANCELLED
    assert engine.result(victim).embedding is None
    results = [engine.result(i) for i in emb_ids + gen_ids]
    assert sum(r.num_preemptions for r in results) > 0, "the pool was meant to force preemption"
    for rid, prompt in zip(emb_ids, embedded):
        assert_embedding(engine.result(rid).embedding, F.normalize(reference_hidden(ref, prompt), dim=-1))
    for rid, prompt in zip(gen_ids, generated):
        assert engine.result(rid).output_token_ids == reference_greedy(ref, prompt, 12)
    assert_pool_free(engine)


def test_an_overlapped_engine_gives_the_same_answers(model, ref):
    engine = engine_for(model, overlap=True)
    prompts = random_prompts([7, 19], seed=21)
    gen = engine.submit(random_prompts([6], seed=22)[0], max_new_tokens=10)
    got = engine.embed(prompts)
    run_to_completion(engine)
    for g, p in zip(got, prompts):
        assert_embedding(g, F.normalize(reference_hidden(ref, p), dim=-1))
    assert engine.result(gen).output_token_ids == reference_greedy(ref, random_prompts([6], seed=22)[0], 10)
    assert_pool_free(engine)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Pooling("average"), "pooling"),
        (lambda: Pooling("embed", dimensions=0), "dimensions"),
        (lambda: Pooling("embed", dimensions=True), "dimensions"),
        (lambda: Pooling("embed", normalize="yes"), "normalize"),
        (lambda: Pooling("score", yes_token_id=1), "no_token_id"),
        (lambda: Pooling("score", yes_token_id=1, no_token_id=2, dimensions=4), "dimensions"),
        (lambda: Pooling("embed", yes_token_id=1), "yes_token_id"),
        (lambda: RequestSpec(Prompt(token_ids=[1, 2]), sampling=SamplingParams(n=2), pooling=Pooling("embed")), "n"),
        (lambda: RequestSpec(Prompt(token_ids=[1, 2]), constraint=ConstraintSpec("json_object", True),
                             pooling=Pooling("embed")), "constraint"),
    ],
)
def test_bad_pooling_is_refused_naming_the_field(make, field):
    with pytest.raises(InvalidRequestError) as err:
        make()
    assert err.value.field == field


@pytest.mark.parametrize(
    "pooling, field",
    [
        (Pooling("embed", dimensions=65), "dimensions"),  # the tiny model's hidden size is 64
        (Pooling("score", yes_token_id=97, no_token_id=1), "yes_token_id"),
        (Pooling("score", yes_token_id=1, no_token_id=10**6), "no_token_id"),
    ],
)
def test_what_needs_the_model_is_refused_at_submit(model, pooling, field):
    engine = engine_for(model)
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(RequestSpec.pooled(pooling, [1, 2, 3]))
    assert err.value.field == field
    assert engine.idle
    assert_pool_free(engine)


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory):
    """A text checkpoint whose tokenizer appends <|endoftext|> to every sequence, as
    Qwen3-Embedding's does (a TemplateProcessing post-processor)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    path = make_text_checkpoint(tmp_path_factory.mktemp("embedding"))
    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
    )
    tok.save_pretrained(path)
    return path


def test_text_is_encoded_with_the_tokenizers_own_special_tokens(embedding_dir, tmp_path_factory):
    tok = load_tokenizer(embedding_dir)
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    for text in ("hello world", "a", "héllo wörld " * 300):
        ids = encode_document(tok, text)
        assert ids == tok(text)["input_ids"] and ids[-1] == eos
    plain = load_tokenizer(make_text_checkpoint(tmp_path_factory.mktemp("chat")))
    assert encode_document(plain, "hello world") == plain.encode("hello world", add_special_tokens=False)


def test_text_embeddings_pool_the_appended_token(embedding_dir):
    from checkpoints import load_reference

    tok = load_tokenizer(embedding_dir)
    ref = load_reference(embedding_dir)
    engine = Engine(Qwen3.from_directory(embedding_dir, dtype="float32"), num_pages=64, page_size=4, tokenizer=tok)
    texts = ["the quick brown fox", "jumps over the lazy dog"]
    got = engine.embed(texts)
    for text, g in zip(texts, got):
        ids = tok(text)["input_ids"]
        assert_embedding(g, F.normalize(reference_hidden(ref, ids), dim=-1))
    assert_pool_free(engine)
