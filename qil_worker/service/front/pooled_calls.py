"""Embedding and rerank calls in the front: a batch of pooled requests (``spec.Pooling``)
submitted together, awaited together, answered in input order (torch-free).

Each input is a request of its own in the worker's scheduler, so a batch shares steps with
generation traffic and with other calls. The call is all or nothing: an input the worker
refuses fails the call, naming the input (``texts[3]: ...``), and the inputs already queued
are cancelled; so are the unfinished ones when the caller goes away.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from qil_worker.engine.outputs import FinishReason
from qil_worker.engine.spec import Pooling, Prompt, RequestSpec
from qil_worker.errors import InvalidRequestError
from qil_worker.request_limits import MAX_POOLED_INPUTS, check_count
from qil_worker.service.errors import ServiceError, invalid, invalid_from
from qil_worker.service.protocol import FinalRecord
from qil_worker.text.rerank_prompt import rerank_prompt

if TYPE_CHECKING:
    from qil_worker.service.front.front import Front
    from qil_worker.service.front.request_log import FrontRequest

NO_DEADLINE_S = 1e9  # wait_ended's timeout for a call without a deadline


@dataclass(frozen=True)
class PooledInput:
    """One input of a call: its prompt and the request field it came in (for errors)."""

    field: str  # "texts[3]", "inputs[0]", "documents[2]"...
    prompt: Prompt


def check_inputs(field: str, count: int) -> None:
    """At least one input, at most ``MAX_POOLED_INPUTS``: checked from the count alone, before
    anything is built from the inputs."""
    if not count:
        raise invalid(field, "give at least one input")
    try:
        check_count(field, count, MAX_POOLED_INPUTS, "inputs")
    except InvalidRequestError as exc:
        raise invalid_from(exc) from None


def pooled_specs(inputs: list[PooledInput], pooling: Pooling) -> list[RequestSpec]:
    """The inputs' specs (their count checked already: ``check_inputs``)."""
    return [RequestSpec(prompt=i.prompt, max_new_tokens=1, pooling=pooling) for i in inputs]


async def run_pooled(
    front: "Front", inputs: list[PooledInput], specs: list[RequestSpec], timeout_s: float | None
) -> list[FinalRecord]:
    """Submit every spec at once, wait until all ended; → their final records, in order.
    ``ServiceError`` for a refused or failed input (its field named) or a passed deadline."""
    submits = [asyncio.ensure_future(front.submit("", spec)) for spec in specs]
    reqs: list["FrontRequest"] = []
    try:
        done = await asyncio.gather(*submits, return_exceptions=True)
        reqs = [r for r in done if not isinstance(r, BaseException)]
        for item, outcome in zip(inputs, done):
            if isinstance(outcome, ServiceError):
                raise _blamed(outcome, item.field)
            if isinstance(outcome, BaseException):
                raise outcome
        await front.requests.wait_ended(reqs, NO_DEADLINE_S if timeout_s is None else timeout_s)
        if any(r.final is None for r in reqs):
            raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
        for item, req in zip(inputs, reqs):
            final = req.final
            if final.reason is not FinishReason.STOP or final.pooled is None:
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE if req.lost else grpc.StatusCode.INTERNAL,
                    f"{item.field}: {final.error or final.reason.label}",
                )
        return [r.final for r in reqs]
    finally:
        for submit in submits:
            submit.cancel()  # (a no-op for those done)
        for req in reqs:
            if req.final is None:
                front.cancel_nowait(req.rid)


async def rerank(
    front: "Front", query: str, documents: list[str], instruction: str | None, top_n: int | None,
    timeout_s: float | None,
) -> tuple[list[tuple[int, float]], int]:
    """Each document judged against ``query`` in Qwen3-Reranker's prompt → ((index, P(yes)) best
    first, the best ``top_n`` when given and not 0; the prompt tokens of them all)."""
    scores, tokens = await score_pairs(front, [(query, doc) for doc in documents], instruction, timeout_s)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return [(i, scores[i]) for i in order[: top_n or None]], tokens


async def score_pairs(
    front: "Front", pairs: list[tuple[str, str]], instruction: str | None, timeout_s: float | None,
    field: str = "documents",
) -> tuple[list[float], int]:
    """Each (query, document) pair's P(yes) in Qwen3-Reranker's prompt, in the pairs' order,
    and the prompt tokens of them all; a refused pair is blamed on ``field[i]``."""
    check_inputs(field, len(pairs))
    inputs = [
        PooledInput(f"{field}[{i}]", Prompt(text=rerank_prompt(query, doc, instruction)))
        for i, (query, doc) in enumerate(pairs)
    ]
    finals = await run_pooled(front, inputs, pooled_specs(inputs, Pooling("score")), timeout_s)
    return [f.pooled for f in finals], sum(f.num_prompt_tokens for f in finals)


def _blamed(err: ServiceError, item_field: str) -> ServiceError:
    """The input's field in front of the error's own (``texts[2].text: ...``)."""
    inner = "" if err.field in (None, "token_ids", "text") else f".{err.field}"
    return ServiceError(err.code, err.message, f"{item_field}{inner}")
