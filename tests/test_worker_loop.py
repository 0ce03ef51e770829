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


class _BlockingTokenizer:
    """A tokenizer whose ``encode`` waits for a signal: a prompt that takes long to tokenize."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.release = threading.Event()

    def encode(self, *args, **kwargs):
        assert self.release.wait(30)
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _until_final(conn, rid: str, seen: list) -> None:
    """Read batches (keeping acks and events in ``seen``) until ``rid`` has its final event."""
    while True:
        assert conn.poll(30), "the worker stopped answering"
        tag, acks, events, *_ = conn.recv()
        assert tag == P.BATCH
        seen.extend(("ack", rid_, error) for rid_, error, _ in acks)
        seen.extend(("event", ev[0], ev[3]) for ev in events)
        if any(ev[0] == rid and ev[3] for ev in events):
            return


def test_a_long_text_prompt_is_tokenized_beside_the_step_loop(tmp_path, monkeypatch):
    """A prompt that takes long to tokenize (megabytes of text) no longer stalls the loop: other
    requests run to their end meanwhile, and a cancel that comes first still ends it."""
    from checkpoints import make_text_checkpoint
    from qil_worker import Qwen3
    from qil_worker.service import prompt_encoder
    from qil_worker.text import load_tokenizer

    monkeypatch.setattr(prompt_encoder, "INLINE_CHARS", 5)  # "hello there" counts as long

    model_dir = make_text_checkpoint(tmp_path / "text")
    tokenizer = _BlockingTokenizer(load_tokenizer(model_dir))
    engine = Engine(Qwen3.from_directory(model_dir), num_pages=64, page_size=4, tokenizer=tokenizer)
    front, back = multiprocessing.Pipe()
    loop = threading.Thread(target=worker._serve, args=(back, engine, os.getppid()), daemon=True)
    loop.start()
    front.send((P.SUBMIT, "slow", None, 4, [], {"text": "hello there"}))
    front.send((P.SUBMIT, "fast", [1, 2, 3], 4, [], {"ignore_eos": True}))
    seen: list = []
    _until_final(front, "fast", seen)
    assert ("ack", "fast", None) in seen and not any(rid == "slow" for _, rid, _ in seen)
    front.send((P.CANCEL, "slow"))
    tokenizer.release.set()
    _until_final(front, "slow", seen)
    assert ("ack", "slow", None) in seen  # submitted once encoded ...
    assert ("event", "slow", P.FINISH_CODES["cancelled"]) in seen  # ... and cancelled at once
    front.send((P.SUBMIT, "bad", None, 4, [], {"messages": [{"role": "robot", "content": "a long one"}]}))
    while True:  # an encoding error is the submit's answer, as before
        assert front.poll(30)
        acks = front.recv()[1]
        if acks:
            break
    ((rid, error, _),) = acks
    assert rid == "bad" and error[1] == "messages[0]"
    front.send((P.STOP,))
    loop.join(10)
    assert not loop.is_alive()
    assert engine.stats().num_pages_used == 0
