"""Synchronous client of qil.v1.Inference."""

from __future__ import annotations

import queue
import weakref
from typing import Iterator, Sequence

import grpc

from qil_client._channel import TLS, auth_metadata, channel_options, credentials, resolve_target
from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from qil_client.errors import QilError, from_rpc_error
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


class Session:
    """A StreamEvents call: send frames any time, iterate over the server's answers and events.

    ``close()`` half-closes: the server ends the stream after the session's last request ends.
    ``abort()`` breaks the stream: the server cancels the requests submitted on it. Leaving a
    ``with`` block aborts.
    """

    def __init__(self, stub: pb_grpc.InferenceStub, metadata, timeout: float | None) -> None:
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self._call = stub.StreamEvents(self._frame_iter(), metadata=metadata, timeout=timeout)

    def _frame_iter(self) -> Iterator[pb.StreamEventsRequest]:
        while True:
            frame = self._frames.get()
            if frame is _HALF_CLOSE:
                return
            yield frame

    def submit(self, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
               stop_token_ids: Sequence[int] = (), request_id: str = "", **options) -> None:
        """Send a submit frame; ``options`` as ``qil_client.results.submit_request``."""
        self._frames.put(pb.StreamEventsRequest(
            submit=submit_request(token_ids, max_new_tokens, stop_token_ids, request_id, **options)))

    def cancel(self, *request_ids: str) -> None:
        self._frames.put(pb.StreamEventsRequest(cancel=pb.CancelRequest(request_ids=list(request_ids))))

    def subscribe(self, request_id: str, from_seq: int = 0) -> None:
        self._frames.put(pb.StreamEventsRequest(
            subscribe=pb.Subscribe(request_id=request_id, from_seq=from_seq)))

    def close(self) -> None:
        self._frames.put(_HALF_CLOSE)

    def abort(self) -> None:
        self._call.cancel()
        self.close()  # ends _frame_iter, which gRPC's frame-sending thread would wait on forever

    def __iter__(self) -> Iterator[pb.StreamEventsResponse]:
        try:
            yield from self._call
        except grpc.RpcError as err:
            self.close()  # the call is over (deadline, server error): let the sending thread end
            raise from_rpc_error(err) from None
        self.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


class Client:
    """``Client("127.0.0.1:50051")``, ``Client(["10.0.0.1:50051", "10.0.0.2:50051"])`` or
    ``Client("dns:///qil.internal:50051")`` (several addresses: round_robin).

    ``token``: bearer token for servers started with --auth-token. ``tls``: True (system roots)
    or a ``TLS``. Every failed call raises a ``qil_client.errors.QilError`` subclass (and
    ``wait_ready`` a TimeoutError). The constructor, which makes no call, raises ValueError for a
    target list entry that is not HOST:PORT or does not resolve, and OSError for a TLS file it
    cannot read.

    ``submit``, ``stream`` and ``generate`` take the prompt as ``token_ids``, ``text=`` or
    ``messages=`` and the keyword options of ``qil_client.results.submit_request``: sampling
    (``temperature``, ``top_p``, ``seed``, ... as listed in ``qil_client.options.SAMPLING``),
    ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs``, ``logit_bias`` ({token id: bias}),
    ``stop_strings`` / ``include_stop_string``, ``skip_special_tokens``, ``enable_thinking``, and
    one structured-output constraint (``json_schema=`` a str or dict, ``json_object=True``,
    ``regex=``, ``grammar=``, ``choice=[...]``). None leaves an option to the server's default
    (greedy decoding).
    """

    def __init__(self, target: str | Sequence[str], token: str | None = None,
                 tls: bool | TLS | None = None, timeout: float | None = None) -> None:
        grpc_target, rr = resolve_target(target)
        opts = channel_options(rr, tls if isinstance(tls, TLS) else None)
        creds = credentials(tls)
        self._channel = (grpc.secure_channel(grpc_target, creds, options=opts) if creds
                         else grpc.insecure_channel(grpc_target, options=opts))
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._md = auth_metadata(token)
        self._timeout = timeout
        # open sessions: close() aborts them, else gRPC's thread that sends a dropped
        # session's frames would wait on its queue forever
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()

    # -- unary
    def submit(self, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
               stop_token_ids: Sequence[int] = (), request_id: str = "",
               timeout: float | None = None, **options) -> str:
        req = submit_request(token_ids, max_new_tokens, stop_token_ids, request_id, **options)
        return self._unary(self._stub.Submit, req, timeout).request_id

    def cancel(self, *request_ids: str, timeout: float | None = None) -> dict[str, bool]:
        resp = self._unary(self._stub.Cancel, pb.CancelRequest(request_ids=list(request_ids)), timeout)
        return {r.request_id: r.was_active for r in resp.results}

    def info(self, timeout: float | None = None) -> pb.GetInfoResponse:
        return self._unary(self._stub.GetInfo, pb.GetInfoRequest(), timeout)

    def tokenize(self, text: str | None = None, messages=None, enable_thinking: bool | None = None,
                 timeout: float | None = None, tools=None) -> TokenizeResult:
        """``text`` or chat ``messages`` (with the ``tools`` a submit would give) as the server
        encodes a submit's prompt: its ``num_tokens`` is what that submit reports as
        num_prompt_tokens (nothing is queued)."""
        req = tokenize_request(text, messages, enable_thinking, tools)
        return TokenizeResult.from_proto(self._unary(self._stub.Tokenize, req, timeout))

    def detokenize(self, token_ids: Sequence[int], skip_special_tokens: bool | None = None,
                   timeout: float | None = None) -> str:
        """The text of ``token_ids`` as output text is decoded (special tokens skipped unless
        ``skip_special_tokens=False``)."""
        req = detokenize_request(token_ids, skip_special_tokens)
        return self._unary(self._stub.Detokenize, req, timeout).text

    def embed(self, inputs: Sequence[str] | Sequence[Sequence[int]], dimensions: int | None = None,
              normalize: bool | None = None, timeout: float | None = None) -> Embeddings:
        """Embeddings of texts (encoded with the tokenizer's own special tokens) or token-id
        lists: each the final hidden state of its last token, L2-normalised unless
        ``normalize=False``, its first ``dimensions`` components when given."""
        req = embed_request(inputs, dimensions, normalize)
        return Embeddings.from_proto(self._unary(self._stub.Embed, req, timeout))

    def rerank(self, query: str, documents: Sequence[str], instruction: str | None = None,
               top_n: int | None = None, timeout: float | None = None) -> list[Ranked]:
        """``documents`` ordered by relevance to ``query`` (Qwen3-Reranker's judgement), best
        first, the best ``top_n`` only when given."""
        req = rerank_request(query, documents, instruction, top_n)
        return ranked(self._unary(self._stub.Rerank, req, timeout))

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        """"SERVING", "NOT_SERVING", ... of grpc.health.v1 (no token needed)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_ready(self, timeout: float = 60.0, *, fail_when_refused: bool = False) -> None:
        """Block until the server reports SERVING; TimeoutError after ``timeout`` seconds, naming
        the last status or error (and chained to that error).

        ``fail_when_refused``: a connection refused (nothing listens at the target) raises the
        ``Unavailable`` at once; the wait is then for a server that answers but is not SERVING
        yet (loading its model, restarting its worker). By default that is waited out too, as
        for a server process started just before.
        """
        import time

        deadline = time.monotonic() + timeout
        waiter = ReadyWait(timeout, fail_when_refused)
        while True:
            try:
                status = self.health(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            except QilError as err:
                status = err
            if waiter.ready(status):
                return
            if time.monotonic() > deadline:
                waiter.give_up()
            time.sleep(0.1)

    # -- streaming
    def stream(self, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
               stop_token_ids: Sequence[int] = (), request_id: str = "",
               timeout: float | None = None, **options) -> Iterator[pb.Event]:
        """Generate: yield events as tokens come. Closing the iterator early cancels the request."""
        req = submit_request(token_ids, max_new_tokens, stop_token_ids, request_id, **options)
        call = self._stub.Generate(req, metadata=self._md, timeout=self._t(timeout))
        return self._iterate(call)

    def generate(self, token_ids: Sequence[int] | None = None, max_new_tokens: int | None = None,
                 stop_token_ids: Sequence[int] = (), request_id: str = "",
                 timeout: float | None = None, **options) -> Result:
        builder = ResultBuilder(request_id)
        for ev in self.stream(token_ids, max_new_tokens, stop_token_ids, request_id, timeout, **options):
            builder.add(ev)
        return builder.result()

    def events(self, request_id: str, from_seq: int = 0, timeout: float | None = None) -> Iterator[pb.Event]:
        """The events of a request submitted earlier (replayed from ``from_seq``), to its end."""
        session = self.session(timeout)
        session.subscribe(request_id, from_seq)
        session.close()
        for resp in session:
            kind = resp.WhichOneof("frame")
            if kind == "event":
                yield resp.event
            elif kind == "error":
                from qil_client.errors import error_for

                raise error_for(resp.error.code, resp.error.message, resp.error.field)

    def result(self, request_id: str, timeout: float | None = None) -> Result:
        builder = ResultBuilder(request_id)
        for ev in self.events(request_id, timeout=timeout):
            builder.add(ev)
        return builder.result()

    def session(self, timeout: float | None = None) -> Session:
        session = Session(self._stub, self._md, self._t(timeout))
        self._sessions.add(session)
        return session

    # -- plumbing
    def _t(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self._timeout

    def _unary(self, method, request, timeout):
        try:
            return method(request, metadata=self._md, timeout=self._t(timeout))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    @staticmethod
    def _iterate(call) -> Iterator[pb.Event]:
        try:
            yield from call
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()  # no-op when the call already ended

    def close(self) -> None:
        for session in list(self._sessions):
            session.abort()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
