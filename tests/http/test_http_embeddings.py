"""``/v1/embeddings`` with the official openai SDK (float and its default base64) and
``/v1/rerank`` over raw HTTP, on a real server: the same answers as gRPC's Embed and Rerank,
errors in the API's shape naming the field, every page free afterwards."""

from __future__ import annotations

import httpx
import openai
import pytest

from checkpoints import make_judge_checkpoint
from qil_client import Client
from service_fixtures import http_base_url, openai_client, start_http_server, wait_until

ENGINE = dict(num_pages=64, page_size=8, token_budget=128, prefill_chunk=32, max_active=8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_http_server(make_judge_checkpoint(tmp_path_factory.mktemp("http-judge")), engine=ENGINE,
                            served_model_name="judge")
    yield srv
    srv.stop()


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
