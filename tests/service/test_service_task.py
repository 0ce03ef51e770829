"""serve --task over a real server (its worker spawned): a headless embedding checkpoint is
detected and served as ``embed`` (transformers' Qwen3Model pooling), generation refused naming
the task; an explicit generate task refuses Embed and Rerank; GetInfo tells the task."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from checkpoints import load_reference, make_headless_checkpoint, make_judge_checkpoint
from qil_client import Client, InvalidArgument
from qil_worker.errors import ConfigError
from qil_worker.task import resolve
from qil_worker.text.rerank_prompt import rerank_prompt
from service_fixtures import http_base_url, start_http_server, start_server, wait_until

ENGINE = dict(num_pages=64, page_size=8, token_budget=128, prefill_chunk=32, max_active=8)


@pytest.fixture(scope="module")
def headless_dir(tmp_path_factory):
    return make_headless_checkpoint(tmp_path_factory.mktemp("headless") / "m")


def idle(client: Client) -> bool:
    info = client.info()
    return info.num_unfinished == 0 and info.pages.used == 0


def test_a_headless_checkpoint_serves_embeddings_and_refuses_generation(headless_dir):
    from transformers import Qwen3Model

    reference = Qwen3Model.from_pretrained(headless_dir).eval()
    srv = start_http_server(headless_dir, engine=ENGINE, use_tokenizer=False)
    try:
        with Client(srv.target, timeout=60) as client:
            assert client.info().model.task == "embed"
            prompts = [[5, 6, 7, 8], [9], list(range(1, 40))]
            for vector, ids in zip(client.embed(prompts).vectors, prompts):
                with torch.no_grad():
                    want = F.normalize(reference(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
                assert F.cosine_similarity(torch.tensor(vector), want, dim=0).item() >= 0.99999
            with pytest.raises(InvalidArgument, match="this server's task is embed"):
                client.submit([5, 6, 7], max_new_tokens=4)
            with pytest.raises(InvalidArgument, match="this server's task is embed"):
                client.generate([5, 6, 7], max_new_tokens=4)
            with pytest.raises(InvalidArgument, match="this server's task is embed"):
                client.rerank("q", ["a doc"])
            reply = httpx.post(f"{http_base_url(srv)}/completions", timeout=60,
                               json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 2})
            assert reply.status_code == 400 and "this server's task is embed" in reply.text
            wait_until(lambda: idle(client))
    finally:
        srv.stop()


def test_an_explicit_generate_task_refuses_embed_and_rerank(tmp_path):
    srv = start_server(make_judge_checkpoint(tmp_path / "judge"), engine=ENGINE, task="generate")
    try:
        with Client(srv.target, timeout=60) as client:
            assert client.info().model.task == "generate"
            with pytest.raises(InvalidArgument, match="this server's task is generate"):
                client.embed(["hello"])
            with pytest.raises(InvalidArgument, match="this server's task is generate"):
                client.rerank("q", ["a doc"])
            assert client.generate([5, 6, 7], max_new_tokens=2) is not None
            wait_until(lambda: idle(client))
    finally:
        srv.stop()


def test_an_explicit_rerank_task_serves_scores_and_refuses_the_rest(tmp_path):
    """``--task rerank`` on a causal LM: Rerank's scores are P(yes) from transformers' yes/no
    logits; generation and embeddings are refused over gRPC and HTTP, naming the task."""
    from transformers import AutoTokenizer

    judge = make_judge_checkpoint(tmp_path / "judge")
    ref, tok = load_reference(judge), AutoTokenizer.from_pretrained(judge)
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    query, docs = "where do cats sleep", ["on the mat", "the dog barks"]
    expected = []
    for d in docs:
        with torch.no_grad():
            logits = ref(torch.tensor([tok(rerank_prompt(query, d), add_special_tokens=False)["input_ids"]])).logits
        expected.append(torch.softmax(logits[0, -1, [no, yes]], dim=-1)[1].item())
    srv = start_http_server(judge, engine=ENGINE, task="rerank")
    try:
        with Client(srv.target, timeout=60) as client:
            assert client.info().model.task == "rerank"
            for r in client.rerank(query, docs):
                assert r.relevance_score == pytest.approx(expected[r.index], abs=1e-5)
            with pytest.raises(InvalidArgument, match="this server's task is rerank"):
                client.generate([5, 6, 7], max_new_tokens=2)
            with pytest.raises(InvalidArgument, match="this server's task is rerank"):
                client.embed(["hello"])
            base = http_base_url(srv)
            reply = httpx.post(f"{base}/rerank", timeout=60, json={"query": query, "documents": docs})
            assert reply.status_code == 200
            scores = {r["index"]: r["relevance_score"] for r in reply.json()["results"]}
            assert scores == {i: pytest.approx(e, abs=1e-5) for i, e in enumerate(expected)}
            for path, body in (("/embeddings", {"input": "hello"}),
                               ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                reply = httpx.post(f"{base}{path}", timeout=60, json=body)
                assert reply.status_code == 400 and "this server's task is rerank" in reply.text, path
            wait_until(lambda: idle(client))
    finally:
        srv.stop()


def test_task_resolution():
    assert resolve("auto", embedding_checkpoint=True, headless=True) == "embed"
    assert resolve("auto", embedding_checkpoint=False, headless=False) == "generate"
    assert resolve("rerank", embedding_checkpoint=False, headless=False) == "rerank"
    for task in ("generate", "rerank"):
        with pytest.raises(ConfigError, match=f"task {task}: the checkpoint has no LM head"):
            resolve(task, embedding_checkpoint=True, headless=True)
