"""One completions or chat call from body to answer, whichever the endpoint: parse, check the
model, submit its requests, then either wait for them and answer once, or stream their chunks
as server-sent events. The endpoint (``completions.Completions``, ``chat.Chat``) says how a
choice looks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from qil_worker.service.errors import ServiceError, http_status, openai_error, unknown_model
from qil_worker.service.front.request_log import FrontRequest, SampleEnd
from qil_worker.service.front.http.body import read_body
from qil_worker.service.front.http.choices import Choices, request_failure, submit_all
from qil_worker.service.front.http.params import CallParams
from qil_worker.service.front.http.shapes import by_sample, created, ids_for_strings, new_id, sample_end, usage
from qil_worker.service.front.http.sse import ChunkFrame, EventStream, dumps

if TYPE_CHECKING:
    from qil_worker.service.front.http.context import HttpContext


class Endpoint(Protocol):
    """What differs between /v1/completions and /v1/chat/completions."""

    chat: bool
    id_prefix: str
    object_name: str
    chunk_object: str

    def parse(self, body: dict) -> CallParams: ...

    async def prepare(self, ctx: "HttpContext", params: CallParams) -> Any:
        """Work before the submit (the call's own state, passed back below)."""

    def opening_chunks(self, state: Any, count: int) -> list[dict]: ...

    def chunk_choice(self, state: Any, index: int, req: FrontRequest, positions: list[int],
                     end: SampleEnd | None, strings: dict[int, str] | None) -> dict | None:
        """The choice part of a chunk: the tokens at log ``positions`` of one sample, and its
        ``end`` when it ended; None when they say nothing (no text, logprobs or end): no chunk."""

    def full_choice(self, state: Any, index: int, req: FrontRequest, positions: list[int],
                    end: SampleEnd | None, strings: dict[int, str] | None) -> dict: ...

    def reasoning_tokens(self, reqs: list[FrontRequest]) -> int | None:
        """Of the output tokens, those that were reasoning (None: the endpoint has none)."""


def with_api_param(err: ServiceError, params: CallParams, chat: bool) -> ServiceError:
    """The engine's field names (max_new_tokens...) → the API's (max_tokens...)."""
    err.field = params.api_param(err.field, chat)
    return err


async def handle(ctx: "HttpContext", request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    body = await read_body(request)
    params = endpoint.parse(body)
    if params.model is not None and params.model != ctx.model_name:
        raise unknown_model(params.model, ctx.model_name)
    front = ctx.front
    call_id = new_id(endpoint.id_prefix)
    try:
        state = await endpoint.prepare(ctx, params)
        reqs = await submit_all(front, params, call_id)
    except ServiceError as err:
        raise with_api_param(err, params, endpoint.chat) from None
    choices = Choices(front, reqs)
    head = {"id": call_id, "object": endpoint.object_name, "created": created(), "model": ctx.model_name}
    n = params.n
    try:
        if params.stream:
            return await _stream(ctx, request, endpoint, params, state, choices, head)
        await choices.wait()
        for req in reqs:
            failure = request_failure(req)
            if failure is not None:
                raise failure
        strings = await _strings(ctx, params, [(r, 0, len(r.tokens)) for r in reqs])
        answers = []
        for p, req in enumerate(reqs):
            positions = by_sample(req, 0, len(req.tokens))
            answers.extend(
                endpoint.full_choice(state, p * n + j, req, positions.get(j, []), sample_end(req, j), strings)
                for j in range(n)
            )
        return web.json_response({**head, "choices": answers, "usage": _usage(endpoint, reqs, params)},
                                 dumps=dumps)
    finally:
        choices.close()


async def _strings(ctx: "HttpContext", params: CallParams,
                   spans: list[tuple[FrontRequest, int, int]]) -> dict[int, str] | None:
    """The strings of the tokens that logprobs of ``spans`` name (None: no logprobs asked)."""
    if params.top_logprobs is None:
        return None
    wanted: set[int] = set()
    for req, start, end in spans:
        wanted |= ids_for_strings(req, start, end)
    return await ctx.token_strings.of(wanted)


async def _stream(ctx: "HttpContext", request: web.Request, endpoint: Endpoint, params: CallParams,
                  state: Any, choices: Choices, head: dict) -> web.StreamResponse:
    events = EventStream(request, choices.writes)
    await events.open()
    chunk_head = {**head, "object": endpoint.chunk_object}
    # every chunk of one choice: the call's fields around it, encoded once
    frame = ChunkFrame(chunk_head, params.include_usage)
    n = params.n
    for chunk in endpoint.opening_chunks(state, len(choices.reqs) * n):
        await events.send_raw(frame.encode(chunk))
    logprobs = params.top_logprobs is not None
    try:
        async for r, start, end, ends in choices.updates():
            req = choices.reqs[r]
            failure = request_failure(req, ends)
            if failure is not None:
                raise failure
            strings = await _strings(ctx, params, [(req, start, end)]) if logprobs else None
            positions = by_sample(req, start, end)
            ended = {e.sample: e for e in ends}
            for j in sorted(positions.keys() | ended.keys()):
                choice = endpoint.chunk_choice(state, r * n + j, req, positions.get(j, []), ended.get(j), strings)
                if choice is not None:
                    await events.send_raw(frame.encode(choice))
    except ServiceError as err:
        # the status line went out with the first chunk: the error is an event of the stream
        await events.send(openai_error(err))
        await events.close()
        return events.response
    if params.include_usage:
        await events.send({**chunk_head, "choices": [], "usage": _usage(endpoint, choices.reqs, params)})
    await events.close()
    return events.response


def _usage(endpoint: Endpoint, reqs: list[FrontRequest], params: CallParams) -> dict[str, Any]:
    out = usage(reqs, not params.hide_output)
    reasoning = endpoint.reasoning_tokens(reqs)
    if reasoning is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return out


def error_response(err: ServiceError) -> web.Response:
    status = http_status(err)
    # RFC 6750: a 401 names the scheme that would authenticate
    headers = {"WWW-Authenticate": 'Bearer realm="qil"'} if status == 401 else None
    return web.json_response(openai_error(err), status=status, headers=headers, dumps=dumps)

