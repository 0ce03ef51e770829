"""asyncio client of qil.v1.Inference (same surface as ``qil_client.Client``, awaitable)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Sequence

import grpc

from qil_client._channel import TLS, auth_metadata, channel_options, credentials, resolve_target
from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from qil_client.errors import QilError, error_for, from_rpc_error
from qil_client.ready import ReadyWait
from qil_client.retrieval import Embeddings, Ranked, embed_request, ranked, rerank_request
from qil_client.results import (
    Result,
    ResultBuilder,
    TokenizeResult,
    detokenize_request,
    submit_request,
    tokenize_request,
)

_HALF_CLOSE = object()


class AsyncSession:
    """A StreamEvents call (see ``qil_client.client.Session``); leaving ``async with`` aborts."""

    def __init__(self, stub: pb_grpc.InferenceStub, metadata, timeout: float | None) -> None:
        self._frames: asyncio.Queue = asyncio.Queue()
        self._call = stub.StreamEvents(self._frame_iter(), metadata=metadata, timeout=timeout)

    async def _frame_iter(self):
        while True:
            frame = await self._frames.get()
            if frame is _HALF_CLOSE:
                return
            yield frame

    def submit(self, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
               stop_token_ids: Sequence[int] = (), request_id: str = "", **options) -> None:
        """Send a submit frame; ``options`` as ``qil_client.results.submit_request``."""
        self._frames.put_nowait(pb.StreamEventsRequest(
            submit=submit_request(token_ids, max_new_tokens, stop_token_ids, request_id, **options)))

    def cancel(self, *request_ids: str) -> None:
        self._frames.put_nowait(pb.StreamEventsRequest(cancel=pb.CancelRequest(request_ids=list(request_ids))))

    def subscribe(self, request_id: str, from_seq: int = 0) -> None:
        self._frames.put_nowait(pb.StreamEventsRequest(
            subscribe=pb.Subscribe(request_id=request_id, from_seq=from_seq)))

    def close(self) -> None:
        self._frames.put_nowait(_HALF_CLOSE)

    def abort(self) -> None:
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[pb.StreamEventsResponse]:
        try:
            async for resp in self._call:
                yield resp
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


class AsyncClient:
    """``qil_client.Client``'s constructor, methods and errors, with awaitable calls."""

    def __init__(self, target: str | Sequence[str], token: str | None = None,
                 tls: bool | TLS | None = None, timeout: float | None = None) -> None:
        grpc_target, rr = resolve_target(target)
        opts = channel_options(rr, tls if isinstance(tls, TLS) else None)
        creds = credentials(tls)
        self._channel = (grpc.aio.secure_channel(grpc_target, creds, options=opts) if creds
                         else grpc.aio.insecure_channel(grpc_target, options=opts))
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._md = auth_metadata(token)
        self._timeout = timeout

    def _t(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self._timeout

    async def _unary(self, method, request, timeout):
        try:
            return await method(request, metadata=self._md, timeout=self._t(timeout))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def submit(self, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                     stop_token_ids: Sequence[int] = (), request_id: str = "",
                     timeout: float | None = None, **options) -> str:
        req = submit_request(token_ids, max_new_tokens, stop_token_ids, request_id, **options)
        return (await self._unary(self._stub.Submit, req, timeout)).request_id

    async def cancel(self, *request_ids: str, timeout: float | None = None) -> dict[str, bool]:
        resp = await self._unary(self._stub.Cancel, pb.CancelRequest(request_ids=list(request_ids)), timeout)
        return {r.request_id: r.was_active for r in resp.results}

    async def info(self, timeout: float | None = None) -> pb.GetInfoResponse:
        return await self._unary(self._stub.GetInfo, pb.GetInfoRequest(), timeout)

    async def tokenize(self, text: str | None = None, messages=None, enable_thinking: bool | None = None,
                       timeout: float | None = None, tools=None) -> TokenizeResult:
        """See ``qil_client.Client.tokenize``."""
        req = tokenize_request(text, messages, enable_thinking, tools)
        return TokenizeResult.from_proto(await self._unary(self._stub.Tokenize, req, timeout))

    async def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool | None = None,
                         timeout: float | None = None) -> str:
        """See ``qil_client.Client.detokenize``."""
        req = detokenize_request(token_ids, skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, req, timeout)).text

    async def embed(self, inputs: Sequence[str] | Sequence[Sequence[int]], dimensions: int | None = None,
              normalize: bool | None = None, timeout: float | None = None) -> Embeddings:
        """Embeddings of texts (encoded with the tokenizer's own special tokens) or token-id
        lists: each the final hidden state of its last token, L2-normalised unless
        ``normalize=False``, its first ``dimensions`` components when given."""
        req = embed_request(inputs, dimensions, normalize)
        return Embeddings.from_proto(await self._unary(self._stub.Embed, req, timeout))

    async def rerank(self, query: str, documents: Sequence[str], instruction: str | None = None,
               top_n: int | None = None, timeout: float | None = None) -> list[Ranked]:
        """``documents`` ordered by relevance to ``query`` (Qwen3-Reranker's judgement), best
        first, the best ``top_n`` only when given."""
        req = rerank_request(query, documents, instruction, top_n)
        return ranked(await self._unary(self._stub.Rerank, req, timeout))

    async def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def wait_ready(self, timeout: float = 60.0, *, fail_when_refused: bool = False) -> None:
        """Wait until the server reports SERVING (see ``qil_client.Client.wait_ready``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        waiter = ReadyWait(timeout, fail_when_refused)
        while True:
            try:
                status = await self.health(timeout=max(0.1, min(2.0, deadline - loop.time())))
            except QilError as err:
                status = err
            if waiter.ready(status):
                return
            if loop.time() > deadline:
                waiter.give_up()
            await asyncio.sleep(0.1)

    async def stream(self, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                     stop_token_ids: Sequence[int] = (), request_id: str = "",
                     timeout: float | None = None, **options) -> AsyncIterator[pb.Event]:
        """Generate: events as tokens come; leaving the loop early cancels the request."""
        req = submit_request(token_ids, max_new_tokens, stop_token_ids, request_id, **options)
        call = self._stub.Generate(req, metadata=self._md, timeout=self._t(timeout))
        try:
            async for ev in call:
                yield ev
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def generate(self, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                       stop_token_ids: Sequence[int] = (), request_id: str = "",
                       timeout: float | None = None, **options) -> Result:
        builder = ResultBuilder(request_id)
        async for ev in self.stream(token_ids, max_new_tokens, stop_token_ids, request_id, timeout, **options):
            builder.add(ev)
        return builder.result()

    async def events(self, request_id: str, from_seq: int = 0,
                     timeout: float | None = None) -> AsyncIterator[pb.Event]:
        session = AsyncSession(self._stub, self._md, self._t(timeout))
        session.subscribe(request_id, from_seq)
        session.close()
        try:
            async for resp in session:
                kind = resp.WhichOneof("frame")
                if kind == "event":
                    yield resp.event
                elif kind == "error":
                    raise error_for(resp.error.code, resp.error.message, resp.error.field)
        finally:  # left early: end the call now, not when the channel closes
            session.abort()

    async def result(self, request_id: str, timeout: float | None = None) -> Result:
        builder = ResultBuilder(request_id)
        async for ev in self.events(request_id, timeout=timeout):
            builder.add(ev)
        return builder.result()

    def session(self, timeout: float | None = None) -> AsyncSession:
        return AsyncSession(self._stub, self._md, self._t(timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["AsyncClient", "AsyncSession", "QilError"]
