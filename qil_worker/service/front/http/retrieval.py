"""``POST /v1/embeddings`` as the OpenAI API defines it, ``POST /v1/rerank`` in the shape
vLLM, Jina and Cohere use, and vLLM's ``POST /v1/score``: all over the front's pooled calls (``front.pooled_calls``), as the
gRPC Embed and Rerank are."""

from __future__ import annotations

import base64
import struct
from typing import TYPE_CHECKING, Any

from aiohttp import web

from qil_worker.engine.spec import Pooling, Prompt
from qil_worker.errors import InvalidRequestError
from qil_worker.service.errors import invalid, invalid_from
from qil_worker.service.front.http.body import read_body
from qil_worker.service.front.http.params import completion_prompts
from qil_worker.service.front.http.shapes import new_id
from qil_worker.service.front.http.sse import dumps
from qil_worker.service.front.http.tokens import check_model
from qil_worker.service.front.pooled_calls import PooledInput, check_inputs, pooled_specs, run_pooled, score_pairs
from qil_worker.service.front.pooled_calls import rerank as rerank_documents

if TYPE_CHECKING:
    from qil_worker.service.front.http.context import HttpContext

ENCODINGS = ("float", "base64")


async def embeddings(ctx: "HttpContext", request: web.Request) -> web.Response:
    """``input``: a string, strings, token ids or lists of them; ``dimensions``;
    ``encoding_format`` float (default) or base64 (little-endian float32, as OpenAI's SDK
    decodes it); ``user`` accepted and unused."""
    body = await read_body(request)
    check_model(ctx, body)
    encoding = body.get("encoding_format", "float")
    if encoding not in ENCODINGS:
        raise invalid("encoding_format", f"expected one of {list(ENCODINGS)}, got {encoding!r}")
    dimensions = body.get("dimensions")
    try:
        pooling = Pooling("embed", dimensions=dimensions)
    except InvalidRequestError as exc:
        raise invalid_from(exc) from None
    value = body.get("input")
    if isinstance(value, list) and value and not isinstance(value[0], int):  # several inputs
        check_inputs("input", len(value))
    prompts = completion_prompts(body, "input")
    inputs = [PooledInput(f"input[{i}]", Prompt(token_ids=p.token_ids, text=p.text)) for i, p in enumerate(prompts)]
    finals = await run_pooled(ctx.front, inputs, pooled_specs(inputs, pooling), None)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(f.pooled, encoding)}
        for i, f in enumerate(finals)
    ]
    tokens = sum(f.num_prompt_tokens for f in finals)
    return web.json_response({
        "object": "list", "data": data, "model": ctx.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }, dumps=dumps)


async def rerank(ctx: "HttpContext", request: web.Request) -> web.Response:
    """``query``, ``documents`` (strings, or objects with a ``text``), ``top_n``,
    ``return_documents`` (default true), ``instruction`` (Qwen3-Reranker's task; optional) →
    ``results`` best first, each with its ``index`` and ``relevance_score``."""
    body = await read_body(request)
    check_model(ctx, body)
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str):
        raise invalid("query", "must be a string")
    if not isinstance(documents, list):
        raise invalid("documents", "must be an array of strings")
    check_inputs("documents", len(documents))
    texts = [_document_text(d, i) for i, d in enumerate(documents)]
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise invalid("top_n", f"must be a non-negative integer, got {top_n!r}")
    instruction = body.get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise invalid("instruction", "must be a string")
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise invalid("return_documents", "must be a boolean")
    ranked, tokens = await rerank_documents(ctx.front, query, texts, instruction, top_n, None)
    results: list[dict[str, Any]] = []
    for i, score in ranked:
        entry: dict[str, Any] = {"index": i, "relevance_score": score}
        if return_documents:
            entry["document"] = {"text": texts[i]}
        results.append(entry)
    return web.json_response({
        "id": new_id("rerank"), "model": ctx.model_name, "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }, dumps=dumps)


async def score(ctx: "HttpContext", request: web.Request) -> web.Response:
    """vLLM's ``/v1/score``: ``text_1`` and ``text_2`` each a string or strings, paired one to
    many (one ``text_1``) or one to one (lists of a length), ``instruction`` optional → each
    pair's P(yes) (the Rerank judge's) in ``text_2``'s order."""
    body = await read_body(request)
    check_model(ctx, body)
    firsts, seconds = _texts(body, "text_1"), _texts(body, "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise invalid("text_2", f"has {len(seconds)} texts; text_1 has {len(firsts)} (expected 1 or as many)")
    instruction = body.get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise invalid("instruction", "must be a string")
    scores, tokens = await score_pairs(ctx.front, list(zip(firsts, seconds)), instruction, None, field="text_2")
    return web.json_response({
        "id": new_id("score"), "object": "list", "model": ctx.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }, dumps=dumps)


def _texts(body: dict, field: str) -> list[str]:
    value = body.get(field)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    raise invalid(field, "must be a string or a non-empty array of strings")


def _document_text(document: Any, index: int) -> str:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return document["text"]
    raise invalid(f"documents[{index}]", "must be a string or an object with a string 'text'")


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
