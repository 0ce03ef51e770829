"""Worker death: in-flight calls end with UNAVAILABLE, health goes NOT_SERVING, a new worker takes
over; and a worker whose front dies exits on its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qil_client import Client, Unavailable
from service_fixtures import make_service_checkpoint, start_server, wait_until

LONG = 6000


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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_service_checkpoint(tmp_path_factory.mktemp("svc-fault-model"))


def test_sigkill_worker_mid_stream_then_recover(model_dir):
    srv = start_server(model_dir, restart_backoff_s=0.5)
    try:
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
    finally:
        srv.stop()


def test_worker_exits_when_its_front_dies(tmp_path):
    env = dict(os.environ, QIL_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    front = subprocess.Popen(
        [sys.executable, "-m", "qil_worker", "serve", "--port", "0", "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        cwd=Path(__file__).resolve().parent.parent,
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


def test_restarts_are_bounded(model_dir):
    from qil_client import pb

    srv = start_server(model_dir, max_restarts=0)
    try:
        with Client(srv.target, timeout=30) as c:
            pid = c.info().worker.pid
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: c.info().worker.state == pb.WORKER_STATE_FAILED, timeout=15)
            assert c.health() == "NOT_SERVING"
            with pytest.raises(Unavailable):
                c.generate([1, 2], max_new_tokens=2)
            assert c.info().worker.restarts == 0
    finally:
        srv.stop()
