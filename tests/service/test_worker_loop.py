"""The worker's step loop over a real pipe: a burst of submits that wakes an idle worker is
taken into one step; a busy worker never waits for more."""

import multiprocessing
import os
import queue
import threading

from qil_worker import Engine
from qil_worker.engine.spec import RequestSpec
from qil_worker.service import protocol as P
from qil_worker.service.worker import loop as worker


class _Received:
    """The worker's end of the pipe, telling the test each message the worker took."""

    def __init__(self, conn):
        self._conn = conn
        self.taken: queue.SimpleQueue = queue.SimpleQueue()

    def poll(self, timeout=0.0):
        return self._conn.poll(timeout)

    def recv(self):
        msg = self._conn.recv()
        self.taken.put(msg)
        return msg

    def send(self, msg):
        self._conn.send(msg)


def _run_loop(engine, monkeypatch, gap_s: float, window_s: float):
    monkeypatch.setattr(worker, "BURST_GAP_S", gap_s)
    monkeypatch.setattr(worker, "BURST_WINDOW_S", window_s)
    front, back = multiprocessing.Pipe()
    back = _Received(back)
    loop = threading.Thread(target=worker._serve, args=(back, engine, os.getppid()), daemon=True)
    loop.start()
    return front, back, loop


def _submit(conn, rid: str) -> None:
    conn.send(P.Submit(RequestSpec.of([1, 2, 3], 2, [], rid)))


def _first_step_acks(conn) -> list[str]:
    assert conn.poll(30)
    msg = conn.recv()
    assert isinstance(msg, P.StepBatch)
    return [ack.request_id for ack in msg.acks]


def _stop(conn, loop) -> None:
    conn.send(P.Stop())
    loop.join(10)
    assert not loop.is_alive()


def test_a_burst_waking_the_worker_shares_its_first_step(model, monkeypatch):
    # generous gaps so a slow CI machine cannot split the burst; the logic is the same at 2 ms
    engine = Engine(model, num_pages=64, page_size=4)
    front, back, loop = _run_loop(engine, monkeypatch, gap_s=0.5, window_s=5.0)
    for i in range(4):
        _submit(front, f"r{i}")
        # each submit arrives only once the woken worker took the one before, as separate RPCs
        assert back.taken.get(timeout=30).request_id == f"r{i}"
    assert _first_step_acks(front) == ["r0", "r1", "r2", "r3"]
    _stop(front, loop)


def test_without_the_burst_window_the_first_submit_steps_alone(model, monkeypatch):
    engine = Engine(model, num_pages=64, page_size=4)
    stepping = threading.Event()
    real_step = engine.step

    def step():
        stepping.set()
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    front, _, loop = _run_loop(engine, monkeypatch, gap_s=0.0, window_s=0.0)
    _submit(front, "a")
    assert stepping.wait(30)  # the worker started its first step without waiting for more
    _submit(front, "b")
    assert _first_step_acks(front) == ["a"]
    _stop(front, loop)


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
        batch = conn.recv()
        assert isinstance(batch, P.StepBatch)
        seen.extend(("ack", ack.request_id, ack.rejection) for ack in batch.acks)
        seen.extend(
            ("event", rid_, batch.finals[rid_].reason if rid_ in batch.finals else None)
            for rid_ in batch.request_ids
        )
        if rid in batch.finals:
            return


def test_a_long_text_prompt_is_tokenized_beside_the_step_loop(tmp_path, monkeypatch):
    """A prompt that takes long to tokenize (megabytes of text) does not stall the loop: other
    requests run to their end meanwhile, and a cancel that comes first still ends it."""
    from checkpoints import make_text_checkpoint
    from qil_worker import Qwen3
    from qil_worker.service.worker import prompt_encoder
    from qil_worker.text import load_tokenizer

    monkeypatch.setattr(prompt_encoder, "INLINE_CHARS", 5)  # "hello there" counts as long

    model_dir = make_text_checkpoint(tmp_path / "text")
    tokenizer = _BlockingTokenizer(load_tokenizer(model_dir))
    engine = Engine(Qwen3.from_directory(model_dir), num_pages=64, page_size=4, tokenizer=tokenizer)
    front, back = multiprocessing.Pipe()
    loop = threading.Thread(target=worker._serve, args=(back, engine, os.getppid()), daemon=True)
    loop.start()
    front.send(P.Submit(RequestSpec.of(None, 4, [], "slow", text="hello there")))
    front.send(P.Submit(RequestSpec.of([1, 2, 3], 4, [], "fast", ignore_eos=True)))
    seen: list = []
    _until_final(front, "fast", seen)
    assert ("ack", "fast", None) in seen and not any(rid == "slow" for _, rid, _ in seen)
    front.send(P.Cancel("slow"))
    tokenizer.release.set()
    _until_final(front, "slow", seen)
    assert ("ack", "slow", None) in seen  # submitted once encoded ...
    assert ("event", "slow", P.FinishReason.CANCELLED) in seen  # ... and cancelled at once
    front.send(P.Submit(RequestSpec.of(None, 4, [], "bad", messages=[{"role": "robot", "content": "a long one"}])))
    while True:  # an encoding error is the submit's answer, as before
        assert front.poll(30)
        acks = front.recv().acks
        if acks:
            break
    (ack,) = acks
    assert ack.request_id == "bad" and ack.rejection.field == "messages[0]"
    assert ack.rejection.kind is P.RejectKind.INVALID
    front.send(P.Stop())
    loop.join(10)
    assert not loop.is_alive()
    assert engine.stats().num_pages_used == 0


def test_every_step_sends_one_batch_with_the_pool_numbers_after_it(model, monkeypatch):
    """The front reads the page pool from the latest batch (there is no stats request): a step
    that only computes a prompt chunk, with no event, still reports the pages it took; the final
    record carries the request's counts and metrics."""
    engine = Engine(model, num_pages=64, page_size=4, token_budget=8, prefill_chunk=8)
    front, _, loop = _run_loop(engine, monkeypatch, gap_s=0.0, window_s=0.0)
    front.send(P.Submit(RequestSpec.of(list(range(1, 30)), 2, [], "long")))  # 29 prompt tokens: 4 chunks
    batches = []
    while not batches or "long" not in batches[-1].finals:
        assert front.poll(30), "the worker stopped answering"
        batches.append(front.recv())
    first = batches[0]
    assert [a.request_id for a in first.acks] == ["long"] and first.request_ids == []
    assert first.stats.pages_used == 2 and first.timing is not None  # 8 tokens in 4-token pages
    with_events = [b for b in batches if b.request_ids]
    assert len(batches) == 5 and with_events == batches[-2:]  # 3 chunks without events, 2 tokens
    assert all(b.request_ids == ["long"] and b.timing is not None for b in with_events)
    final = batches[-1].finals["long"]
    assert (final.reason, final.num_prompt_tokens, final.num_output_tokens) == (P.FinishReason.LENGTH, 29, 2)
    assert final.metrics.ttft_s is not None and final.metrics.e2e_s >= final.metrics.ttft_s
    assert batches[-1].stats.pages_used == 0 and batches[-1].stats.num_running == 0
    _stop(front, loop)


def test_a_constraint_is_compiled_beside_the_step_loop(tmp_path, monkeypatch):
    """A constraint whose compile takes long does not stall the loop: a free request and one
    whose constraint was compiled lately run to their end meanwhile; a cancel that comes first
    ends it once compiled; a long text prompt is encoded first, then its constraint compiled;
    the tables the worker builds before Ready are built before any constrained request."""
    from checkpoints import make_text_checkpoint
    from qil_worker import Qwen3
    from qil_worker.service.worker import prompt_encoder
    from qil_worker.text import load_tokenizer

    monkeypatch.setattr(prompt_encoder, "INLINE_CHARS", 5)  # "hello there" counts as long
    model_dir = make_text_checkpoint(tmp_path / "text")
    engine = Engine(Qwen3.from_directory(model_dir), num_pages=64, page_size=4, tokenizer=load_tokenizer(model_dir))
    release, compiling = threading.Event(), []
    compile_constraint = engine.compile_constraint

    def slow_compile(spec):  # the one compile this test holds up: a schema that takes long
        if spec.kind == "json_schema":
            compiling.append(spec)
            assert release.wait(30)
        return compile_constraint(spec)

    monkeypatch.setattr(engine, "compile_constraint", slow_compile)
    front, back = multiprocessing.Pipe()
    engine.grammars.warm()  # as the worker does before Ready
    loop = threading.Thread(target=worker._serve, args=(back, engine, os.getppid()), daemon=True)
    loop.start()
    seen: list = []
    front.send(P.Submit(RequestSpec.of([1, 2], 8, [], "choice", choice=["yes", "no"])))
    _until_final(front, "choice", seen)
    front.send(P.Submit(RequestSpec.of([1, 2], 4, [], "slow", json_schema='{"type":"object"}')))
    front.send(P.Submit(RequestSpec.of([1, 2, 3], 4, [], "fast", ignore_eos=True)))
    front.send(P.Submit(RequestSpec.of(None, 8, [], "again", text="hello there", choice=["yes", "no"])))
    for rid in ("fast", "again"):  # in either order
        if not any(kind == "event" and r == rid and reason for kind, r, reason in seen):
            _until_final(front, rid, seen)
    assert compiling and not any(rid == "slow" for _, rid, _ in seen)  # still compiling
    assert ("ack", "again", None) in seen  # encoded, then compiled lately: looked up in the loop
    front.send(P.Cancel("slow"))
    release.set()
    _until_final(front, "slow", seen)
    assert ("ack", "slow", None) in seen  # submitted once compiled ...
    assert ("event", "slow", P.FinishReason.CANCELLED) in seen  # ... and cancelled at once
    front.send(P.Submit(RequestSpec.of(None, 4, [], "bad", text="hello there", regex="([a-z")))
    while True:  # a compile error is the submit's answer
        assert front.poll(30)
        acks = front.recv().acks
        if acks:
            break
    (ack,) = acks
    assert ack.request_id == "bad" and ack.rejection.field == "regex"
    assert ack.rejection.kind is P.RejectKind.INVALID and "unclosed character class" in ack.rejection.message
    front.send(P.Stop())
    loop.join(10)
    assert not loop.is_alive()
    assert engine.stats().num_pages_used == 0
