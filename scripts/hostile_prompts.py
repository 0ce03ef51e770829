"""Hostile prompts against a real server: how fast prompts of megabytes that cannot fit are
refused, what they leave in the front's and the worker's memory, and what they do to a stream
running meanwhile, next to ordinary traffic from the same kind of sender.

    python scripts/hostile_prompts.py [--prompts 11] [--mib 10] [--kind text|token_ids] [--rounds 1] [--http]

Starts ``python -m qil_worker serve`` (the demo model) as its own process, runs one stream of
1,500 tokens after another, and from a second process (its own GIL) sends, in each round, first
the same number of tiny requests (the control: what any request costs the stream on this
machine) and then the prompts (the attack), one after another. ``--kind token_ids``: the prompts
are ids (a packed field of the same size); ``--http``: both go to the HTTP API
(/v1/completions, a JSON body) instead of gRPC. Prints the refusals' times, the front's and
worker's RSS (/proc/PID/statm) before, right after and after a few ordinary calls, and, for
control and attack, the stream's inter-token gaps while the sender was sending: their maximum,
how many exceeded twice the stream's quiet median, and the delay beyond that, summed.
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
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

from qil_client import Client  # noqa: E402
from service_fixtures import serve_process, stop_server_process, wait_until  # noqa: E402

# argv: target, count, MiB (0: a tiny request), kind, http target or "-". Prints per request
# "start end outcome" (time.monotonic: one clock for both processes).
SENDER = r"""
import json, sys, time, urllib.error, urllib.request
from qil_client import Client
target, count, mib, kind, http = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
size = mib * 2**20
if kind == "token_ids":
    prompt = dict(token_ids=[7] * size) if size else dict(token_ids=[1, 2, 3])
else:
    prompt = dict(text="word " * (size // 5)) if size else dict(text="hello world")
c = Client(target)
if http != "-":
    model = json.load(urllib.request.urlopen(http + "/v1/models"))["data"][0]["id"]
    body = json.dumps({"model": model, "max_tokens": 2,
                       "prompt": prompt.get("text", prompt.get("token_ids"))}).encode()
for _ in range(count):
    t0 = time.monotonic()
    try:
        if http == "-":
            c.generate(max_new_tokens=2, **prompt)
        else:
            req = urllib.request.Request(http + "/v1/completions", body, {"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=60).read()
        outcome = "accepted"
    except urllib.error.HTTPError as exc:
        outcome = f"HTTP {exc.code} " + exc.read().decode()[:300]
    except Exception as exc:
        outcome = str(exc)
    print(f"{t0:.6f} {time.monotonic():.6f} {outcome.replace(chr(10), ' ')}", flush=True)
"""


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def send(target: str, count: int, mib: int, kind: str, http: str) -> list[tuple[float, float, str]]:
    out = subprocess.run([sys.executable, "-c", SENDER, target, str(count), str(mib), kind, http],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if out.returncode:
        raise SystemExit(out.stderr)
    rows = [line.split(" ", 2) for line in out.stdout.splitlines()]
    return [(float(a), float(b), outcome) for a, b, outcome in rows]


def gaps_within(arrivals: list[float], sent: list[tuple[float, float, str]]) -> list[float]:
    """The stream's gaps that ended while the sender's requests were under way."""
    start, end = sent[0][0], sent[-1][1]
    return [b - a for a, b in zip(arrivals, arrivals[1:]) if start <= b <= end]


def describe(name: str, gaps: list[float], limit: float, n: int) -> str:
    over = [g for g in gaps if g > limit]
    excess = sum(g - limit for g in over)
    return (f"{name:8s}: {len(gaps):5d} gaps, median {statistics.median(gaps) * 1e3:5.2f} ms, "
            f"max {max(gaps) * 1e3:6.1f} ms, {len(over):3d} over 2x median ({len(over) / n:.1f} a request), "
            f"delay beyond it {excess * 1e3:6.1f} ms ({excess / n * 1e3:.1f} ms a request)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=11, help="requests per phase (default 11)")
    ap.add_argument("--mib", type=int, default=10, help="each prompt's size in MiB (default 10)")
    ap.add_argument("--kind", choices=("text", "token_ids"), default="text", help="prompt form (default text)")
    ap.add_argument("--rounds", type=int, default=1, help="control-then-attack rounds (default 1)")
    ap.add_argument("--http", action="store_true", help="send to the HTTP API instead of gRPC (default: gRPC)")
    ap.add_argument("--deserialize", action="store_true",
                    help="only time, in this process, what the front's event loop spends on one such message "
                         "(parsed whole and its prompt read, against the wire scan; no server)")
    args = ap.parse_args()
    if args.deserialize:
        return deserialize(args.mib, args.kind)
    proc, target, _ = serve_process(*(["--http-port", "0"] if args.http else []))
    try:
        http = "-"
        if args.http:
            http = "http://" + proc.announcement.split("(HTTP on ")[1].split(")")[0]
        client = Client(target)
        worker = client.info().worker.pid
        client.generate(text="hello world", max_new_tokens=8)
        before = rss_mib(proc.pid), rss_mib(worker)
        arrivals: list[float] = []
        done = threading.Event()

        def stream() -> None:
            while not done.is_set():
                for _ in client.stream(token_ids=[1, 2, 3], max_new_tokens=1500, ignore_eos=True):
                    arrivals.append(time.monotonic())
                    if done.is_set():
                        return

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        wait_until(lambda: len(arrivals) >= 500, timeout=60)
        quiet = [b - a for a, b in zip(arrivals, arrivals[1:])]
        control_gaps: list[float] = []
        attack_gaps: list[float] = []
        attack: list[tuple[float, float, str]] = []
        for _ in range(args.rounds):
            control_gaps += gaps_within(arrivals, send(target, args.prompts, 0, args.kind, http))
            sent = send(target, args.prompts, args.mib, args.kind, http)
            attack_gaps += gaps_within(arrivals, sent)
            attack += sent
        done.set()
        reader.join(60)
        right_after = rss_mib(proc.pid), rss_mib(worker)
        for _ in range(5):
            client.info()
            client.generate(text="hello world", max_new_tokens=8)
        time.sleep(1.0)  # (a measurement, not a synchronisation)
        settled = rss_mib(proc.pid), rss_mib(worker)
        times = [end - start for start, end, _ in attack]
        print(f"{args.kind} prompts of {args.mib} MiB over {'HTTP' if args.http else 'gRPC'}; load: {os.getloadavg()}")
        print(f"refusal: {attack[-1][2][:200]}")
        print(f"refusal times: min {min(times):.3f} s, median {statistics.median(times):.3f} s, max {max(times):.3f} s")
        for name, i in (("front", 0), ("worker", 1)):
            print(f"{name} RSS: {before[i]:.0f} MiB before, {right_after[i]:.0f} right after, {settled[i]:.0f} after 5 ordinary calls")
        limit = 2 * statistics.median(quiet)
        n = args.prompts * args.rounds
        print(f"stream: quiet median gap {statistics.median(quiet) * 1e3:.2f} ms, max {max(quiet) * 1e3:.1f} ms")
        for name, gaps in (("control", control_gaps), ("attack", attack_gaps)):
            print(describe(name, gaps, limit, n) if len(gaps) > 1 else f"{name}: no gaps")
    finally:
        stop_server_process(proc)


def deserialize(mib: int, kind: str, repeats: int = 20) -> None:
    """The two ways the front can take an outsized submit, alternated: parsed whole and its
    prompt read as ``submit_spec.submit_spec`` reads it (the str of its text, the list of its
    ids), or scanned (``outsized_submit.submit_request``) and bounded from its size."""
    from qil_client._proto.qil.v1 import inference_pb2 as pb
    from qil_worker.freed_memory import map_large_blocks
    from qil_worker.service.front.outsized_submit import submit_request

    map_large_blocks()  # as in the front: each received message is a fresh mapping
    prompt = dict(token_ids=[7] * (mib * 2**20)) if kind == "token_ids" else dict(text="word " * (mib * 2**20 // 5))
    wire = pb.SubmitRequest(max_new_tokens=2, **prompt).SerializeToString()
    whole, scanned = [], []
    for _ in range(repeats):
        data = bytes(bytearray(wire))  # (a fresh copy, as gRPC hands each message over)
        t0 = time.perf_counter()
        request = pb.SubmitRequest.FromString(data)
        size = len(request.text) if kind == "text" else len(list(request.token_ids))
        whole.append(time.perf_counter() - t0)
        del request, data
        data = bytes(bytearray(wire))
        t0 = time.perf_counter()
        got = submit_request(data)
        size2 = got.prompt.min_tokens(1, None) if kind == "text" else got.prompt.num_token_ids
        scanned.append(time.perf_counter() - t0)
        assert size == size2, (size, size2)
        del got, data
    print(f"{kind} prompt of {mib} MiB, {repeats} times each, alternated; load: {os.getloadavg()}")
    for name, times in (("parsed whole, prompt read", whole), ("wire scan, size only", scanned)):
        print(f"{name:26s}: median {statistics.median(times) * 1e3:7.2f} ms, min {min(times) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
