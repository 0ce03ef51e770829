"""Service contracts a plausible bug would break silently (found by mutation testing): limits at
their exact bounds, worker death racing submits and cancels, shutdown past the grace period,
restart bounds, the stream backlog's stall rule, auth, error details, client parity."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest

from qil_client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    QilError,
    Unauthenticated,
    Unavailable,
    pb,
)
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from service_fixtures import start_server, wait_until


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


def _paused_then_killed(c, action):
    """Run ``action`` in a thread while the worker is stopped, then SIGKILL the worker."""
    pid = c.info().worker.pid
    out = {}
    def run():
        try:
            out["value"] = action()
        except QilError as exc:
            out["error"] = exc
    os.kill(pid, signal.SIGSTOP)
    t = threading.Thread(target=run); t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    return out, time.monotonic() - t0


def test_cancel_in_flight_when_the_worker_dies_reports_was_active(model_dir):
    with start_server(model_dir, restart_backoff_s=0.2) as srv:
        with Client(srv.target, timeout=30) as c:
            rid = c.submit([1, 2, 3], max_new_tokens=6000, ignore_eos=True, request_id="victim")
            out, _ = _paused_then_killed(c, lambda: c.cancel(rid))
            assert out.get("value") == {rid: True}, out


def test_submit_in_flight_when_the_worker_dies_is_unavailable_at_once(model_dir):
    with start_server(model_dir, restart_backoff_s=0.2) as srv:
        with Client(srv.target, timeout=30) as c:
            out, waited = _paused_then_killed(
                c, lambda: c.submit([1, 2, 3], max_new_tokens=4, request_id="pending", timeout=20))
            assert isinstance(out.get("error"), Unavailable) and waited < 5, (out, waited)
            with pytest.raises(NotFound):  # a submit that failed leaves no request behind
                c.result("pending")


def test_shutdown_past_the_grace_period_ends_streams_with_a_cancelled_event(model_dir):
    srv = start_server(model_dir, grace_seconds=0.5)
    events, errors = [], []
    with Client(srv.target, timeout=60) as c:
        def run():
            try:
                for ev in c.stream([1, 2, 3], max_new_tokens=6000, ignore_eos=True):
                    events.append(ev)
            except QilError as exc:
                errors.append(exc)
        t = threading.Thread(target=run); t.start()
        wait_until(lambda: events)
        srv.stop()
        t.join(30)
    assert not errors, errors
    assert events[-1].finished and events[-1].finish_reason == pb.FINISH_REASON_CANCELLED


def test_max_restarts_allows_exactly_that_many_quick_restarts(model_dir):
    with start_server(model_dir, max_restarts=1, restart_backoff_s=0.1) as srv:
        with Client(srv.target, timeout=30) as c:
            pid = c.info().worker.pid
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: c.health() == "SERVING" and c.info().worker.pid != pid, timeout=60)
            assert c.info().worker.restarts == 1
            os.kill(c.info().worker.pid, signal.SIGKILL)  # dies again at once: a crash loop
            wait_until(lambda: c.info().worker.state == pb.WORKER_STATE_FAILED, timeout=30)
            assert c.info().worker.restarts == 1 and c.health() == "NOT_SERVING"


def test_subscribe_at_the_exact_end_of_a_finished_request_gets_its_final_event(server):
    with Client(server.target, timeout=30) as c:
        c.generate([1, 2, 3], max_new_tokens=5, request_id="at-end")
        evs = list(c.events("at-end", from_seq=5))
        assert len(evs) == 1 and evs[0].finished and not evs[0].token_ids and evs[0].seq == 5


def test_stats_reset_when_the_worker_is_gone(model_dir):
    with start_server(model_dir, max_restarts=0) as srv:
        with Client(srv.target, timeout=30) as c:
            c.submit([1, 2, 3], max_new_tokens=6000, ignore_eos=True)
            wait_until(lambda: c.info().pages.used > 0 and c.info().num_running == 1)
            os.kill(c.info().worker.pid, signal.SIGKILL)
            wait_until(lambda: c.info().worker.state == pb.WORKER_STATE_FAILED, timeout=15)
            info = c.info()
            assert info.pages.used == 0 and info.num_running == 0 and info.pages.free == info.pages.total


SLOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 2048)]


def test_a_reader_paused_briefly_is_not_cut_off(model_dir):
    srv = start_server(model_dir, max_stream_backlog=16)
    ch = grpc.insecure_channel(srv.target, options=SLOW)
    try:
        call = pb_grpc.InferenceStub(ch).Generate(
            pb.SubmitRequest(token_ids=[1, 2, 3], max_new_tokens=1500, ignore_eos=True), timeout=60)
        n = 0
        for i, ev in enumerate(call):
            n += len(ev.token_ids)
            if i == 3:
                time.sleep(0.3)  # a busy client, far under limits.STREAM_STALL_S (1 s)
        assert n == 1500
    finally:
        ch.close()
        srv.stop()


def test_backlog_counts_from_what_was_written_not_from_zero(model_dir, monkeypatch):
    from qil_worker.service import limits
    monkeypatch.setattr(limits, "STREAM_STALL_S", 0.2)
    srv = start_server(model_dir, max_stream_backlog=1500)
    ch = grpc.insecure_channel(srv.target, options=SLOW)
    try:
        call = pb_grpc.InferenceStub(ch).Generate(
            pb.SubmitRequest(token_ids=[1, 2, 3], max_new_tokens=4000, ignore_eos=True), timeout=60)
        n, paused = 0, False
        for ev in call:
            n += len(ev.token_ids)
            if n >= 2000 and not paused:
                paused = True
                time.sleep(0.4)  # stalls > STREAM_STALL_S, but falls far less than 1500 tokens behind
        assert n == 4000
    finally:
        ch.close()
        srv.stop()


def test_a_session_that_falls_behind_does_not_cancel_requests_it_only_watches(model_dir):
    srv = start_server(model_dir, max_stream_backlog=64)
    ch = grpc.insecure_channel(srv.target, options=SLOW)
    done = threading.Event()
    try:
        with Client(srv.target, timeout=60) as c:
            rid = c.submit([1, 2, 3], max_new_tokens=4000, ignore_eos=True, request_id="watched")

            def frames():
                yield pb.StreamEventsRequest(subscribe=pb.Subscribe(request_id=rid))
                done.wait(60)

            sess = pb_grpc.InferenceStub(ch).StreamEvents(frames(), timeout=60)
            time.sleep(3)  # the session never reads: it is cut off
            with pytest.raises(grpc.RpcError) as exc:
                for _ in sess:
                    pass
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.result(rid).finish_reason == "length"  # the watched request ran on
    finally:
        done.set()
        ch.close()
        srv.stop()


def test_a_submit_whose_caller_left_before_the_ack_does_not_run_on(model_dir):
    with start_server(model_dir) as srv:
        with Client(srv.target, timeout=30) as c:
            pid = c.info().worker.pid
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(DeadlineExceeded):
                    c.submit([1, 2, 3], max_new_tokens=6000, ignore_eos=True, request_id="gone", timeout=0.5)
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_until(lambda: c.info().num_unfinished == 0, timeout=5)
            assert c.result("gone").finish_reason == "cancelled"


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


def test_a_token_that_only_starts_with_the_right_one_is_refused(model_dir):
    with start_server(model_dir, auth_token="s3cret") as srv:
        for bad in ("s3cret-and-more", "s3cre"):
            with Client(srv.target, token=bad, timeout=10) as c:
                with pytest.raises(Unauthenticated):
                    c.info()
        with Client(srv.target, token="s3cret", timeout=10) as c:
            c.info()


def test_stop_string_limits_are_inclusive():
    from qil_worker.service.errors import ServiceError
    from qil_worker.service.requests import submit_args
    ok = submit_args(pb.SubmitRequest(token_ids=[1], stop_strings=["a"] * 15 + ["b" * 256]))
    assert len(ok.options["stop_strings"]) == 16
    for bad in (["a"] * 17, ["b" * 257], [""]):
        with pytest.raises(ServiceError) as exc:
            submit_args(pb.SubmitRequest(token_ids=[1], stop_strings=bad))
        assert exc.value.field == "stop_strings"


def test_max_new_tokens_defaults_to_16(server):
    with Client(server.target, timeout=30) as c:
        r = c.generate([1, 2, 3], ignore_eos=True)
        assert r.finish_reason == "length" and r.num_output_tokens == 16


def test_async_result_of_an_unknown_request_is_not_found(server):

    async def main():
        async with AsyncClient(server.target, timeout=30) as c:
            with pytest.raises(NotFound) as exc:
                await c.result("no-such-request")
            assert exc.value.field == "request_id"
    asyncio.run(main())


def test_async_stream_closed_early_cancels_its_request(server):

    async def main():
        async with AsyncClient(server.target, timeout=30) as c:
            agen = c.stream([1, 2, 3], max_new_tokens=6000, ignore_eos=True, request_id="aio-early")
            await agen.__anext__()
            await agen.aclose()
            for _ in range(100):
                if (await c.info()).num_unfinished == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await c.result("aio-early")).finish_reason == "cancelled"
    asyncio.run(main())


def test_port_65535_is_a_valid_target_port():
    from qil_client._channel import resolve_target
    assert resolve_target(["127.0.0.1:65535", "127.0.0.1:1"]) == ("ipv4:127.0.0.1:65535,127.0.0.1:1", True)


def test_an_error_without_a_field_has_field_none():
    from qil_client.errors import error_for
    assert error_for(14, "worker is restarting", "").field is None


def test_a_successful_result_has_error_none(server):
    with Client(server.target, timeout=30) as c:
        assert c.generate([1, 2, 3], max_new_tokens=2).error is None


def test_result_honours_its_timeout(server):
    with Client(server.target) as c:  # no client-wide default timeout
        rid = c.submit([1, 2, 3], max_new_tokens=6000, ignore_eos=True)
        try:
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded):
                c.result(rid, timeout=0.5)
            assert time.monotonic() - t0 < 3

            async def main():
                async with AsyncClient(server.target) as ac:
                    with pytest.raises(DeadlineExceeded):
                        await ac.result(rid, timeout=0.5)
            asyncio.run(main())
        finally:
            c.cancel(rid)


def test_a_session_answers_more_frames_than_it_holds_at_once(server):
    from qil_worker.service import limits
    n = limits.MAX_PENDING_FRAMES + 44
    with Client(server.target, timeout=30) as c:
        s = c.session(timeout=30)
        for i in range(n):
            s.cancel(f"nope-{i}")
        s.close()
        answers = [r for r in s if r.WhichOneof("frame") == "cancelled"]
        assert len(answers) == n


def test_the_worker_exits_on_stop_without_being_killed(model_dir):
    srv = start_server(model_dir)
    pid = srv.server.front.worker_pid
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 8
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_finished_requests_beyond_the_retention_count_are_forgotten(model_dir):
    with start_server(model_dir, retain_finished=2) as srv:
        with Client(srv.target, timeout=30) as c:
            for i in range(4):
                c.generate([1, 2, i], max_new_tokens=2, request_id=f"kept-{i}")
            for i in (0, 1):
                with pytest.raises(NotFound):
                    c.result(f"kept-{i}")
            assert [c.result(f"kept-{i}").num_output_tokens for i in (2, 3)] == [2, 2]
