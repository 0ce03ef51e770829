"""Prompts of megabytes that cannot fit, against a real server (front and worker processes): each
is refused in well under a second, the front's and the worker's memory return to their level
before, and a stream running meanwhile keeps its pace.

The pace is asserted on the stream's median gap while the prompts arrive (at most twice its own
median before): on this small shared machine single gaps of ~100 ms still occur while a 10 MiB
message is received and parsed (docs/performance.md), so a bound on every gap would be flaky;
today's main fails the median bound too (each prompt was tokenized for ~10 s beside the steps).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time

from qil_client import Client
from service_fixtures import serve_process, stop_server_process, wait_until

HOSTILE = 6  # 10 MiB prompts, one after another, from another process (its own GIL and cores)
HOSTILE_CLIENT = """
import sys, time
from qil_client import Client
c = Client(sys.argv[1])
text = 'word ' * (10 * 2**20 // 5)
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    try:
        c.generate(text=text, max_new_tokens=2)
        message = 'accepted'
    except Exception as exc:
        message = str(exc).replace(chr(10), ' ')
    print(f'{time.perf_counter() - t0:.3f} {message}', flush=True)
"""


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_huge_prompts_are_refused_fast_without_keeping_memory_or_stalling_streams():
    proc, target, _ = serve_process()
    try:
        client = Client(target)
        worker = client.info().worker.pid
        client.generate(text="hello world", max_new_tokens=8)
        front_before, worker_before = rss(proc.pid), rss(worker)
        gaps: list[float] = []
        hostile_started = threading.Event()
        marks: list[int] = []
        done = threading.Event()

        def stream() -> None:
            while not done.is_set():
                last = None
                for _ in client.stream(token_ids=[1, 2, 3], max_new_tokens=1500, ignore_eos=True):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if done.is_set():
                        return

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_until(lambda: len(gaps) >= 200, timeout=60)
        marks.append(len(gaps))
        out = subprocess.run(
            [sys.executable, "-c", HOSTILE_CLIENT, target, str(HOSTILE)],
            capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()),
        ).stdout.splitlines()
        marks.append(len(gaps))
        done.set()
        reader.join(60)

        assert len(out) == HOSTILE
        for line in out:
            seconds, message = line.split(" ", 1)
            assert "INVALID_ARGUMENT" in message and "max_new_tokens: prompt (at least" in message, message
            assert float(seconds) < 1.0, line
        quiet, during = gaps[: marks[0]], gaps[marks[0]: marks[1]]
        assert during, "the stream made no progress while the prompts were refused"
        # the stream's typical gap meanwhile, against its own before (today's main: 4x and more)
        assert statistics.median(during) <= 2 * statistics.median(quiet), (
            statistics.median(quiet), statistics.median(during))
        # the worker never held the prompts: its memory is where it was (main: +900 MB, kept)
        # the front let go of every message (main: +20 MB a prompt, kept); gRPC holds the last
        # call's state until the next call arrives, so the check calls on meanwhile
        def settled() -> bool:
            client.info()
            return rss(worker) <= 1.1 * worker_before and rss(proc.pid) <= 1.1 * front_before

        try:
            wait_until(settled, timeout=30, interval=0.2)
        except AssertionError:
            raise AssertionError(f"RSS front {front_before} -> {rss(proc.pid)}, worker {worker_before} -> {rss(worker)}")
    finally:
        stop_server_process(proc)
