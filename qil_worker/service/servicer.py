"""The ``qil.v1.Inference`` servicer: each RPC validated, handed to the front, and answered."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc

from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from qil_worker.service import limits
from qil_worker.service.decoding import Undecodable
from qil_worker.service.errors import ServiceError, invalid, unavailable
from qil_worker.service.front import Front
from qil_worker.service.front_request import Follower
from qil_worker.service.requests import submit_to
from qil_worker.service.session import StreamSession
from qil_worker.service.streams import backlog_bound, backlog_error, build_event, stream_fell_behind

log = logging.getLogger("qil.server")

SERVER_VERSION = "0.1.0"


async def _reject_undecodable(request: object, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await invalid("request", request.describe()).abort(context)


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, front: Front) -> None:
        self.front = front

    async def Submit(self, request: pb.SubmitRequest, context) -> pb.SubmitResponse:
        await _reject_undecodable(request, context)
        try:
            req = await submit_to(self.front, request)
        except ServiceError as err:
            await err.abort(context)
        return pb.SubmitResponse(request_id=req.rid, num_prompt_tokens=req.prompt_len)

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        await _reject_undecodable(request, context)
        results = await self.front.cancel(request.request_ids)
        return pb.CancelResponse(
            results=[pb.CancelResult(request_id=r, was_active=a) for r, a in results]
        )

    async def Generate(self, request: pb.SubmitRequest, context) -> AsyncIterator[pb.Event]:
        await _reject_undecodable(request, context)
        try:
            req = await submit_to(self.front, request)
        except ServiceError as err:
            await err.abort(context)
        bound = backlog_bound(self.front)
        follower = Follower(
            bound, None if bound is None else (lambda r: stream_fell_behind(self.front, [r.rid], bound))
        )
        req.listeners.add(follower)
        cursor, done = 0, False
        try:
            while True:
                if follower.lost:
                    await unavailable("worker process died").abort(context)
                if follower.exhausted:
                    await backlog_error(bound).abort(context)
                ev, cursor, done = build_event(req, cursor)
                if ev is not None:
                    follower.writing_since = time.monotonic()
                    yield ev  # blocks while the client does not read (HTTP/2 flow control)
                    follower.writing_since = None
                    follower.written = cursor
                if done:
                    return
                await follower.wait()
        finally:
            req.listeners.discard(follower)
            if not done:
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

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        await _reject_undecodable(request, context)
        front = self.front
        total, used, free, running, waiting, cached, hit_rate = await front.fresh_stats()
        info = front.info
        eng = front.config.engine
        return pb.GetInfoResponse(
            model=pb.ModelInfo(
                name=str(info.get("name", front.config.model or "demo")),
                demo=bool(info.get("demo", not front.config.model)),
                vocab_size=info.get("vocab_size", 0),
                max_position_embeddings=info.get("max_position_embeddings", 0),
                eos_token_ids=info.get("eos_token_ids", []),
                dtype=info.get("dtype", ""),
                device=info.get("device", front.config.device),
                num_hidden_layers=info.get("num_hidden_layers", 0),
                hidden_size=info.get("hidden_size", 0),
                has_tokenizer=bool(info.get("has_tokenizer")),
                has_chat_template=bool(info.get("has_chat_template")),
            ),
            limits=pb.EngineLimits(
                page_size=info.get("page_size", eng.get("page_size", 0)),
                token_budget=info.get("token_budget", eng.get("token_budget", 0)),
                prefill_chunk=info.get("prefill_chunk", eng.get("prefill_chunk", 0)),
                max_active=info.get("max_active", eng.get("max_active", 0)),
                max_queued=front.config.max_queued,
                max_request_id_length=limits.MAX_REQUEST_ID_LENGTH,
                schedule_policy=info.get("schedule_policy", eng.get("schedule_policy", "")),
                attention_backend=info.get("attention", ""),
                cuda_graphs=bool(info.get("cuda_graphs")),
            ),
            pages=pb.PagePool(
                total=total, used=used, free=free, cached=cached, page_bytes=info.get("page_bytes", 0)
            ),
            num_running=running,
            num_waiting=waiting,
            worker=pb.WorkerInfo(state=int(front.state), restarts=front.restarts, pid=front.worker_pid),
            server_version=SERVER_VERSION,
            num_unfinished=front.num_unfinished,
            num_requests_total=front.num_requests_total,
            prefix_cache=pb.PrefixCacheInfo(
                enabled=bool(info.get("prefix_cache")), hit_rate=float(hit_rate)
            ),
        )
