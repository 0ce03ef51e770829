"""Embedding and rerank calls: the requests built from Python values, the answers as plain
records (``Client.embed``, ``Client.rerank`` and their asyncio twins)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client.results import naming


@dataclass(frozen=True)
class Embeddings:
    """One vector per input, in input order, the prompt tokens they took and how many of those
    the prefix cache served."""

    vectors: list[list[float]]
    num_prompt_tokens: int
    num_cached_tokens: int = 0

    @classmethod
    def from_proto(cls, resp: pb.EmbedResponse) -> "Embeddings":
        return cls(
            [list(e.values) for e in resp.embeddings], resp.num_prompt_tokens,
            sum(e.num_cached_tokens for e in resp.embeddings),
        )


@dataclass(frozen=True)
class Ranked:
    """A document's place in the request (``index``) and its relevance, P("yes") in [0, 1]."""

    index: int
    relevance_score: float


def embed_request(
    inputs: Sequence[str] | Sequence[Sequence[int]], dimensions: int | None = None, normalize: bool | None = None
) -> pb.EmbedRequest:
    """Texts (strings) or token-id lists, not mixed."""
    if isinstance(inputs, (str, bytes)):
        raise TypeError("inputs must be a list of texts or of token-id lists, not one string")
    req = pb.EmbedRequest()
    texts = [i for i in inputs if isinstance(i, str)]
    if texts and len(texts) != len(inputs):
        raise TypeError("inputs: give texts or token-id lists, not both")
    if texts:
        with naming("texts"):
            req.texts.extend(texts)
    else:
        for n, ids in enumerate(inputs):
            with naming(f"inputs[{n}]"):
                req.inputs.add().token_ids.extend(ids)
    if dimensions is not None:
        with naming("dimensions"):
            req.dimensions = dimensions
    if normalize is not None:
        with naming("normalize"):
            req.normalize = normalize
    return req


def rerank_request(
    query: str, documents: Sequence[str], instruction: str | None = None, top_n: int | None = None
) -> pb.RerankRequest:
    if isinstance(documents, (str, bytes)):
        raise TypeError("documents must be a list of strings, not one string")
    req = pb.RerankRequest()
    with naming("query"):
        req.query = query
    with naming("documents"):
        req.documents.extend(documents)
    if instruction is not None:
        with naming("instruction"):
            req.instruction = instruction
    if top_n is not None:
        with naming("top_n"):
            req.top_n = top_n
    return req


def ranked(resp: pb.RerankResponse) -> list[Ranked]:
    return [Ranked(r.index, r.relevance_score) for r in resp.results]
