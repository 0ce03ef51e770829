"""Prompts of megabytes that cannot fit, against a real server (front and worker processes): each
is refused in well under a second, the front's and the worker's memory return to their level
before, and a stream running meanwhile keeps its pace.

The pace: every gap within twice the stream's own median is what the issue asks; on this
2-core machine, shared by the server, the stream's reader and the process sending 10 MiB
messages, single gaps of 100-650 ms still occur while a message is serialized, received and
parsed (docs/performance.md), on main as here, so a bound on every gap (or on the median of the
~0.5 s the prompts take) would be flaky. The test bounds what the prompts cost the stream
instead: its delay beyond twice its median gap, summed over the gaps while they arrive, per
prompt — under 0.5 s here (typically 0.05-0.15 s), ~4 s on main, where each prompt was
tokenized for ~20 s beside the steps.
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

# the stream's summed delay beyond twice its median gap, per prompt (see the module docstring)
EXCESS_PER_PROMPT_S = 0.5
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
            assert float(seconds) < 1.0, line  # main: ~10 s of tokenizing each
            assert message.startswith("INVALID_ARGUMENT: max_new_tokens: prompt (at least "), message
            assert message.endswith("exceeds the model's 2048 positions"), message
        quiet, during = gaps[: marks[0]], gaps[marks[0]: marks[1]]
        assert during, "the stream made no progress while the prompts were refused"
        # the stream's delay beyond twice its own median gap, summed over the gaps while the
        # prompts arrived, per prompt (main: ~4 s a prompt, each tokenized for ~20 s)
        limit = 2 * statistics.median(quiet)
        excess = sum(max(0.0, gap - limit) for gap in during) / HOSTILE
        assert excess < EXCESS_PER_PROMPT_S, (excess, limit, max(during))
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
