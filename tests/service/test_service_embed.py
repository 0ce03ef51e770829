"""Embed and Rerank over gRPC: a real server (its worker spawned) answers as the in-process
engine and as transformers do, refuses bad calls naming the field, and leaves every page free.

One model serves both calls (``make_judge_checkpoint``).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from checkpoints import load_reference, make_judge_checkpoint
from qil_client import AsyncClient, Client, FailedPrecondition, InvalidArgument
from qil_worker.text.rerank_prompt import rerank_prompt
from service_fixtures import start_server, wait_until

ENGINE = dict(num_pages=64, page_size=8, token_budget=128, prefill_chunk=32, max_active=8)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return make_judge_checkpoint(tmp_path_factory.mktemp("judge"))


@pytest.fixture(scope="module")
def server(judge_dir):
    srv = start_server(judge_dir, engine=ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(judge_dir):
    from transformers import AutoTokenizer

    return load_reference(judge_dir), AutoTokenizer.from_pretrained(judge_dir)


def hidden(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref.model(torch.tensor([ids])).last_hidden_state[0, -1]


def idle(client: Client) -> bool:
    info = client.info()
    return info.num_unfinished == 0 and info.pages.used == 0


def test_text_and_token_embeddings_are_transformers_pooling(server, reference):
    ref, tok = reference
    texts = ["the cat sat on the mat", "a", "héllo wörld, " * 40]
    with Client(server.target, timeout=60) as client:
        got = client.embed(texts)
        ids = [tok(t)["input_ids"] for t in texts]
        assert got.num_prompt_tokens == sum(len(i) for i in ids)
        for vector, i in zip(got.vectors, ids):
            want = F.normalize(hidden(ref, i), dim=-1)
            assert F.cosine_similarity(torch.tensor(vector), want, dim=0).item() >= 0.99999
        by_ids = client.embed([[5, 6, 7, 8], [9]], dimensions=16)
        for vector, i in zip(by_ids.vectors, [[5, 6, 7, 8], [9]]):
            assert len(vector) == 16
            want = F.normalize(hidden(ref, i)[:16], dim=-1)
            torch.testing.assert_close(torch.tensor(vector), want, atol=1e-5, rtol=1e-4)
        raw = client.embed([[5, 6, 7, 8]], normalize=False).vectors[0]
        torch.testing.assert_close(torch.tensor(raw), hidden(ref, [5, 6, 7, 8]), atol=1e-4, rtol=1e-4)
        wait_until(lambda: idle(client))


def test_rerank_orders_documents_by_the_yes_probability(server, reference):
    ref, tok = reference
    query, docs = "where do cats sleep", ["on the mat", "in the box", "the dog barks", "cats sleep all day"]
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    expected = []
    for d in docs:
        ids = tok(rerank_prompt(query, d), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0, -1]
        expected.append(torch.softmax(logits[[no, yes]], dim=-1)[1].item())
    with Client(server.target, timeout=60) as client:
        ranked = client.rerank(query, docs)
        assert [r.index for r in ranked] == sorted(range(len(docs)), key=lambda i: -expected[i])
        for r in ranked:
            assert r.relevance_score == pytest.approx(expected[r.index], abs=1e-5)
        top = client.rerank(query, docs, top_n=2)
        assert [r.index for r in top] == [r.index for r in ranked[:2]]
        other = client.rerank(query, docs, instruction="Judge the document's grammar")
        assert [r.relevance_score for r in other] != [r.relevance_score for r in ranked]
        wait_until(lambda: idle(client))


def test_embedding_calls_run_beside_generation_and_share_the_prefix_cache(server):
    async def run():
        async with AsyncClient(server.target, timeout=60) as client:
            long_text = "the quick brown fox jumps over the lazy dog " * 12
            gen = asyncio.ensure_future(client.generate([5, 6, 7], max_new_tokens=24))
            first, second, _ = await asyncio.gather(
                client.embed([long_text]), client.embed([long_text, "x"]), gen
            )
            assert first.vectors[0] == pytest.approx(second.vectors[0], abs=1e-5)
            again = await client.embed([long_text])
            assert again.num_cached_tokens > 0, "a repeated input was meant to start from cached pages"

    asyncio.run(run())
    with Client(server.target, timeout=60) as client:
        wait_until(lambda: idle(client))


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda c: c.embed([]), "inputs"),
        (lambda c: c.embed(["a"], dimensions=65), "texts[0].dimensions"),
        (lambda c: c.embed(["a"], dimensions=0), "dimensions"),
        (lambda c: c.embed([[1, 2], []]), "inputs[1]"),
        (lambda c: c.embed([[1, 10**6]]), "inputs[0]"),
        (lambda c: c.embed(["a"] * 2049), "texts"),
        (lambda c: c.rerank("q", []), "documents"),
    ],
)
def test_bad_calls_are_invalid_argument_naming_the_field(server, call, field):
    with Client(server.target, timeout=60) as client:
        with pytest.raises(InvalidArgument) as err:
            call(client)
        assert err.value.field == field, err.value
        wait_until(lambda: idle(client))


def test_rerank_without_yes_and_no_tokens_is_failed_precondition(tmp_path):
    """The embedded demo model's byte-level vocabulary has no single "yes" token."""
    srv = start_server(None, engine=ENGINE)
    try:
        with Client(srv.target, timeout=60) as client:
            with pytest.raises(FailedPrecondition) as err:
                client.rerank("q", ["d"])
            assert "yes" in str(err.value)
            assert len(client.embed(["hello"]).vectors[0]) == client.info().model.hidden_size
            wait_until(lambda: idle(client))
    finally:
        srv.stop()


def test_the_cli_prints_embeddings_and_rankings(server):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    def cli(*args: str) -> list[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "qil_client", "--target", server.target, *args], capture_output=True,
            text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    with Client(server.target, timeout=60) as client:
        want = client.embed(["one cat", "two dogs"], dimensions=8).vectors
        ranked = client.rerank("cats", ["a dog", "a cat", "a bird"])
    lines = cli("embed", "one cat", "two dogs", "--dimensions", "8")
    assert len(lines) == len(want)
    for line, vector in zip(lines, want):
        assert json.loads(line) == pytest.approx(vector, abs=1e-6)
    rows = [line.split("\t") for line in cli("rerank", "--query", "cats", "a dog", "a cat", "a bird")]
    assert [int(r[1]) for r in rows] == [r.index for r in ranked]
    assert [r[2] for r in rows] == [["a dog", "a cat", "a bird"][r.index] for r in ranked]
