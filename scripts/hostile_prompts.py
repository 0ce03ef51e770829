"""Hostile prompts against a real server: how fast prompts of megabytes that cannot fit are
refused, what they leave in the front's and the worker's memory, and what they do to a stream
running meanwhile.

    python scripts/hostile_prompts.py [--prompts 11] [--mib 10]

Starts ``python -m qil_worker serve`` (the demo model) as its own process, runs one stream of
1,500 tokens after another, and sends the prompts one after another from a second process (its
own GIL). Prints the refusals' times, the front's and worker's RSS (/proc/PID/statm) before,
right after and after a few ordinary calls, and the stream's inter-token gaps before and during.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from qil_client import Client  # noqa: E402
from service_fixtures import serve_process, stop_server_process, wait_until  # noqa: E402
from test_hostile_prompts import HOSTILE_CLIENT  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=11, help="how many prompts (default 11)")
    ap.add_argument("--mib", type=int, default=10, help="each prompt's size in MiB (default 10)")
    args = ap.parse_args()
    proc, target, _ = serve_process()
    try:
        client = Client(target)
        worker = client.info().worker.pid
        client.generate(text="hello world", max_new_tokens=8)
        before = rss_mib(proc.pid), rss_mib(worker)
        gaps: list[float] = []
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
        wait_until(lambda: len(gaps) >= 500, timeout=60)
        mark = len(gaps)
        code = HOSTILE_CLIENT.replace("10 * 2**20", f"{args.mib} * 2**20")
        out = subprocess.run([sys.executable, "-c", code, target, str(args.prompts)], capture_output=True,
                             text=True, env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout.splitlines()
        during = gaps[mark:]
        done.set()
        reader.join(60)
        right_after = rss_mib(proc.pid), rss_mib(worker)
        for _ in range(5):
            client.info()
            client.generate(text="hello world", max_new_tokens=8)
        time.sleep(1.0)  # (a measurement, not a synchronisation)
        settled = rss_mib(proc.pid), rss_mib(worker)
        times = [float(line.split()[0]) for line in out]
        print(f"refusal: {out[-1].split(' ', 1)[1][:160]}")
        print(f"refusal times: min {min(times):.3f} s, median {statistics.median(times):.3f} s, max {max(times):.3f} s")
        for name, i in (("front", 0), ("worker", 1)):
            print(f"{name} RSS: {before[i]:.0f} MiB before, {right_after[i]:.0f} right after, {settled[i]:.0f} after 5 ordinary calls")
        quiet = gaps[:mark]
        limit = 2 * statistics.median(quiet)
        excess = sum(max(0.0, gap - limit) for gap in during)
        print(f"stream delay beyond 2x its median gap, summed: {excess:.3f} s ({excess / len(out):.3f} s a prompt)")
        print(f"stream gaps: before median {statistics.median(quiet) * 1e3:.2f} ms; during {len(during)} gaps, "
              f"median {statistics.median(during) * 1e3:.2f} ms, p90 {statistics.quantiles(during, n=10)[-1] * 1e3:.2f} ms, "
              f"max {max(during) * 1e3:.1f} ms" if len(during) > 1 else "stream: no gaps during")
    finally:
        stop_server_process(proc)


if __name__ == "__main__":
    main()
