"""``/v1/embeddings`` with the official openai SDK (float and its default base64) and
``/v1/rerank`` and ``/v1/score`` over raw HTTP, on a real server: the same answers as gRPC's Embed and Rerank,
errors in the API's shape naming the field, every page free afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from checkpoints import load_reference, make_judge_checkpoint
from qil_client import Client
from qil_worker.text.rerank_prompt import rerank_prompt
from service_fixtures import http_base_url, openai_client, start_http_server, wait_until

ENGINE = dict(num_pages=64, page_size=8, token_budget=128, prefill_chunk=32, max_active=8)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return make_judge_checkpoint(tmp_path_factory.mktemp("http-judge"))


@pytest.fixture(scope="module")
def server(judge_dir):
    srv = start_http_server(judge_dir, engine=ENGINE, served_model_name="judge")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(judge_dir):
    from transformers import AutoTokenizer

    return load_reference(judge_dir), AutoTokenizer.from_pretrained(judge_dir)


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server.target, timeout=60) as c:
        yield c


def idle(client: Client) -> bool:
    info = client.info()
    return info.num_unfinished == 0 and info.pages.used == 0


def test_the_sdk_gets_grpcs_embeddings_in_both_encodings(server, grpc_client):
    texts = ["the cat sat on the mat", "dogs bark"]
    want = grpc_client.embed(texts)
    with openai_client(server, timeout=60) as oai:
        decoded = oai.embeddings.create(model="judge", input=texts)  # the SDK asks for base64
        floats = oai.embeddings.create(model="judge", input=texts, encoding_format="float")
        short = oai.embeddings.create(model="judge", input=[[5, 6, 7]], dimensions=8, encoding_format="float")
    for resp in (decoded, floats):
        assert [d.index for d in resp.data] == [0, 1]
        for d, vector in zip(resp.data, want.vectors):
            assert d.embedding == pytest.approx(vector, abs=1e-6)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == want.num_prompt_tokens
        assert resp.model == "judge"
    assert short.data[0].embedding == pytest.approx(grpc_client.embed([[5, 6, 7]], dimensions=8).vectors[0], abs=1e-6)
    wait_until(lambda: idle(grpc_client))


def test_rerank_answers_as_grpc_does_in_vllms_shape(server, grpc_client):
    query, docs = "where do cats sleep", ["on the mat", {"text": "in the box"}, "the dog barks"]
    want = grpc_client.rerank(query, ["on the mat", "in the box", "the dog barks"])
    for path in ("/v1/rerank", "/rerank"):
        resp = httpx.post(f"http://127.0.0.1:{server.http_port}{path}", json={
            "model": "judge", "query": query, "documents": docs, "top_n": 2,
        }, timeout=60)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert [r["index"] for r in body["results"]] == [r.index for r in want[:2]]
        for r, w in zip(body["results"], want):
            assert r["relevance_score"] == pytest.approx(w.relevance_score, abs=1e-6)
            assert r["document"]["text"] == ["on the mat", "in the box", "the dog barks"][r["index"]]
        assert body["usage"]["total_tokens"] > 0
    bare = httpx.post(f"http://127.0.0.1:{server.http_port}/v1/rerank", json={
        "query": query, "documents": ["a", "b"], "return_documents": False}, timeout=60).json()
    assert len(bare["results"]) == 2 and "document" not in bare["results"][0]
    wait_until(lambda: idle(grpc_client))


def _judge(reference, pairs):
    """P(yes) of each (query, document) by the softmax over transformers' no/yes logits."""
    ref, tok = reference
    yes, no = tok.convert_tokens_to_ids(["yes", "no"])
    scores = []
    for query, doc in pairs:
        ids = tok(rerank_prompt(query, doc), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0, -1]
        scores.append(torch.softmax(logits[[no, yes]], dim=-1)[1].item())
    return scores


def test_score_is_the_judges_p_yes_one_to_many_and_pairwise(server, grpc_client, reference):
    url = f"http://127.0.0.1:{server.http_port}/v1/score"
    docs = ["on the mat", "in the box", "the dog barks"]
    body = httpx.post(url, json={"model": "judge", "text_1": "where do cats sleep", "text_2": docs},
                      timeout=60).json()
    assert body["object"] == "list" and body["usage"]["total_tokens"] > 0
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"score"}
    for got, want in zip(body["data"], _judge(reference, [("where do cats sleep", d) for d in docs])):
        assert got["score"] == pytest.approx(want, abs=1e-5)
    pairs = [("where do cats sleep", "on the mat"), ("what barks", "the dog barks")]
    pairwise = httpx.post(url, json={"text_1": [q for q, _ in pairs], "text_2": [d for _, d in pairs]},
                          timeout=60).json()["data"]
    for got, want in zip(pairwise, _judge(reference, pairs)):
        assert got["score"] == pytest.approx(want, abs=1e-5)
    single = httpx.post(url, json={"text_1": "what barks", "text_2": "the dog barks"}, timeout=60).json()["data"]
    assert len(single) == 1 and single[0]["score"] == pytest.approx(pairwise[1]["score"], abs=1e-6)
    wait_until(lambda: idle(grpc_client))


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/embeddings", {"input": []}, "input"),
        ("/v1/embeddings", {"input": "a", "dimensions": 65}, "input[0].dimensions"),
        ("/v1/embeddings", {"input": "a", "dimensions": -1}, "dimensions"),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"input": [[1, 2], [1, 10**6]]}, "input[1]"),
        ("/v1/embeddings", {"input": ["a"] * 2049}, "input"),
        ("/v1/embeddings", {"input": "a", "model": "other"}, "model"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": 3, "documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": [{"title": "a"}]}, "documents[0]"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -2}, "top_n"),
        ("/v1/score", {"text_2": "a"}, "text_1"),
        ("/v1/score", {"text_1": "q", "text_2": []}, "text_2"),
        ("/v1/score", {"text_1": "q", "text_2": ["a", 3]}, "text_2"),
        ("/v1/score", {"text_1": ["q", "r"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/v1/score", {"text_1": "q", "text_2": "a", "instruction": 1}, "instruction"),
    ],
)
def test_bad_calls_are_errors_naming_the_field(server, grpc_client, path, body, field):
    resp = httpx.post(f"http://127.0.0.1:{server.http_port}{path}", json=body, timeout=60)
    assert resp.status_code in (400, 404), resp.text
    error = resp.json()["error"]
    assert error["param"] == field, error
    wait_until(lambda: idle(grpc_client))


def test_the_sdk_sees_a_bad_request_as_its_own_error(server):
    with openai_client(server, timeout=60) as oai:
        with pytest.raises(openai.BadRequestError) as err:
            oai.embeddings.create(model="judge", input="a", dimensions=1000)
    assert "dimensions" in str(err.value)
