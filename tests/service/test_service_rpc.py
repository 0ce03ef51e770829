"""Every RPC against one real server (front in a thread, worker in a spawned process)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from qil_client import (
    AlreadyExists,
    AsyncClient,
    Client,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    pb,
)
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from qil_client.results import ResultBuilder
from service_fixtures import (
    ENGINE,
    MAX_POSITIONS,
    POOL_TOKENS,
    SMALL_WINDOW,
    reference_outputs,
    start_server,
    wait_until,
)

LONG = 6000  # tokens: as many steps in a row, so even a tiny model is still running when cancelled


def pages_used(client: Client) -> int:
    return client.info().pages.used


def wait_pages_free(client: Client, timeout: float = 10.0) -> None:
    wait_until(lambda: client.info().pages.used == 0 and client.info().num_unfinished == 0, timeout)


def test_health_and_reflection(server, client):
    assert client.health() == "SERVING"
    assert client.health("qil.v1.Inference") == "SERVING"
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        resp = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=10)))
        names = {s.name for s in resp.list_services_response.service}
    assert {"qil.v1.Inference", "grpc.health.v1.Health"} <= names


def _reflect_v1(target: str, *requests):
    """Raw grpc.reflection.v1 calls (grpcurl and Postman ask v1 first). Its messages are
    v1alpha's in another package, identical on the wire."""
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(target) as ch:
        call = ch.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return list(call(iter([reflection_pb2.ServerReflectionRequest(**r) for r in requests]), timeout=10))


def test_reflection_v1_lists_and_describes_every_service(server):
    from google.protobuf import descriptor_pb2, descriptor_pool

    services = {"qil.v1.Inference", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"}
    (listed, *described) = _reflect_v1(server.target, dict(list_services=""),
                                       *(dict(file_containing_symbol=name) for name in sorted(services)))
    assert {s.name for s in listed.list_services_response.service} == services
    pool = descriptor_pool.DescriptorPool()  # what a client builds from the answers
    for resp in described:
        assert resp.WhichOneof("message_response") == "file_descriptor_response", resp
        files = [descriptor_pb2.FileDescriptorProto.FromString(b)
                 for b in resp.file_descriptor_response.file_descriptor_proto]
        for f in reversed(files):  # each file comes before the files it imports
            try:
                pool.FindFileByName(f.name)
            except KeyError:
                pool.Add(f)
    for name in services:
        pool.FindServiceByName(name)
    v1 = pool.FindServiceByName("grpc.reflection.v1.ServerReflection").methods_by_name["ServerReflectionInfo"]
    assert v1.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    assert v1.output_type.full_name == "grpc.reflection.v1.ServerReflectionResponse"
    (missing,) = _reflect_v1(server.target, dict(file_containing_symbol="no.such.Service"))
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_get_info(client, model_dir):
    info = client.info()
    assert info.model.vocab_size == 97
    assert info.model.max_position_embeddings == MAX_POSITIONS
    assert info.model.name == str(model_dir)
    assert not info.model.demo
    assert info.model.dtype == "float32"
    assert (info.model.architecture, info.model.num_experts) == ("qwen3", 0)  # dense: every weight active
    assert info.model.num_parameters == info.model.num_active_parameters > 0
    assert (info.model.tensor_parallel_size, info.model.nnodes) == (1, 1)  # one device: one rank holds all
    assert info.model.rank_weight_bytes == info.model.weight_bytes > 0
    assert info.limits.page_size == ENGINE["page_size"]
    assert info.limits.max_active == ENGINE["max_active"]
    assert info.limits.max_request_id_length == 128
    assert info.pages.total == ENGINE["num_pages"]
    assert info.pages.used + info.pages.free == info.pages.total
    assert info.worker.state == pb.WORKER_STATE_READY
    assert info.worker.pid > 0
    assert not info.model.has_tokenizer and not info.model.has_chat_template
    assert info.prefix_cache.enabled


def test_generate_matches_engine_and_reports_metrics(client, model_dir):
    prompt = [5, 6, 7, 8]
    want = reference_outputs(model_dir, [prompt], 10)[0]
    events = list(client.stream(prompt, max_new_tokens=10, request_id="gen-1"))
    assert [e.seq for e in events] == [sum(len(x.token_ids) for x in events[:i]) for i in range(len(events))]
    assert all(e.request_id == "gen-1" for e in events)
    final = events[-1]
    assert final.finished and not any(e.finished for e in events[:-1])
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert [t for e in events for t in e.token_ids] == want
    assert final.num_prompt_tokens == 4 and final.num_output_tokens == 10
    m = final.metrics
    assert 0 <= m.queue_time_s <= m.ttft_s <= m.e2e_s
    assert 0 < m.mean_itl_s <= m.max_itl_s


def test_stop_token_ends_with_stop(client, model_dir):
    prompt = [9, 10, 11]
    free = reference_outputs(model_dir, [prompt], 8)[0]
    stop = free[3]
    r = client.generate(prompt, max_new_tokens=8, stop_token_ids=[stop])
    assert r.finish_reason == "stop"
    assert r.token_ids == free[: free.index(stop) + 1]


def test_32_concurrent_streams_match_in_process_engine(server, model_dir):
    prompts = [[(7 * i + j) % 97 for j in range(3 + i % 5)] for i in range(32)]
    want = reference_outputs(model_dir, prompts, 12)

    async def run():
        async with AsyncClient(server.target, timeout=60) as ac:
            return await asyncio.gather(*(ac.generate(p, max_new_tokens=12) for p in prompts))

    results = asyncio.run(run())
    assert [r.token_ids for r in results] == want
    assert all(r.finish_reason == "length" and r.num_output_tokens == 12 for r in results)
    assert len({r.request_id for r in results}) == 32


def test_submit_then_late_subscriber_gets_everything(client, model_dir):
    prompt = [1, 2, 3, 4, 5]
    want = reference_outputs(model_dir, [prompt], 20)[0]
    rid = client.submit(prompt, max_new_tokens=20, request_id="late-1")
    assert rid == "late-1"
    # The request runs without any stream; subscribe only after it is over.
    wait_until(lambda: client.info().num_unfinished == 0)
    r = client.result(rid)
    assert r.token_ids == want and r.finish_reason == "length"
    tail = list(client.events(rid, from_seq=15))
    assert tail[0].seq == 15
    assert [t for e in tail for t in e.token_ids] == want[15:]
    assert tail[-1].finished


def test_subscriber_during_generation_gets_full_sequence(client):
    rid = client.submit([3, 1, 4, 1, 5], max_new_tokens=1500)
    live = client.events(rid)
    first = next(live)
    assert client.info().num_unfinished >= 1  # subscribed while it runs
    events = [first, *live]
    assert events[0].seq == 0
    tokens = [t for e in events for t in e.token_ids]
    assert len(tokens) == 1500 and events[-1].finished
    assert client.result(rid).token_ids == tokens  # and a replay after the end agrees


def test_server_generates_request_id_and_echoes_it(client):
    rid = client.submit([1, 2], max_new_tokens=2)
    assert rid and len(rid) <= 128
    assert client.result(rid).request_id == rid


def test_cancel_rpc_frees_pages_and_is_idempotent(client):
    rid = client.submit([1, 2, 3], max_new_tokens=LONG)
    wait_until(lambda: pages_used(client) > 0)
    out = client.cancel(rid, "never-existed")
    assert out == {rid: True, "never-existed": False}
    assert client.info().pages.used == 0  # Cancel returns once the request is over
    assert client.cancel(rid) == {rid: False}  # idempotent
    r = client.result(rid)
    assert r.finish_reason == "cancelled" and r.num_output_tokens < LONG


def test_cancel_by_client_disconnect(client):
    stream = client.stream([2, 3, 4], max_new_tokens=LONG, request_id="disc-1")
    first = next(stream)
    assert first.request_id == "disc-1"
    stream.close()  # cancels the call
    wait_pages_free(client)
    r = client.result("disc-1")
    assert r.finish_reason == "cancelled" and r.num_output_tokens < LONG


def test_cancel_by_deadline(client):
    with pytest.raises(DeadlineExceeded):
        client.generate([4, 5, 6], max_new_tokens=LONG, request_id="dl-1", timeout=0.3)
    wait_pages_free(client)
    assert client.result("dl-1").finish_reason == "cancelled"


def test_session_submit_cancel_subscribe_and_half_close(client, model_dir):
    want = reference_outputs(model_dir, [[7, 7, 7]], 6)[0]
    with client.session() as s:
        s.submit([7, 7, 7], max_new_tokens=6, request_id="s-a")
        s.submit([8, 8], max_new_tokens=LONG, request_id="s-b")
        s.submit([8, 8], max_new_tokens=0, request_id="s-bad")
        got: dict[str, ResultBuilder] = {}
        errors, acks, cancels = [], [], []
        cancelled = False
        for resp in s:
            kind = resp.WhichOneof("frame")
            if kind == "submitted":
                acks.append(resp.submitted.request_id)
            elif kind == "error":
                errors.append(resp.error)
            elif kind == "cancelled":
                cancels.append({r.request_id: r.was_active for r in resp.cancelled.results})
            elif kind == "event":
                got.setdefault(resp.event.request_id, ResultBuilder()).add(resp.event)
                if resp.event.request_id == "s-b" and not cancelled:
                    cancelled = True
                    s.cancel("s-b")
                    s.subscribe("late-1")  # a request submitted elsewhere, already over
                    s.close()  # half-close: the server ends after the last request
    assert acks == ["s-a", "s-b"]
    assert len(errors) == 1 and errors[0].request_id == "s-bad"
    assert errors[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and errors[0].field == "max_new_tokens"
    assert cancels == [{"s-b": True}]
    assert got["s-a"].result().token_ids == want
    assert got["s-b"].result().finish_reason == "cancelled"
    assert got["late-1"].result().num_output_tokens == 20
    wait_pages_free(client)


def test_session_break_cancels_its_requests(client):
    s = client.session()
    s.submit([1, 1, 1], max_new_tokens=LONG, request_id="brk-1")
    it = iter(s)
    while next(it).WhichOneof("frame") != "event":
        pass
    s.abort()
    wait_pages_free(client)
    assert client.result("brk-1").finish_reason == "cancelled"


def test_subscribe_unknown_is_not_found(client):
    with pytest.raises(NotFound) as exc:
        list(client.events("no-such-request"))
    assert exc.value.field == "request_id"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(token_ids=[]), "token_ids"),
        (dict(token_ids=[1, 97]), "token_ids"),
        (dict(token_ids=[1], max_new_tokens=0), "max_new_tokens"),
        (dict(token_ids=[1] * (MAX_POSITIONS + 1)), None),  # longer than the model's positions
        (dict(token_ids=[1] * 100, max_new_tokens=MAX_POSITIONS), "max_new_tokens"),
        (dict(token_ids=[1], request_id="x" * 129), "request_id"),
        (dict(token_ids=[1], request_id="a\n2026-01-01 CRITICAL forged log line"), "request_id"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    for call in (client.submit, client.generate):
        with pytest.raises(InvalidArgument) as exc:
            call(**kwargs)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.field
        if field:
            assert exc.value.field == field
        assert exc.value.details.startswith(exc.value.field + ":")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(text="hello"), "text"),
        (dict(messages=[{"role": "user", "content": "hello"}]), "messages"),
        (dict(token_ids=[1, 2], stop_strings=["x"]), "stop_strings"),
    ],
)
def test_text_without_a_tokenizer_is_failed_precondition(client, kwargs, field):
    for call in (client.submit, client.generate):
        with pytest.raises(FailedPrecondition) as exc:
            call(max_new_tokens=2, **kwargs)
        assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert exc.value.field == field
        assert "tokenizer" in exc.value.details
    assert client.info().num_unfinished == 0
    # token ids still work, and events carry no text
    r = client.generate([1, 2], max_new_tokens=2, temperature=0.5, seed=1, logprobs=True)
    assert r.finish_reason == "length" and r.text is None and len(r.logprobs) == 2


def test_text_without_a_tokenizer_in_a_session_is_an_in_band_error(client):
    with client.session() as s:
        s.submit(text="hello", request_id="notok-1")
        s.close()
        frames = list(s)
    assert [f.WhichOneof("frame") for f in frames] == ["error"]
    err = frames[0].error
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and err.field == "text"
    assert err.request_id == "notok-1" and "tokenizer" in err.message


def test_request_larger_than_the_page_pool_is_invalid_argument(client):
    info = client.info()
    assert info.pages.total * info.limits.page_size == POOL_TOKENS < MAX_POSITIONS
    with pytest.raises(InvalidArgument) as exc:
        client.submit([1] * 100, max_new_tokens=POOL_TOKENS)  # fits positions, never the pool
    assert exc.value.field


def test_live_duplicate_is_already_exists(client):
    rid = client.submit([1, 2, 3], max_new_tokens=LONG, request_id="dup-1")
    with pytest.raises(AlreadyExists) as exc:
        client.submit([1, 2, 3], max_new_tokens=2, request_id="dup-1")
    assert exc.value.field == "request_id"
    client.cancel(rid)
    # once over, the id may be used again
    assert client.generate([1, 2], max_new_tokens=2, request_id="dup-1").finish_reason == "length"


def test_slow_reader_gets_coalesced_events_and_does_not_stall_others(server, client, model_dir):
    prompt, n = [11, 12, 13], 2000
    # the first 80 tokens against the in-process engine (all 2000 would take this process a while),
    # all of them against the server's own record of the request
    want = reference_outputs(model_dir, [prompt], 80)[0]
    # A reader slower than the worker, whatever the machine's speed: its window is small (the
    # server's writes to it block early) and it reads nothing more until its request is over.
    ch = grpc.insecure_channel(server.target, options=SMALL_WINDOW)
    try:
        slow = pb_grpc.InferenceStub(ch).Generate(
            pb.SubmitRequest(token_ids=prompt, max_new_tokens=n, request_id="slow-reader"), timeout=60)
        first = next(slow)
        # Another request completes while the slow reader reads nothing.
        t0 = time.monotonic()
        other = client.generate([2, 2], max_new_tokens=5)
        assert other.finish_reason == "length" and time.monotonic() - t0 < 10
        done = client.result("slow-reader", timeout=60)  # all made, none of the rest read
        rest = list(slow)
    finally:
        ch.close()
    events = [first] + rest
    tokens = [t for e in events for t in e.token_ids]
    assert len(tokens) == n and tokens == list(done.token_ids) and tokens[:80] == want
    assert max(len(e.token_ids) for e in events) > 1, "no event carried more than one token"
    b = ResultBuilder()
    for e in events:
        b.add(e)  # raises on a gap
    assert b.result().finish_reason == "length"


def test_events_are_gap_free_under_concurrency(server):
    async def run():
        async with AsyncClient(server.target, timeout=60) as ac:
            rids = [await ac.submit([i + 1, 2, 3], max_new_tokens=30) for i in range(8)]
            return await asyncio.gather(*(ac.result(r) for r in rids))

    results = asyncio.run(run())
    assert all(r.num_output_tokens == 30 == len(r.token_ids) for r in results)


def test_async_session_info_and_health(server, model_dir):
    want = reference_outputs(model_dir, [[6, 6]], 5)[0]

    async def run():
        async with AsyncClient(server.target, timeout=60) as ac:
            assert await ac.health() == "SERVING"
            info = await ac.info()
            s = ac.session()
            s.submit([6, 6], max_new_tokens=5, request_id="aio-s")
            s.close()
            b = ResultBuilder()
            async for resp in s:
                if resp.WhichOneof("frame") == "event":
                    b.add(resp.event)
            cancelled = await ac.cancel("aio-s")
            return info, b.result(), cancelled

    info, result, cancelled = asyncio.run(run())
    assert info.model.vocab_size == 97
    assert result.token_ids == want and result.finish_reason == "length"
    assert cancelled == {"aio-s": False}  # already over


def _final(reason, prompt, output, preemptions=0, stop=None, mean_itl=0.01, max_itl=0.02):
    from qil_worker.service.protocol import FinalRecord, RequestTimings

    metrics = RequestTimings(0.1, 0.2, mean_itl, max_itl, 0.3, preemptions)
    return FinalRecord(reason, None, prompt, output, 0, stop, metrics)


def test_build_event_coalesces_everything_since_the_cursor():
    from qil_worker.service.front.request_log import FrontRequest
    from qil_worker.service.protocol import FinishReason
    from qil_worker.service.front.streams import build_event

    req = FrontRequest("r", prompt_len=3)
    assert build_event(req, 0) == (None, 0, False)
    for t in (5, 6, 7):
        req.append(t, None, None, None)
    ev, cursor, done = build_event(req, 1)
    assert (ev.seq, list(ev.token_ids), cursor, done, ev.finished) == (1, [6, 7], 3, False, False)
    req.append(8, None, None, None, _final(FinishReason.LENGTH, 3, 4, preemptions=1))
    ev, cursor, done = build_event(req, 3)
    assert (ev.seq, list(ev.token_ids), cursor, done) == (3, [8], 4, True)
    assert ev.finish_reason == pb.FINISH_REASON_LENGTH and ev.num_output_tokens == 4
    assert ev.num_prompt_tokens == 3 and ev.metrics.num_preemptions == 1


def test_build_event_keeps_text_and_logprobs_aligned_with_tokens():
    from qil_worker.service.front.request_log import FrontRequest
    from qil_worker.service.protocol import FinishReason
    from qil_worker.service.front.streams import build_event

    req = FrontRequest("r", prompt_len=2)
    req.append(5, "a", -0.5, [(5, -0.5), (6, -1.0)])
    req.append(6, "", -0.25, [(6, -0.25), (5, -2.0)])  # a token ending mid-character
    req.append(7, "é", -1.5, [(1, -0.1), (7, -1.5)])
    ev, cursor, done = build_event(req, 1)
    assert (list(ev.token_ids), ev.text, list(ev.logprobs)) == ([6, 7], "é", [-0.25, -1.5])
    assert [[(c.token_id, c.logprob) for c in t.candidates] for t in ev.top_logprobs] == [
        [(6, -0.25), (5, -2.0)], [(1, -0.1), (7, -1.5)]
    ]
    # text released by the end itself (e.g. a held-back prefix)
    req.append(-1, "xy", None, None, _final(FinishReason.STOP, 2, 3, stop="STOP"))
    ev, cursor, done = build_event(req, 3)
    assert done and list(ev.token_ids) == [] and ev.text == "xy" and ev.stop_string == "STOP"
    ev, _, _ = build_event(req, 0)
    assert ev.text == "aéxy" and len(ev.logprobs) == len(ev.top_logprobs) == 3
    plain = FrontRequest("p", prompt_len=1)
    plain.append(3, None, None, None, _final(FinishReason.STOP, 1, 1, stop=3, mean_itl=None, max_itl=None))
    ev, _, _ = build_event(plain, 0)
    assert not ev.HasField("text") and not ev.logprobs and ev.stop_token_id == 3


def test_cancelling_an_id_twice_reports_it_active_both_times(server):
    with Client(server.target, timeout=30) as c:
        rid = c.submit([1, 2, 3], max_new_tokens=6000, request_id="dup-cancel")
        wait_until(lambda: c.info().pages.used > 0)
        assert c.cancel(rid, rid) == {rid: True}
        assert c.result(rid).finish_reason == "cancelled"


def test_prompt_plus_max_new_equal_to_positions_is_accepted(tmp_path):
    from checkpoints import make_checkpoint
    with start_server(make_checkpoint(tmp_path / "m", seed=0, max_position_embeddings=64)) as srv:
        with Client(srv.target, timeout=30) as c:
            r = c.generate([1] * 60, max_new_tokens=4, ignore_eos=True)
            assert r.finish_reason == "length" and r.num_output_tokens == 4
            with pytest.raises(InvalidArgument):
                c.generate([1] * 61, max_new_tokens=4)


def test_request_id_of_exactly_the_maximum_length_is_accepted(server):
    with Client(server.target, timeout=30) as c:
        rid = "x" * 128
        assert c.generate([1, 2], max_new_tokens=2, request_id=rid).request_id == rid


def test_error_details_name_the_field_once(server):
    with Client(server.target, timeout=30) as c:
        with pytest.raises(InvalidArgument) as exc:
            c.submit([1], max_new_tokens=0)
        assert exc.value.field == "max_new_tokens"
        assert exc.value.details.count("max_new_tokens:") == 1, exc.value.details


def test_a_duplicate_reported_by_the_engine_is_already_exists():
    from qil_worker.errors import DuplicateRequestError
    from qil_worker.service.errors import classify_engine_error, from_worker_rejection
    err = from_worker_rejection(*classify_engine_error(DuplicateRequestError("x")))
    assert err.code == grpc.StatusCode.ALREADY_EXISTS and err.field == "request_id"


def test_stop_string_limits_are_inclusive():
    # the one check both fronts and the engine make (qil_worker.request_limits)
    from qil_worker.errors import InvalidRequestError
    from qil_worker.request_limits import check_stop_strings
    assert len(check_stop_strings(["a"] * 15 + ["b" * 256])) == 16
    for bad in (["a"] * 17, ["b" * 257], [""]):
        with pytest.raises(InvalidRequestError) as exc:
            check_stop_strings(bad)
        assert exc.value.field == "stop_strings"


def test_max_new_tokens_defaults_to_16(server):
    with Client(server.target, timeout=30) as c:
        r = c.generate([1, 2, 3], ignore_eos=True)
        assert r.finish_reason == "length" and r.num_output_tokens == 16


def test_a_session_answers_more_frames_than_it_holds_at_once(server):
    from qil_worker.service.front import limits
    n = limits.MAX_PENDING_FRAMES + 44
    with Client(server.target, timeout=30) as c:
        s = c.session(timeout=30)
        for i in range(n):
            s.cancel(f"nope-{i}")
        s.close()
        answers = [r for r in s if r.WhichOneof("frame") == "cancelled"]
        assert len(answers) == n


def test_finished_requests_beyond_the_retention_count_are_forgotten(model_dir):
    with start_server(model_dir, retain_finished=2) as srv:
        with Client(srv.target, timeout=30) as c:
            for i in range(4):
                c.generate([1, 2, i], max_new_tokens=2, request_id=f"kept-{i}")
            for i in (0, 1):
                with pytest.raises(NotFound):
                    c.result(f"kept-{i}")
            assert [c.result(f"kept-{i}").num_output_tokens for i in (2, 3)] == [2, 2]
