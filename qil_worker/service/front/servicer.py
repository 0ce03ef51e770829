"""The ``qil.v1.Inference`` servicer: each RPC validated, handed to the front, and answered."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import grpc

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from qil_worker.service.front import limits
from qil_worker.engine.spec import Pooling, Prompt
from qil_worker.errors import InvalidRequestError
from qil_worker.request_limits import MAX_REQUEST_ID_LENGTH
from qil_worker.service.front.decoding import Undecodable
from qil_worker.service.errors import ServiceError, invalid, invalid_from, resource_exhausted, unavailable
from qil_worker.service.front.front import Front
from qil_worker.service.protocol import WorkerInfo
from qil_worker.service.front.request_log import FrontRequest
from qil_worker.service.front.outsized_submit import OutsizedSubmit, stream_events_request, submit_request
from qil_worker.service.front.submit_spec import refuse_unfit, submit_to
from qil_worker.service.front.submit_tools import chat_messages, template_tools
from qil_worker.service.front.pooled_calls import PooledInput, check_inputs, pooled_specs, rerank, run_pooled
from qil_worker.service.front.session import StreamSession
from qil_worker.service.front.streams import (
    Subscription,
    WriteClock,
    backlog_bound,
    backlog_error,
    stream_fell_behind,
)

log = logging.getLogger("qil.server")

SERVER_VERSION = "0.1.0"


async def _reject_undecodable(request: object, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await invalid("request", request.describe()).abort(context)


class InferenceServicer(pb_grpc.InferenceServicer):
    # deserializers of outsized messages (``decoding.add_servicer``): a submit of megabytes
    # that cannot fit is refused before its prompt is decoded
    outsized_requests = {
        pb.SubmitRequest.DESCRIPTOR.full_name: submit_request,
        pb.StreamEventsRequest.DESCRIPTOR.full_name: stream_events_request,
    }

    def __init__(self, front: Front) -> None:
        self.front = front

    async def _submit(self, request: pb.SubmitRequest | OutsizedSubmit | Undecodable, context) -> FrontRequest:
        """Submit or Generate's request queued (or the call aborted with the reason)."""
        await _reject_undecodable(request, context)
        try:
            if isinstance(request, OutsizedSubmit):
                refuse_unfit(self.front, request)
                request = request.whole()
                await _reject_undecodable(request, context)
            return await submit_to(self.front, request)
        except ServiceError as err:
            await err.abort(context)
            raise  # (abort raises)

    async def Submit(self, request: pb.SubmitRequest, context) -> pb.SubmitResponse:
        req = await self._submit(request, context)
        return pb.SubmitResponse(request_id=req.rid, num_prompt_tokens=req.prompt_len)

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        await _reject_undecodable(request, context)
        results = await self.front.cancel(request.request_ids)
        return pb.CancelResponse(
            results=[pb.CancelResult(request_id=r, was_active=a) for r, a in results]
        )

    async def Generate(self, request: pb.SubmitRequest, context) -> AsyncIterator[pb.Event]:
        req = await self._submit(request, context)
        bound = backlog_bound(self.front)
        news = asyncio.Event()
        writes = WriteClock()
        sub = Subscription(
            req, 0, bound, writes,
            on_news=lambda _: news.set(),
            on_behind=lambda s: stream_fell_behind(self.front, [s.req.rid], bound),
        )
        try:
            while True:
                if sub.lost:
                    await unavailable("worker process died").abort(context)
                if sub.exhausted:
                    await backlog_error(bound).abort(context)
                ev = sub.next_event()
                if ev is not None:
                    writes.started()
                    yield ev  # blocks while the client does not read (HTTP/2 flow control)
                    writes.done()
                    sub.written()
                if sub.done:
                    return
                if not sub.has_more:
                    await news.wait()
                    news.clear()
        finally:
            sub.close()
            if not sub.done:
                # client cancel, disconnect or deadline: the request must not run on
                if self.front.cancel_nowait(req.rid):
                    log.info("Generate call ended early: cancelling", extra={"request_id": req.rid})

    async def StreamEvents(self, request_iterator, context) -> AsyncIterator[pb.StreamEventsResponse]:
        session = StreamSession(self.front)
        reader = asyncio.ensure_future(session.read_frames(request_iterator))
        try:
            async for resp in session.responses(context):
                yield resp
        finally:
            reader.cancel()
            session.close()

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        await _reject_undecodable(request, context)
        try:
            ids = await self.front.tokenize(*_tokenize_args(request))
        except ServiceError as err:
            await err.abort(context)
        info = self.front.info
        resp = pb.TokenizeResponse(
            token_ids=ids, num_tokens=len(ids),
            max_position_embeddings=info.max_position_embeddings if info is not None else 0,
        )
        return await _within_message_limit(resp, context)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        await _reject_undecodable(request, context)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        try:
            text = await self.front.detokenize(list(request.token_ids), skip)
        except ServiceError as err:
            await err.abort(context)
        return await _within_message_limit(pb.DetokenizeResponse(text=text), context)

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        await _reject_undecodable(request, context)
        try:
            inputs = _embed_inputs(request)
            pooling = _pooling(lambda: Pooling(
                "embed", dimensions=request.dimensions if request.HasField("dimensions") else None,
                normalize=request.normalize if request.HasField("normalize") else True,
            ))
            finals = await run_pooled(self.front, inputs, pooled_specs(inputs, pooling), context.time_remaining())
        except ServiceError as err:
            await err.abort(context)
        resp = pb.EmbedResponse(
            embeddings=[pb.Embedding(values=f.pooled, num_prompt_tokens=f.num_prompt_tokens,
                                     num_cached_tokens=f.num_cached_tokens) for f in finals],
            num_prompt_tokens=sum(f.num_prompt_tokens for f in finals),
        )
        return await _within_message_limit(resp, context)

    async def Rerank(self, request: pb.RerankRequest, context) -> pb.RerankResponse:
        await _reject_undecodable(request, context)
        instruction = request.instruction if request.HasField("instruction") else None
        try:
            ranked, tokens = await rerank(
                self.front, request.query, list(request.documents), instruction, request.top_n,
                context.time_remaining(),
            )
        except ServiceError as err:
            await err.abort(context)
        return pb.RerankResponse(
            results=[pb.RerankResult(index=i, relevance_score=score) for i, score in ranked],
            num_prompt_tokens=tokens,
        )

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        await _reject_undecodable(request, context)
        front = self.front
        stats = front.stats  # of the worker's latest batch: every change of them sends one
        info = front.info
        model, engine_limits = _configured(front) if info is None else _described(info)
        engine_limits.max_queued = front.config.max_queued
        engine_limits.max_request_id_length = MAX_REQUEST_ID_LENGTH
        return pb.GetInfoResponse(
            model=model,
            limits=engine_limits,
            pages=pb.PagePool(
                total=stats.pages_total, used=stats.pages_used, free=stats.pages_free,
                cached=stats.pages_cached, page_bytes=info.page_bytes if info is not None else 0,
            ),
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            worker=pb.WorkerInfo(state=int(front.state), restarts=front.restarts, pid=front.worker_pid),
            server_version=SERVER_VERSION,
            num_unfinished=front.num_unfinished,
            num_requests_total=front.num_requests_total,
            prefix_cache=pb.PrefixCacheInfo(
                enabled=info is not None and info.prefix_cache, hit_rate=stats.prefix_cache_hit_rate
            ),
        )


async def _within_message_limit(resp, context: grpc.aio.ServicerContext):
    """``resp``, or RESOURCE_EXHAUSTED with a reason when it exceeds the message limit (a
    request under the limit can expand past it: one id per byte of an odd text, say)."""
    size = resp.ByteSize()
    if size > limits.MAX_MESSAGE_BYTES:
        await resource_exhausted(
            f"the answer would be {size} bytes, over the {limits.MAX_MESSAGE_BYTES}-byte message "
            "limit: send less at once"
        ).abort(context)
    return resp


def _tokenize_args(request: pb.TokenizeRequest) -> tuple[str | None, list[dict[str, Any]] | None, bool | None,
                                                         list[dict[str, Any]] | None]:
    """(text, messages, enable_thinking, tools) of ``front.tokenize``, the messages and tools
    as a submit's (``submit_tools``); proto3's empty text is none."""
    if request.text and request.messages:
        raise invalid("messages", "give text or messages, not both")
    if request.HasField("tools") and not request.messages:
        raise invalid("tools", "need a chat prompt (messages)")
    try:
        messages = chat_messages(request.messages) or None
        tools = template_tools(request)
    except InvalidRequestError as exc:
        raise invalid_from(exc) from None
    thinking = request.enable_thinking if request.HasField("enable_thinking") else None
    return request.text or None, messages, thinking, tools


def _embed_inputs(request: pb.EmbedRequest) -> list[PooledInput]:
    """The call's inputs: exactly one of texts or inputs, their count checked first."""
    if request.texts and request.inputs:
        raise invalid("inputs", "give texts or inputs, not both")
    field = "texts" if request.texts else "inputs"
    check_inputs(field, len(request.texts) or len(request.inputs))
    if request.texts:
        return [PooledInput(f"texts[{i}]", Prompt(text=t)) for i, t in enumerate(request.texts)]
    inputs = []
    for i, item in enumerate(request.inputs):
        if not item.token_ids:
            raise invalid(f"inputs[{i}]", "the input is empty")
        inputs.append(PooledInput(f"inputs[{i}]", Prompt(token_ids=list(item.token_ids))))
    return inputs


def _pooling(make) -> Pooling:
    """``make()``, its ``InvalidRequestError`` as INVALID_ARGUMENT naming the field."""
    try:
        return make()
    except InvalidRequestError as exc:
        raise invalid_from(exc) from None


def _described(info: WorkerInfo) -> tuple[pb.ModelInfo, pb.EngineLimits]:
    """The model and the engine's limits as the worker reported them."""
    model = pb.ModelInfo(
        name=info.name,
        demo=info.demo,
        vocab_size=info.vocab_size,
        max_position_embeddings=info.max_position_embeddings,
        eos_token_ids=info.eos_token_ids,
        dtype=info.dtype,
        device=info.device,
        num_hidden_layers=info.num_hidden_layers,
        hidden_size=info.hidden_size,
        has_tokenizer=info.has_tokenizer,
        has_chat_template=info.has_chat_template,
        structured_output=info.structured_output,
        weight_format=info.weight_format,
        weight_bytes=info.weight_bytes,
        architecture=info.architecture,
        num_experts=info.num_experts,
        num_experts_per_tok=info.num_experts_per_tok,
        num_parameters=info.num_parameters,
        num_active_parameters=info.num_active_parameters,
        task=info.task,
        tensor_parallel_size=info.tensor_parallel_size,
        nnodes=info.nnodes,
        rank_weight_bytes=info.rank_weight_bytes,
    )
    engine_limits = pb.EngineLimits(
        page_size=info.page_size,
        token_budget=info.token_budget,
        prefill_chunk=info.prefill_chunk,
        max_active=info.max_active,
        schedule_policy=info.schedule_policy,
        attention_backend=info.attention,
        cuda_graphs=info.cuda_graphs,
    )
    return model, engine_limits


def _configured(front: Front) -> tuple[pb.ModelInfo, pb.EngineLimits]:
    """Before any worker was ready (the model still loads): what the configuration says."""
    cfg = front.config.worker
    eng = cfg.engine
    model = pb.ModelInfo(name=cfg.model or "demo", demo=not cfg.model, device=cfg.device)
    engine_limits = pb.EngineLimits(
        page_size=eng.page_size, token_budget=eng.token_budget, prefill_chunk=eng.prefill_chunk,
        max_active=eng.max_active, schedule_policy=eng.schedule_policy,
    )
    return model, engine_limits
