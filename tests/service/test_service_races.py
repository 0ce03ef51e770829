"""Answers that arrive after their caller left, subscriptions around a request's end, and a
drain under a session: the front's bookkeeping stays exact and one request's trouble stays its own.

A worker busy in a long step is made by stopping its process (SIGSTOP) and resuming it
(SIGCONT): the front keeps accepting calls meanwhile and answers them when the worker does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from qil_client import Client, DeadlineExceeded, InvalidArgument, QilError, pb
from service_fixtures import MAX_POSITIONS, spy_on, start_server, wait_until

INVALID_ARGUMENT, UNAVAILABLE = 3, 14


@contextmanager
def worker_paused(client: Client):
    pid = client.info().worker.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def read_all(session, into: list) -> threading.Thread:
    """Collect a session's frames (then "END", or the error) in a thread."""

    def run() -> None:
        try:
            into.extend(session)
            into.append("END")
        except QilError as exc:
            into.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def has_event(frames: list) -> bool:
    return any(isinstance(f, pb.StreamEventsResponse) and f.WhichOneof("frame") == "event" for f in frames)


def test_a_refused_submit_whose_caller_left_is_forgotten_and_ends_its_watchers(model_dir):
    with start_server(model_dir) as srv:
        with Client(srv.target, timeout=30) as c:
            bad_token = c.info().model.vocab_size + 5
            watcher_frames: list = []
            cancel_result: dict = {}
            found = spy_on(srv.server.front, "find")
            cancels = spy_on(srv.server.front, "cancel")
            with worker_paused(c):
                with pytest.raises(DeadlineExceeded):  # the caller leaves before the answer
                    c.submit([1, bad_token], max_new_tokens=4, request_id="x", timeout=0.5)
                # the front still waits for the worker's answer; others watch "x" meanwhile
                watcher = c.session(timeout=20)
                watcher.subscribe("x")
                watcher.close()
                reader = read_all(watcher, watcher_frames)
                canceller = threading.Thread(target=lambda: cancel_result.update(r=c.cancel("x")))
                canceller.start()
                # both reached the front before the worker answers
                wait_until(lambda: ("x",) in found and cancels)
                c.health()  # a round trip through the front's loop: what they started is done
            resumed = time.monotonic()
            reader.join(10)
            canceller.join(10)
            # the watcher learns the request's end at once: a final ERROR event naming the cause
            events = [f.event for f in watcher_frames[:-1] if f.WhichOneof("frame") == "event"]
            assert watcher_frames[-1] == "END" and len(events) == 1, watcher_frames
            assert events[0].finished and events[0].finish_reason == pb.FINISH_REASON_ERROR
            assert "outside" in events[0].error
            assert cancel_result["r"] == {"x": False}
            assert time.monotonic() - resumed < 4.0  # neither waited for a timeout (Cancel's is 5 s)
            # and the front forgot it: nothing unfinished, the id is free again
            wait_until(lambda: c.info().num_unfinished == 0, timeout=5)
            result = c.generate([1, 2, 3], max_new_tokens=3, request_id="x")
            assert len(result.token_ids) == 3
            info = c.info()
            assert info.num_unfinished == 0 and info.pages.used == 0


def test_subscribing_ahead_of_a_request_that_ends_shorter_is_refused_in_band(model_dir):
    with start_server(model_dir) as srv:
        with Client(srv.target, timeout=30) as c:
            frames: list = []
            submits = spy_on(srv.server.front, "submit")
            found = spy_on(srv.server.front, "find")
            with worker_paused(c):  # the request is known to the front, not yet run
                submitter = threading.Thread(target=lambda: c.submit([1, 2, 3], max_new_tokens=5, request_id="r"))
                submitter.start()
                wait_until(lambda: submits)  # the front knows "r" now
                session = c.session(timeout=20)
                session.subscribe("r", from_seq=100)  # beyond what it will ever produce
                session.close()
                reader = read_all(session, frames)
                wait_until(lambda: ("r",) in found)  # the subscription reached the front
                c.health()  # a round trip through the front's loop: what it started is done
            reader.join(10)
            submitter.join(10)
            assert frames[-1] == "END", frames
            errors = [f.error for f in frames[:-1] if f.WhichOneof("frame") == "error"]
            assert [f.WhichOneof("frame") for f in frames[:-1]] == ["error"]
            assert errors[0].code == INVALID_ARGUMENT and errors[0].field == "from_seq"
            assert "past the end (5)" in errors[0].message


def test_a_late_subscription_to_a_request_lost_with_the_worker_ends_only_that_request(model_dir):
    with start_server(model_dir, restart_backoff_s=0.2) as srv:
        with Client(srv.target, timeout=60) as c:
            old_pid = c.info().worker.pid
            lost = c.stream([1, 2, 3], max_new_tokens=6000, ignore_eos=True, request_id="lost")
            produced = len(next(lost).token_ids)
            os.kill(old_pid, signal.SIGKILL)
            with pytest.raises(QilError):  # a live stream learns of the death as UNAVAILABLE
                list(lost)
            wait_until(lambda: c.health() == "SERVING" and c.info().worker.pid != old_pid, timeout=60)

            frames: list = []
            session = c.session(timeout=60)
            session.submit([5, 6, 7], max_new_tokens=500, ignore_eos=True, request_id="mine")
            reader = read_all(session, frames)
            wait_until(lambda: has_event(frames))
            session.subscribe("lost")
            session.close()
            reader.join(30)
            assert frames[-1] == "END", frames[-1]
            events = [f.event for f in frames[:-1] if f.WhichOneof("frame") == "event"]
            lost_events = [e for e in events if e.request_id == "lost"]
            assert lost_events[-1].finished and lost_events[-1].finish_reason == pb.FINISH_REASON_ERROR
            assert "worker process died" in lost_events[-1].error
            assert sum(len(e.token_ids) for e in lost_events) >= produced  # its tokens replayed
            mine = [e for e in events if e.request_id == "mine"]
            assert mine[-1].finish_reason == pb.FINISH_REASON_LENGTH and mine[-1].num_output_tokens == 500


def test_a_drain_refuses_a_session_submit_in_band_and_lets_the_session_finish(model_dir):
    srv = start_server(model_dir, grace_seconds=60)
    stopper = threading.Thread(target=srv.stop)
    try:
        with Client(srv.target, timeout=60) as c:
            frames: list = []
            session = c.session(timeout=60)
            session.submit([1, 2, 3], max_new_tokens=3000, ignore_eos=True, request_id="running")
            reader = read_all(session, frames)
            wait_until(lambda: has_event(frames))
            stopper.start()  # as on SIGTERM: stop accepting, let running requests finish
            wait_until(lambda: c.health() == "NOT_SERVING", timeout=10)
            session.submit([4, 5], max_new_tokens=4, request_id="late")
            session.close()
            reader.join(60)
        assert frames[-1] == "END", frames[-1]
        errors = [f.error for f in frames[:-1] if f.WhichOneof("frame") == "error"]
        assert [(e.request_id, e.code) for e in errors] == [("late", UNAVAILABLE)]
        finals = [f.event for f in frames[:-1] if f.WhichOneof("frame") == "event" and f.event.finished]
        assert [(e.request_id, e.finish_reason, e.num_output_tokens) for e in finals] == [
            ("running", pb.FINISH_REASON_LENGTH, 3000)
        ]
    finally:
        if stopper.ident is None:
            srv.stop()
        else:
            stopper.join(120)


def test_a_prompt_beyond_the_models_positions_is_refused_by_the_front(model_dir):
    """The front knows the model's positions: such a prompt never reaches the worker (millions
    of ids took it seconds to receive), with the answer the engine would give."""
    with start_server(model_dir) as srv:
        with Client(srv.target, timeout=30) as c:
            with worker_paused(c):  # a prompt sent on to the worker would time out here
                with pytest.raises(InvalidArgument) as info:
                    c.submit([1] * MAX_POSITIONS, max_new_tokens=1, timeout=5)
            assert info.value.field == "token_ids"  # the prompt alone leaves no room for a token
            assert f"= {MAX_POSITIONS + 1} exceeds the model's {MAX_POSITIONS} positions" in str(info.value)
            assert c.info().num_unfinished == 0


def test_subscribe_at_the_exact_end_of_a_finished_request_gets_its_final_event(server):
    with Client(server.target, timeout=30) as c:
        c.generate([1, 2, 3], max_new_tokens=5, request_id="at-end")
        evs = list(c.events("at-end", from_seq=5))
        assert len(evs) == 1 and evs[0].finished and not evs[0].token_ids and evs[0].seq == 5


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
