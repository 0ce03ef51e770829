"""The worker's step loop over a real pipe: a burst of submits that wakes an idle worker is
taken into one step; a busy worker never waits for more."""

import multiprocessing
import os
import threading
import time

from qil_worker import Engine
from qil_worker.service import protocol as P
from qil_worker.service import worker


def _run_loop(model, monkeypatch, gap_s: float, window_s: float):
    monkeypatch.setattr(worker, "BURST_GAP_S", gap_s)
    monkeypatch.setattr(worker, "BURST_WINDOW_S", window_s)
    front, back = multiprocessing.Pipe()
    engine = Engine(model, num_pages=64, page_size=4)
    loop = threading.Thread(target=worker._serve, args=(back, engine, os.getppid()), daemon=True)
    loop.start()
    return front, loop


def _submit(conn, rid: str) -> None:
    conn.send((P.SUBMIT, rid, [1, 2, 3], 2, [], {}))


def _first_step_acks(conn) -> list[str]:
    assert conn.poll(30)
    msg = conn.recv()
    assert msg[0] == P.BATCH
    return [rid for rid, error, _ in msg[1]]


def test_a_burst_waking_the_worker_shares_its_first_step(model, monkeypatch):
    # generous gaps so a slow CI machine cannot split the burst; the logic is the same at 2 ms
    front, loop = _run_loop(model, monkeypatch, gap_s=0.5, window_s=5.0)
    for i in range(4):
        _submit(front, f"r{i}")
        time.sleep(0.05)  # spaced, as separate RPCs arrive
    assert _first_step_acks(front) == ["r0", "r1", "r2", "r3"]
    front.send((P.STOP,))
    loop.join(10)
    assert not loop.is_alive()


def test_without_the_burst_window_the_first_submit_steps_alone(model, monkeypatch):
    front, loop = _run_loop(model, monkeypatch, gap_s=0.0, window_s=0.0)
    _submit(front, "a")
    time.sleep(0.3)  # the worker has long started its first step
    _submit(front, "b")
    assert _first_step_acks(front) == ["a"]
    front.send((P.STOP,))
    loop.join(10)
    assert not loop.is_alive()
