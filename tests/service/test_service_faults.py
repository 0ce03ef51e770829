"""Worker death: in-flight calls end with UNAVAILABLE, health goes NOT_SERVING, a new worker takes
over (within the restart bounds); a worker whose front dies exits on its own; faults in a step;
shutdown and its grace period; and clients that read slowly or not at all (the stream backlog)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from qil_client import Client, NotFound, QilError, Unavailable, pb
from qil_client._proto.qil.v1 import inference_pb2_grpc as pb_grpc
from service_fixtures import (
    ENGINE,
    free_port,
    reference_outputs,
    SMALL_WINDOW,
    scrape,
    spy_on,
    start_server,
    wait_until,
)

LONG = 6000
ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def _children() -> set[int]:
    """This process's child processes, exited ones not yet reaped included."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.add(int(entry))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                pass
    return found


def test_sigkill_worker_mid_stream_then_recover(model_dir):
    with start_server(model_dir, restart_backoff_s=0.5) as srv:
        with Client(srv.target, timeout=60) as c:
            info = c.info()
            pid = info.worker.pid
            assert info.worker.restarts == 0
            stream = c.stream([1, 2, 3], max_new_tokens=LONG)
            assert next(stream).token_ids
            session = c.session()
            session.submit([4, 5], max_new_tokens=LONG, request_id="sess-victim")
            it = iter(session)
            assert next(it).WhichOneof("frame") == "submitted"
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(Unavailable):
                for _ in stream:
                    pass
            with pytest.raises(Unavailable):
                for _ in it:
                    pass
            assert time.monotonic() - t0 < 5
            assert c.health() == "NOT_SERVING"
            with pytest.raises(Unavailable):
                c.submit([1, 2], max_new_tokens=2)
            wait_until(lambda: c.health() == "SERVING", timeout=60, interval=0.1)
            info = c.info()
            assert info.worker.restarts == 1 and info.worker.pid not in (0, pid)
            assert info.pages.used == 0 and info.num_unfinished == 0
            r = c.generate([1, 2, 3], max_new_tokens=5)
            assert r.finish_reason == "length" and len(r.token_ids) == 5
            assert not _alive(pid)


def test_worker_exits_when_its_front_dies(tmp_path):
    env = dict(os.environ, QIL_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    front = subprocess.Popen(
        [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "qil serving on" not in line and time.monotonic() < deadline:
            line = front.stdout.readline()
            assert line or front.poll() is None, "server exited"
        target = line.split("qil serving on ")[1].split()[0]
        with Client(target) as c:
            worker_pid = c.info().worker.pid
        assert _alive(worker_pid)
        front.kill()
        front.wait(10)
        wait_until(lambda: not _alive(worker_pid), timeout=10, interval=0.1)
    finally:
        if front.poll() is None:
            front.kill()


def test_a_process_that_exits_without_stopping_its_server_does_not_hang(model_dir):
    """The worker ignores SIGTERM (the front owns shutdown), so multiprocessing's exit-time
    SIGTERM-and-join would wait forever for a server that was never stopped: the front kills
    its live workers at exit first."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from service_fixtures import start_server\n"
        "srv = start_server(sys.argv[1])\n"
        "print(srv.server.front.worker_pid, flush=True)\n"  # and exit without srv.stop()
    )
    tests_dir = str(Path(__file__).resolve().parents[1] / "helpers")
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(model_dir), tests_dir], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
    )
    try:
        worker_pid = int(proc.stdout.readline())
        assert proc.wait(30) == 0
        wait_until(lambda: not _alive(worker_pid), timeout=10, interval=0.1)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_restarts_are_bounded(model_dir):
    with start_server(model_dir, max_restarts=0) as srv:
        with Client(srv.target, timeout=30) as c:
            pid = c.info().worker.pid
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: c.info().worker.state == pb.WORKER_STATE_FAILED, timeout=15)
            assert c.health() == "NOT_SERVING"
            with pytest.raises(Unavailable):
                c.generate([1, 2], max_new_tokens=2)
            assert c.info().worker.restarts == 0


def test_a_worker_that_dies_at_every_start_ends_failed_and_stays_failed(model_dir, tmp_path):
    """A worker that served a while, then dies and cannot start again (its weights are gone):
    the front gives up after --max-restarts attempts and stays FAILED. (A failed start's late
    exit must not count as one more death, which would start the whole back-off again, forever.)"""
    import shutil

    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    with start_server(broken, max_restarts=2, restart_backoff_s=0.05, stable_after_s=0.2) as srv:
        with Client(srv.target, timeout=30) as c:
            # Time itself is the condition here: a worker that ran longer than stable_after_s
            # before it died is not part of a crash loop.
            time.sleep(0.5)
            (broken / "model.safetensors").unlink()
            fds = len(os.listdir("/proc/self/fd"))
            pid = c.info().worker.pid
            others = _children() - {pid}  # e.g. multiprocessing's resource tracker
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: c.info().worker.state == pb.WORKER_STATE_FAILED, timeout=60)
            # the failed starts' exits have all arrived: their processes are reaped and the
            # pipes closed (the pipe of the live server's worker too); then nothing may change
            wait_until(lambda: _children() <= others and len(os.listdir("/proc/self/fd")) <= fds,
                       timeout=30, interval=0.1)
            info = c.info()
            assert info.worker.state == pb.WORKER_STATE_FAILED and info.worker.restarts == 2
            assert c.health() == "NOT_SERVING"
            # the failed starts' pipes are closed (the pipe of the live server's worker too)
            assert len(os.listdir("/proc/self/fd")) <= fds


def test_sigkill_worker_during_prefill_and_decode(model_dir):
    """One request in prefill (a long prompt in small chunks) and several decoding when the worker
    is killed: every call ends UNAVAILABLE at once, the worker comes back, tokens are right."""
    engine = dict(ENGINE, token_budget=64, prefill_chunk=32)
    port = free_port()
    with start_server(model_dir, engine=engine, restart_backoff_s=0.2, metrics_port=port) as srv:
        with Client(srv.target, timeout=60) as c:
            pid = c.info().worker.pid
            prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
            streams, first = [], []
            for p in prompts:
                s = c.stream(p, max_new_tokens=LONG, ignore_eos=True)
                first.append(list(next(s).token_ids))  # decoding now
                streams.append(s)
            session = c.session()
            long_prompt = [(i * 7) % 90 + 1 for i in range(4000)]  # 125 prefill chunks
            session.submit(long_prompt, max_new_tokens=4, request_id="in-prefill")
            it = iter(session)
            assert next(it).WhichOneof("frame") == "submitted"
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            prefill_frames = []
            with pytest.raises(Unavailable):
                for resp in it:
                    prefill_frames.append(resp)
            # killed during its prefill: not one token came out
            assert not any(f.WhichOneof("frame") == "event" and f.event.token_ids for f in prefill_frames)
            for s in streams:
                with pytest.raises(Unavailable):
                    for _ in s:
                        pass
            assert time.monotonic() - t0 < 5
            assert c.health() == "NOT_SERVING"
            wait_until(lambda: c.health() == "SERVING", timeout=60, interval=0.1)
            info = c.info()
            assert info.worker.restarts == 1 and info.worker.pid != pid
            assert info.pages.used == 0 and info.num_unfinished == 0
            ref = reference_outputs(model_dir, [prompts[0]], 8, engine=engine)[0]
            r = c.generate(prompts[0], max_new_tokens=8, ignore_eos=True)
            assert list(r.token_ids) == ref and ref[: len(first[0])] == first[0]
            r = c.generate(long_prompt, max_new_tokens=4, ignore_eos=True)
            assert r.finish_reason == "length" and r.num_prompt_tokens == 4000
            m = scrape(port)
            assert m["qil_worker_restarts_total"] == 1
            assert m['qil_requests_finished_total{reason="error"}'] == 4  # the 4 lost requests
            assert m['qil_requests_finished_total{reason="length"}'] == 2
    assert not _alive(pid)


def test_exception_in_forward_fails_that_step_only(model_dir, monkeypatch):
    """QIL_TEST_FAULT_FORWARD (test-only, environment only) makes one forward call raise: the
    request in that step ends with an in-band error, the waiting one runs on, no page leaks,
    and later tokens are right."""
    from qil_worker.service.worker.startup import FAULT_FORWARD_ENV

    engine = dict(ENGINE, max_active=1)  # B waits while A runs: A alone is in the failing step
    fault_at = 300
    monkeypatch.setenv(FAULT_FORWARD_ENV, str(fault_at))
    srv = start_server(model_dir, engine=engine)
    monkeypatch.delenv(FAULT_FORWARD_ENV)
    try:
        with Client(srv.target, timeout=60) as c:
            a_prompt, b_prompt = [3, 1, 4, 1, 5], [2, 7, 1, 8]
            a = c.stream(a_prompt, max_new_tokens=1000, ignore_eos=True, request_id="fault-a")
            a_events = [next(a)]
            b_result = {}
            b = threading.Thread(
                target=lambda: b_result.setdefault(
                    "r", c.generate(b_prompt, max_new_tokens=20, ignore_eos=True, request_id="fault-b")
                )
            )
            b.start()
            a_events.extend(a)
            b.join(60)
            last = a_events[-1]
            assert last.finished and last.finish_reason == pb.FINISH_REASON_ERROR
            assert "injected fault" in last.error and "step failed" in last.error
            a_tokens = [t for ev in a_events for t in ev.token_ids]
            assert len(a_tokens) == fault_at - 1  # one token per forward until the failing one
            rb = b_result["r"]
            assert rb.finish_reason == "length" and rb.error is None
            ref_a, ref_b = reference_outputs(model_dir, [a_prompt, b_prompt], fault_at - 1, engine=engine)
            assert a_tokens == ref_a
            assert list(rb.token_ids) == ref_b[:20]
            info = c.info()
            assert info.pages.used == 0 and info.num_unfinished == 0 and info.worker.restarts == 0
            assert c.health() == "SERVING"
            r = c.generate(a_prompt, max_new_tokens=30, ignore_eos=True)
            assert r.finish_reason == "length" and list(r.token_ids) == ref_a[:30]
    finally:
        srv.stop()


def test_a_sticky_device_error_replaces_the_worker(model_dir, monkeypatch):
    """A step that leaves the device unusable (CUDA's illegal memory access, injected here as
    the AcceleratorError torch raises) ends every request in the worker with that error, and the
    worker exits to be replaced: the server serves again instead of failing every step."""
    from qil_worker.service.worker.startup import FAULT_FORWARD_ENV

    monkeypatch.setenv(FAULT_FORWARD_ENV, "20:1:device")
    srv = start_server(model_dir, engine=dict(ENGINE, max_active=1), restart_backoff_s=0.2)
    monkeypatch.delenv(FAULT_FORWARD_ENV)  # the replacement worker runs clean
    try:
        with Client(srv.target, timeout=60) as c:
            pid = c.info().worker.pid
            running = c.stream([3, 1, 4], max_new_tokens=LONG, ignore_eos=True, request_id="dev-a")
            events = [next(running)]
            waiting = c.session()
            waiting.submit([2, 7], max_new_tokens=5, request_id="dev-b")  # queued behind dev-a
            frames = iter(waiting)
            assert next(frames).WhichOneof("frame") == "submitted"
            events.extend(running)
            assert events[-1].finish_reason == pb.FINISH_REASON_ERROR
            assert "illegal memory access" in events[-1].error
            waiting.close()  # half-close: the call ends once dev-b has ended
            last = [f for f in frames if f.WhichOneof("frame") == "event"][-1].event
            assert last.finished and last.finish_reason == pb.FINISH_REASON_ERROR
            assert "illegal memory access" in last.error
            wait_until(lambda: c.info().worker.restarts == 1 and c.health() == "SERVING", timeout=60)
            info = c.info()
            assert info.worker.pid not in (0, pid) and info.num_unfinished == 0
            r = c.generate([2, 7], max_new_tokens=5, ignore_eos=True)
            assert r.finish_reason == "length" and len(r.token_ids) == 5
    finally:
        srv.stop()


def test_fault_hook_is_off_by_default():
    from qil_worker.service.worker.startup import FAULT_FORWARD_ENV, _install_forward_fault

    class M:
        def forward(self, x):
            return x + 1

    m = M()
    _install_forward_fault(m, os.environ.get(FAULT_FORWARD_ENV))  # unset in the test run
    assert FAULT_FORWARD_ENV not in os.environ and "forward" not in vars(m)
    _install_forward_fault(m, "2:2")
    assert [m.forward(1)] == [2]
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected fault"):
            m.forward(1)
    assert m.forward(1) == 2


def test_a_client_that_stops_reading_is_cut_off_and_others_keep_streaming(model_dir):
    """A Generate call and a StreamEvents call whose clients never read: once their backlog passes
    --max-stream-backlog (with a write stuck), they end RESOURCE_EXHAUSTED and their requests
    are cancelled (pages free), while a normal stream keeps its pace."""
    port = free_port()
    srv = start_server(model_dir, max_stream_backlog=64, metrics_port=port)
    # a small HTTP/2 window, so the server's writes to the non-reading calls block early
    slow_channel = grpc.insecure_channel(srv.target, options=SMALL_WINDOW)
    try:
        stub = pb_grpc.InferenceStub(slow_channel)
        slow_gen = stub.Generate(
            pb.SubmitRequest(token_ids=[1, 2, 3], max_new_tokens=LONG, ignore_eos=True,
                             request_id="slow-gen"),
            timeout=120,
        )
        frame = pb.StreamEventsRequest(submit=pb.SubmitRequest(
            token_ids=[4, 5, 6], max_new_tokens=LONG, ignore_eos=True, request_id="slow-sess"))
        half_closed = threading.Event()

        def frames():
            yield frame
            half_closed.wait(120)

        slow_sess = stub.StreamEvents(frames(), timeout=120)
        with Client(srv.target, timeout=60) as c:
            wait_until(lambda: c.info().num_unfinished == 2, timeout=10)
            gaps, n, last = [], 0, time.monotonic()
            for ev in c.stream([7, 8, 9], max_new_tokens=400, ignore_eos=True, request_id="reader"):
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                n += len(ev.token_ids)
                if ev.finished:
                    assert ev.finish_reason == pb.FINISH_REASON_LENGTH
            assert n == 400
            gaps.sort()
            assert gaps[len(gaps) // 2] < 0.2 and gaps[-1] < 3.0, gaps[-5:]
            # both slow calls cut off without their clients reading: their pages are free
            wait_until(lambda: c.info().num_unfinished == 0 and c.info().pages.used == 0, timeout=30)
            got = 0
            with pytest.raises(grpc.RpcError) as exc:
                for ev in slow_gen:
                    got += len(ev.token_ids)
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "behind" in exc.value.details()
            assert 0 < got < LONG
            with pytest.raises(grpc.RpcError) as exc:
                for _ in slow_sess:
                    pass
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert scrape(port)["qil_streams_backlog_exceeded_total"] == 2
            assert scrape(port)['qil_requests_finished_total{reason="cancelled"}'] == 2
            # the server goes on serving
            assert c.generate([1, 2, 3], max_new_tokens=5).num_output_tokens == 5
    finally:
        half_closed.set()
        slow_channel.close()
        srv.stop()


@pytest.mark.parametrize("to", ["front", "process group"])
def test_sigterm_lets_in_flight_requests_finish_then_exits_0(model_dir, tmp_path, to):
    """SIGTERM to the front, or to the whole process group (systemd's stop, ``kill -TERM
    -PGID``): the worker must not die of it before the front drains."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", QIL_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("QIL_AUTH_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--threads", "1",
         "--model", str(model_dir), "--grace-seconds", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        start_new_session=True,
    )
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "qil serving on" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "server exited:\n" + "".join(err)
        target = line.split("qil serving on ")[1].split()[0]
        with Client(target, timeout=60) as c:
            streams = [c.stream([i + 1, 2, 3], max_new_tokens=300, ignore_eos=True) for i in range(3)]
            for s in streams:
                assert next(s).token_ids
            if to == "front":
                proc.send_signal(signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGTERM)
            wait_until(lambda: c.health() == "NOT_SERVING", timeout=5)
            with pytest.raises(Unavailable):
                c.submit([1, 2], max_new_tokens=2)
            for s in streams:
                events = list(s)
                assert events[-1].finished and events[-1].finish_reason == pb.FINISH_REASON_LENGTH
                assert events[-1].num_output_tokens == 300
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_while_the_model_loads_stops_front_and_worker(model_dir, tmp_path):
    """Stopped before the worker is ready (a large model loads for minutes): the front stops
    the loading worker and exits 0 instead of dying and leaving it behind."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", QIL_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("QIL_AUTH_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--threads", "1",
         "--model", str(model_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    worker_pid = None
    try:
        for line in proc.stderr:  # the front logs the spawn at once; the worker then loads
            if "worker 1 started (pid " in line:
                worker_pid = int(line.split("(pid ")[1].split(")")[0])
                break
        assert worker_pid is not None
        os.kill(worker_pid, signal.SIGSTOP)  # a load that takes as long as the test needs
        # the front logs the spawn just before it waits for the worker to be ready, and its
        # SIGTERM handler is installed before it spawns: no wait needed here
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not any("qil serving on" in line for line in out)
        wait_until(lambda: not _alive(worker_pid), timeout=10)
        rest = proc.stderr.read()  # a routine stop: no error lines, no restart
        assert "ERROR" not in rest and "restarting worker" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()
        if worker_pid is not None and _alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def _paused_then_killed(srv, c, action, reaches: str):
    """Run ``action`` in a thread while the worker is stopped; once its call has reached the
    front (``front.<reaches>`` was called), SIGKILL the worker."""
    reached = spy_on(srv.server.front, reaches)  # this server is the test's own
    pid = c.info().worker.pid
    out = {}
    def run():
        try:
            out["value"] = action()
        except QilError as exc:
            out["error"] = exc
    os.kill(pid, signal.SIGSTOP)
    t = threading.Thread(target=run); t.start()
    wait_until(lambda: reached, timeout=20)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(30)
    return out, time.monotonic() - t0


def test_cancel_in_flight_when_the_worker_dies_reports_was_active(model_dir):
    with start_server(model_dir, restart_backoff_s=0.2) as srv:
        with Client(srv.target, timeout=30) as c:
            rid = c.submit([1, 2, 3], max_new_tokens=6000, ignore_eos=True, request_id="victim")
            out, _ = _paused_then_killed(srv, c, lambda: c.cancel(rid), "cancel")
            assert out.get("value") == {rid: True}, out


def test_submit_in_flight_when_the_worker_dies_is_unavailable_at_once(model_dir):
    with start_server(model_dir, restart_backoff_s=0.2) as srv:
        with Client(srv.target, timeout=30) as c:
            out, waited = _paused_then_killed(
                srv, c, lambda: c.submit([1, 2, 3], max_new_tokens=4, request_id="pending", timeout=20),
                "submit")
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


def test_stats_reset_when_the_worker_is_gone(model_dir):
    with start_server(model_dir, max_restarts=0) as srv:
        with Client(srv.target, timeout=30) as c:
            c.submit([1, 2, 3], max_new_tokens=6000, ignore_eos=True)
            wait_until(lambda: c.info().pages.used > 0 and c.info().num_running == 1)
            os.kill(c.info().worker.pid, signal.SIGKILL)
            wait_until(lambda: c.info().worker.state == pb.WORKER_STATE_FAILED, timeout=15)
            info = c.info()
            assert info.pages.used == 0 and info.num_running == 0 and info.pages.free == info.pages.total


def test_the_worker_exits_on_stop_without_being_killed(model_dir):
    srv = start_server(model_dir)
    pid = srv.server.front.worker_pid
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 8
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_reader_paused_briefly_is_not_cut_off(model_dir):
    srv = start_server(model_dir, max_stream_backlog=16)
    ch = grpc.insecure_channel(srv.target, options=SMALL_WINDOW)
    try:
        call = pb_grpc.InferenceStub(ch).Generate(
            pb.SubmitRequest(token_ids=[1, 2, 3], max_new_tokens=1500, ignore_eos=True), timeout=60)
        n = 0
        for i, ev in enumerate(call):
            n += len(ev.token_ids)
            if i == 3:
                # the behaviour under test: a busy client that really pauses, far under
                # limits.STREAM_STALL_S (1 s)
                time.sleep(0.3)
        assert n == 1500
    finally:
        ch.close()
        srv.stop()


def test_backlog_counts_from_what_was_written_not_from_zero(model_dir, monkeypatch):
    from qil_worker.service.front import limits
    monkeypatch.setattr(limits, "STREAM_STALL_S", 0.2)
    srv = start_server(model_dir, max_stream_backlog=1500)
    ch = grpc.insecure_channel(srv.target, options=SMALL_WINDOW)
    try:
        call = pb_grpc.InferenceStub(ch).Generate(
            pb.SubmitRequest(token_ids=[1, 2, 3], max_new_tokens=4000, ignore_eos=True), timeout=60)
        n, paused = 0, False
        for ev in call:
            n += len(ev.token_ids)
            if n >= 2000 and not paused:
                paused = True
                # the behaviour under test: a reader that really stalls longer than
                # STREAM_STALL_S, but falls far less than 1500 tokens behind
                time.sleep(0.4)
        assert n == 4000
    finally:
        ch.close()
        srv.stop()


def test_a_session_that_falls_behind_does_not_cancel_requests_it_only_watches(model_dir):
    port = free_port()
    srv = start_server(model_dir, max_stream_backlog=64, metrics_port=port)
    ch = grpc.insecure_channel(srv.target, options=SMALL_WINDOW)
    done = threading.Event()
    try:
        with Client(srv.target, timeout=60) as c:
            rid = c.submit([1, 2, 3], max_new_tokens=4000, ignore_eos=True, request_id="watched")

            def frames():
                yield pb.StreamEventsRequest(subscribe=pb.Subscribe(request_id=rid))
                done.wait(60)

            sess = pb_grpc.InferenceStub(ch).StreamEvents(frames(), timeout=60)
            # the session never reads: it is cut off
            wait_until(lambda: scrape(port).get("qil_streams_backlog_exceeded_total") == 1, timeout=30)
            with pytest.raises(grpc.RpcError) as exc:
                for _ in sess:
                    pass
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert c.result(rid).finish_reason == "length"  # the watched request ran on
    finally:
        done.set()
        ch.close()
        srv.stop()
