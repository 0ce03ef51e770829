#!/usr/bin/env python
"""Load test of a running qil server, with invariant checks at the end.

    python -m qil_worker serve --model DIR --port 50051 --threads 1 &
    python scripts/loadtest.py --target 127.0.0.1:50051 --concurrency 16 --duration 60 \\
        --server-pid $! --json /tmp/loadtest.json

``--concurrency`` virtual clients (asyncio tasks on grpc.aio channels) each run one request at a
time until ``--duration`` seconds are over; requests still in flight then run to their end (each
RPC has a ``--request-timeout``). A request draws its prompt from a small pool (shared prefixes,
so the prefix cache is exercised and identical prompts recur), a ``max_new_tokens`` from
``--max-new-range``, a kind and a transport:

* kind ``normal`` (read to the end), ``slow`` (sleep between reads: the server coalesces),
  ``cancel`` (cancelled at a random moment: Cancel RPC, or a cancel frame on a StreamEvents
  session) or ``disconnect`` (the client cancels its call mid-stream, or aborts its session);
* transport ``generate`` (Generate stream), ``submit`` (Submit, then a StreamEvents
  subscription to its events) or ``session`` (submit frame on a StreamEvents session).

Before the measured run a warm-up round of the same workload (``--warmup`` seconds) lets the
server reach its steady memory; the baseline resident memory is read after it.

Checked at the end (exit status 1 when one fails; 2 when the load test itself cannot run):

* ``one_final_event``: every accepted request got exactly one final event, as its last event. For
  disconnects, a late subscription (the server keeps finished requests) must replay it.
* ``gap_free``: in each request's events ``next.seq == seq + len(token_ids)`` from seq 0; the final
  event's ``num_output_tokens`` equals the tokens received, never more than ``max_new_tokens``,
  exactly that for FINISH_REASON_LENGTH; a late replay starts with what the client had seen.
* ``cancel_semantics``: a Cancel answered ``was_active`` ends the request CANCELLED; one answered
  not active had already ended otherwise.
* ``no_failures``: no RPC failed and no request ended with FINISH_REASON_ERROR.
* ``server_counts``: GetInfo ``num_requests_total`` grew by exactly the requests the clients saw
  accepted, and the worker did not restart.
* ``pages_free``: after a settle wait GetInfo shows no page used, nothing unfinished, running or
  waiting.
* ``memory``: resident memory (VmRSS) of the front (``--server-pid``) plus its worker process is
  within ``--rss-tolerance`` of the baseline (each process on its own with ``--rss-per-process``;
  skipped without ``--server-pid``). The front keeps up to --retain-finished finished requests
  for late subscribers, so it grows until that store is full (a few MB for 4096 requests).
* ``consistent_outputs``: greedy decoding is deterministic, so all requests with the same prompt
  produced prefixes of one sequence (a KV page handed to two requests, or a stale prefix-cache
  page, shows up here). ``--no-consistency`` turns it off for sampling servers.

Latencies are measured in this client: TTFT from the call to the first event with a token; the
inter-token latency of an event of n tokens is the time since the previous event, then n-1 zeros
(coalesced tokens arrive together). Slow readers are left out of the inter-token latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import random
import secrets
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from qil_client import AsyncClient, QilError, pb  # noqa: E402
from qil_client.cli_help import DefaultsHelpFormatter  # noqa: E402
from qil_client.errors import error_for  # noqa: E402

FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_ERROR: "error",
}
MAX_REQUESTS_PER_CLIENT = 1_000_000  # a bound on every client loop besides the duration
MAX_EXAMPLES = 20  # problems kept per invariant in the report


class Unusable(Exception):
    """The load test cannot run as asked (bad target, wrong --server-pid, ...): exit status 2."""


# ---------------------------------------------------------------------------- per-request record


@dataclass
class Rec:
    """What one request did, as this client saw it."""

    rid: str
    kind: str
    transport: str
    prompt_key: int
    prompt_len: int
    max_new: int
    warmup: bool
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    tokens: list[int] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    accepted: bool = False
    finals: int = 0
    finish: str | None = None
    error: str | None = None  # status code name of a failed RPC
    cancel_sent: bool = False
    cancel_was_active: bool | None = None
    preemptions: int = 0  # the server's count (final event metrics)
    replay_tokens: list[int] | None = None  # late subscription after a disconnect
    problems: dict[str, list[str]] = field(default_factory=dict)

    def problem(self, invariant: str, text: str) -> None:
        self.problems.setdefault(invariant, []).append(f"{self.rid}: {text}")

    @property
    def outcome(self) -> str:
        if self.error is not None or self.finish == "error":
            return "failed"
        if self.finish == "cancelled":
            return "cancelled"
        if self.finish in ("length", "stop"):
            return "completed"
        return "failed"  # no final event seen


class EventChecker:
    """Checks one event stream of a request: gap-free seqs, one final event, as the last one."""

    def __init__(self, rec: Rec, record_latency: bool) -> None:
        self.rec = rec
        self.record_latency = record_latency
        self.next_seq = 0
        self.tokens: list[int] = []
        self.finals = 0
        self.final: pb.Event | None = None
        self.t_prev: float | None = None

    def add(self, ev: pb.Event, now: float) -> None:
        rec = self.rec
        if ev.request_id != rec.rid:
            rec.problem("gap_free", f"event of {ev.request_id!r} in its stream")
        if self.finals:
            rec.problem("one_final_event", f"event seq {ev.seq} after the final event")
        if ev.seq != self.next_seq:
            what = "gap" if ev.seq > self.next_seq else "repeat"
            rec.problem("gap_free", f"{what}: seq {ev.seq}, expected {self.next_seq}")
        self.next_seq = ev.seq + len(ev.token_ids)
        if ev.token_ids and self.record_latency:
            if self.t_prev is None:
                if rec.t_first is None:
                    rec.t_first = now
            else:
                rec.itl.append(now - self.t_prev)
                rec.itl.extend([0.0] * (len(ev.token_ids) - 1))
            self.t_prev = now
        self.tokens.extend(ev.token_ids)
        if ev.finished:
            self.finals += 1
            self.final = ev
            n = len(self.tokens)
            if ev.num_output_tokens != n:
                rec.problem("gap_free", f"final says {ev.num_output_tokens} tokens, received {n}")
            if n > rec.max_new:
                rec.problem("gap_free", f"{n} tokens for max_new_tokens {rec.max_new}")
            if ev.finish_reason == pb.FINISH_REASON_LENGTH and n != rec.max_new:
                rec.problem("gap_free", f"finish=length after {n} of {rec.max_new} tokens")
            rec.preemptions = ev.metrics.num_preemptions

    def close(self, primary: bool) -> None:
        """The stream ended: exactly one final event must have come (unless we left early)."""
        rec = self.rec
        if self.finals != 1:
            rec.problem("one_final_event", f"{self.finals} final events")
        if primary:
            rec.finals = self.finals
            if self.final is not None:
                rec.finish = FINISH.get(self.final.finish_reason, "unspecified")


# ---------------------------------------------------------------------------- the workload


@dataclass
class Workload:
    vocab: int
    prompts: list[list[int]]
    max_new_range: tuple[int, int]
    cancel_share: float
    disconnect_share: float
    slow_share: float
    slow_sleep: tuple[float, float]


def make_workload(args, info: pb.GetInfoResponse) -> Workload:
    """A pool of prompts over a few shared bases (so prompts recur and share prefixes), with
    lengths in ``--prompt-len-range`` clamped so that every request fits the model and the pool."""
    rng = random.Random(args.seed)
    vocab = args.vocab or info.model.vocab_size
    if vocab <= 0:
        raise Unusable("vocab size unknown (GetInfo gave 0): pass --vocab")
    lo_p, hi_p = args.prompt_len_range
    lo_n, hi_n = args.max_new_range
    limit = info.model.max_position_embeddings or (hi_p + hi_n)
    pool_tokens = info.pages.total * info.limits.page_size or limit
    cap = min(limit, pool_tokens)
    if lo_p + lo_n > cap:
        raise Unusable(f"the smallest request ({lo_p}+{lo_n} tokens) exceeds the server's {cap}")
    hi_p = min(hi_p, cap - lo_n)
    hi_n = min(hi_n, cap - hi_p)
    bases = [[rng.randrange(vocab) for _ in range(hi_p)] for _ in range(max(1, args.prompt_pool // 6))]
    prompts = [bases[i % len(bases)][: rng.randint(lo_p, hi_p)] for i in range(args.prompt_pool)]
    return Workload(
        vocab=vocab,
        prompts=prompts,
        max_new_range=(lo_n, hi_n),
        cancel_share=args.cancel_share,
        disconnect_share=args.disconnect_share,
        slow_share=args.slow_share,
        slow_sleep=(args.slow_sleep_ms[0] / 1000, args.slow_sleep_ms[1] / 1000),
    )


def draw(rng: random.Random, wl: Workload) -> tuple[str, str, int, int]:
    """→ (kind, transport, prompt index, max_new_tokens)."""
    r = rng.random()
    if r < wl.cancel_share:
        kind, transport = "cancel", rng.choice(["generate", "submit", "session"])
    elif r < wl.cancel_share + wl.disconnect_share:
        kind, transport = "disconnect", rng.choice(["generate", "generate", "session"])
    elif r < wl.cancel_share + wl.disconnect_share + wl.slow_share:
        kind, transport = "slow", rng.choice(["generate", "generate", "submit", "session"])
    else:
        kind, transport = "normal", rng.choice(["generate", "generate", "generate", "submit", "session"])
    return kind, transport, rng.randrange(len(wl.prompts)), rng.randint(*wl.max_new_range)


# ---------------------------------------------------------------------------- one request


class Runner:
    def __init__(self, ac: AsyncClient, wl: Workload, timeout: float) -> None:
        self.ac = ac
        self.wl = wl
        self.timeout = timeout

    async def run(self, rec: Rec, rng: random.Random) -> None:
        prompt = self.wl.prompts[rec.prompt_key]
        # cancel / disconnect once this many tokens were received (the request may end first)
        rec_after = rng.randint(1, max(1, rec.max_new - 1))
        rec.t_start = time.perf_counter()
        try:
            if rec.transport == "generate":
                await self._generate(rec, prompt, rng, rec_after)
            elif rec.transport == "submit":
                await self._submit(rec, prompt, rng)
            else:
                await self._session(rec, prompt, rng, rec_after)
        except QilError as err:
            rec.error = err.code.name
            rec.problem("no_failures", f"{rec.transport}/{rec.kind}: {err}")
        except asyncio.TimeoutError:
            rec.error = "CLIENT_TIMEOUT"
            rec.problem("no_failures", f"{rec.transport}/{rec.kind}: no answer within {self.timeout}s")
        rec.t_end = time.perf_counter()
        if rec.finish == "error":
            rec.problem("no_failures", "finished with FINISH_REASON_ERROR")

    async def _slow_pause(self, rec: Rec, rng: random.Random) -> None:
        if rec.kind == "slow":
            await asyncio.sleep(rng.uniform(*self.wl.slow_sleep))

    async def _cancel_rpc(self, rec: Rec) -> None:
        rec.cancel_sent = True
        out = await self.ac.cancel(rec.rid, timeout=self.timeout)
        if list(out) != [rec.rid]:
            rec.problem("cancel_semantics", f"Cancel answered for {list(out)}")
        rec.cancel_was_active = out.get(rec.rid)

    async def _generate(self, rec: Rec, prompt, rng, after: int) -> None:
        check = EventChecker(rec, record_latency=rec.kind != "slow")
        stream = self.ac.stream(prompt, max_new_tokens=rec.max_new, request_id=rec.rid, timeout=self.timeout)
        cancel_task = None
        left = False
        try:
            async for ev in stream:
                rec.accepted = True
                check.add(ev, time.perf_counter())
                if ev.finished:
                    continue  # read on: the server ends the stream here, and anything more is a fault
                if len(check.tokens) >= after:
                    if rec.kind == "disconnect":
                        left = True
                        break
                    if rec.kind == "cancel" and cancel_task is None:
                        cancel_task = asyncio.ensure_future(self._cancel_rpc(rec))
                await self._slow_pause(rec, rng)
        finally:
            await stream.aclose()  # cancels the call when we left early
        rec.tokens = check.tokens
        if cancel_task is not None:
            await asyncio.wait_for(cancel_task, self.timeout)
        if left:
            await self._verify_ended(rec, check.tokens)
        else:
            check.close(primary=True)

    async def _submit(self, rec: Rec, prompt, rng) -> None:
        await self.ac.submit(prompt, max_new_tokens=rec.max_new, request_id=rec.rid, timeout=self.timeout)
        rec.accepted = True
        cancel_task = None
        if rec.kind == "cancel":
            # a random moment: possibly before its first token (still waiting in the queue)
            delay = rng.uniform(0, 0.002 * rec.max_new)
            cancel_task = asyncio.ensure_future(self._delayed(delay, self._cancel_rpc(rec)))
        check = EventChecker(rec, record_latency=rec.kind != "slow")
        async for ev in self.ac.events(rec.rid, timeout=self.timeout):
            check.add(ev, time.perf_counter())
            await self._slow_pause(rec, rng)
        rec.tokens = check.tokens
        if cancel_task is not None:
            await asyncio.wait_for(cancel_task, self.timeout)
        check.close(primary=True)

    @staticmethod
    async def _delayed(delay: float, coro) -> None:
        await asyncio.sleep(delay)
        await coro

    async def _session(self, rec: Rec, prompt, rng, after: int) -> None:
        check = EventChecker(rec, record_latency=rec.kind != "slow")
        s = self.ac.session(timeout=self.timeout)
        s.submit(prompt, max_new_tokens=rec.max_new, request_id=rec.rid)
        cancel_answers: list[pb.CancelResponse] = []
        sent_cancel = aborted = False
        frames = s.__aiter__()
        try:
            async for resp in frames:
                kind = resp.WhichOneof("frame")
                if kind == "submitted":
                    rec.accepted = True
                    if resp.submitted.request_id != rec.rid:
                        rec.problem("gap_free", f"submitted ack for {resp.submitted.request_id!r}")
                elif kind == "cancelled":
                    cancel_answers.append(resp.cancelled)
                elif kind == "error":
                    e = resp.error
                    raise error_for(e.code, f"in-band: {e.message}", e.field)
                elif kind == "event":
                    check.add(resp.event, time.perf_counter())
                    if resp.event.finished:
                        s.close()  # half-close: the server ends the stream after its answers
                        continue
                    if len(check.tokens) >= after:
                        if rec.kind == "disconnect":
                            aborted = True
                            break
                        if rec.kind == "cancel" and not sent_cancel:
                            sent_cancel = rec.cancel_sent = True
                            s.cancel(rec.rid)
                    await self._slow_pause(rec, rng)
        finally:
            s.abort()  # no-op once the stream ended
            await frames.aclose()
        rec.tokens = check.tokens
        if aborted:
            await self._verify_ended(rec, check.tokens)
            return
        check.close(primary=True)
        if sent_cancel:
            if len(cancel_answers) != 1 or [r.request_id for r in cancel_answers[0].results] != [rec.rid]:
                rec.problem("cancel_semantics", f"cancel frame answered {cancel_answers!r}")
            else:
                rec.cancel_was_active = cancel_answers[0].results[0].was_active
        elif cancel_answers:
            rec.problem("cancel_semantics", "a cancel answer for a cancel never sent")

    async def _verify_ended(self, rec: Rec, seen: list[int]) -> None:
        """After a disconnect: a late subscription must replay the request to exactly one final
        event, starting with the tokens seen before leaving."""
        check = EventChecker(rec, record_latency=False)
        # The server knew the request (we saw its events), so NOT_FOUND here is a failure.
        async for ev in self.ac.events(rec.rid, timeout=self.timeout):
            check.add(ev, time.perf_counter())
        check.close(primary=True)
        rec.replay_tokens = check.tokens
        if check.tokens[: len(seen)] != seen:
            rec.problem("gap_free", "late replay does not start with the tokens seen before disconnecting")


# ---------------------------------------------------------------------------- the run


async def run_round(args, wl: Workload, label: str, seconds: float, seed: int, nonce: str) -> tuple[list[Rec], float]:
    """``--concurrency`` clients, each one request at a time, starting requests for ``seconds``."""
    t0 = time.perf_counter()
    end = t0 + seconds
    recs: list[Rec] = []
    channels = max(1, min(args.channels, args.concurrency))
    clients = [AsyncClient(args.target) for _ in range(channels)]

    async def client(i: int) -> None:
        rng = random.Random(f"{seed}-{i}")
        runner = Runner(clients[i % channels], wl, args.request_timeout)
        for n in range(MAX_REQUESTS_PER_CLIENT):
            if time.perf_counter() >= end:
                return
            kind, transport, key, max_new = draw(rng, wl)
            rec = Rec(
                rid=f"lt-{nonce}-{label}-{i}-{n}", kind=kind, transport=transport, prompt_key=key,
                prompt_len=len(wl.prompts[key]), max_new=max_new, warmup=label == "warmup",
            )
            recs.append(rec)
            await runner.run(rec, rng)

    try:
        await asyncio.wait_for(
            asyncio.gather(*(client(i) for i in range(args.concurrency))),
            seconds + 2 * args.request_timeout + 30,
        )
    finally:
        for c in clients:
            await c.close()
    elapsed = max((r.t_end for r in recs), default=t0) - t0
    return recs, elapsed


async def settle(ac: AsyncClient, seconds: float) -> tuple[pb.GetInfoResponse, float]:
    """Poll GetInfo until nothing is in use, for at most ``seconds``."""
    t0 = time.monotonic()
    while True:
        info = await ac.info(timeout=10)
        idle = (info.pages.used == 0 and info.num_unfinished == 0 and info.num_running == 0
                and info.num_waiting == 0)
        if idle or time.monotonic() - t0 > seconds:
            return info, time.monotonic() - t0
        await asyncio.sleep(0.1)


# ---------------------------------------------------------------------------- memory


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def child_pids(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return sorted(set(out))


def server_memory(front_pid: int | None, worker_pid: int) -> dict[str, int]:
    """VmRSS in KiB of the front and of its worker (the pid GetInfo gives, which must be a child
    of the front: else ``--server-pid`` names some other process and the check would be void)."""
    if not front_pid:
        return {}
    front = rss_kb(front_pid)
    if front is None:
        raise Unusable(f"no process {front_pid} (--server-pid)")
    if worker_pid not in child_pids(front_pid):
        raise Unusable(f"the server's worker (pid {worker_pid}) is not a child of "
                         f"--server-pid {front_pid}: pass the pid of `python -m qil_worker serve`")
    mem = {"front": front}
    worker = rss_kb(worker_pid)
    if worker is not None:
        mem["worker"] = worker
    return mem


# ---------------------------------------------------------------------------- report


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)  # nearest rank
    return values[max(0, min(len(values) - 1, math.ceil(q / 100 * len(values)) - 1))]


def check_consistency(recs: list[Rec]) -> list[str]:
    """All outputs of one prompt must be prefixes of the longest of them (greedy decoding)."""
    by_prompt: dict[int, list[Rec]] = {}
    outputs = {r.rid: (r.replay_tokens if r.replay_tokens is not None else r.tokens) for r in recs}
    for r in recs:
        if outputs[r.rid]:
            by_prompt.setdefault(r.prompt_key, []).append(r)
    bad = []
    for key, group in by_prompt.items():
        ref = max(group, key=lambda r: len(outputs[r.rid]))
        want = outputs[ref.rid]
        for r in group:
            got = outputs[r.rid]
            if want[: len(got)] != got:
                i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
                bad.append(f"prompt {key}: {r.rid} differs from {ref.rid} at output token {i}")
    return bad


def evaluate(args, recs: list[Rec], before: pb.GetInfoResponse, after: pb.GetInfoResponse,
             settle_s: float, mem_before: dict, mem_after: dict) -> dict[str, dict[str, Any]]:
    inv: dict[str, dict[str, Any]] = {}

    def put(name: str, problems: list[str], detail: str = "", skipped: bool = False) -> None:
        inv[name] = {
            "ok": not problems, "skipped": skipped, "detail": detail,
            "problems": len(problems), "examples": problems[:MAX_EXAMPLES],
        }

    per: dict[str, list[str]] = {}
    for r in recs:
        for name, items in r.problems.items():
            per.setdefault(name, []).extend(items)
    accepted = sum(r.accepted for r in recs)
    put("one_final_event", per.get("one_final_event", []), f"{accepted} accepted requests checked")
    put("gap_free", per.get("gap_free", []), f"{sum(len(r.tokens) for r in recs)} tokens checked")
    cancel = list(per.get("cancel_semantics", []))
    for r in recs:
        if r.cancel_was_active is True and r.finish not in ("cancelled", None):
            cancel.append(f"{r.rid}: Cancel said active, but it finished {r.finish}")
        if r.cancel_was_active is False and r.finish == "cancelled":
            cancel.append(f"{r.rid}: Cancel said not active, but it finished cancelled")
        if r.finish == "cancelled" and not r.cancel_sent and r.kind != "disconnect":
            cancel.append(f"{r.rid}: cancelled without a cancel or a disconnect")
    sent = sum(r.cancel_sent for r in recs)
    put("cancel_semantics", cancel, f"{sent} cancels sent")
    put("no_failures", per.get("no_failures", []))
    counts = []
    grew = after.num_requests_total - before.num_requests_total
    if grew != accepted:
        counts.append(f"num_requests_total grew by {grew}, clients saw {accepted} accepted")
    if after.worker.restarts != before.worker.restarts or after.worker.state != pb.WORKER_STATE_READY:
        counts.append(f"worker restarts {before.worker.restarts} -> {after.worker.restarts}, "
                      f"state {pb.WorkerState.Name(after.worker.state)}")
    put("server_counts", counts, f"num_requests_total +{grew}")
    pages = []
    if after.pages.used or after.num_unfinished or after.num_running or after.num_waiting:
        pages.append(f"after {settle_s:.1f}s: pages used {after.pages.used}, unfinished "
                     f"{after.num_unfinished}, running {after.num_running}, waiting {after.num_waiting}")
    put("pages_free", pages, f"pages used {after.pages.used}/{after.pages.total} after {settle_s:.1f}s")
    if not mem_before:
        put("memory", [], "no --server-pid", skipped=True)
    else:
        mem = []
        checked = dict(mem_before) if args.rss_per_process else {"total": sum(mem_before.values())}
        now_all = dict(mem_after) if args.rss_per_process else {"total": sum(mem_after.values())}
        for name, kb in checked.items():
            now = now_all.get(name)
            if now is None or set(mem_after) != set(mem_before):
                mem.append(f"{name}: process gone")
            elif abs(now - kb) > args.rss_tolerance * kb:
                mem.append(f"{name}: VmRSS {kb} KiB -> {now} KiB ({(now - kb) / kb:+.1%})")
        scope = "each process" if args.rss_per_process else "front + worker"
        put("memory", mem, f"{scope} within {args.rss_tolerance:.0%}: " + ", ".join(
            f"{k} {mem_before[k]}->{mem_after.get(k)} KiB" for k in mem_before))
    if args.no_consistency:
        put("consistent_outputs", [], "off", skipped=True)
    else:
        put("consistent_outputs", check_consistency(recs),
            f"{len({r.prompt_key for r in recs if r.tokens})} prompts")
    return inv


def figures(recs: list[Rec], elapsed: float) -> dict[str, Any]:
    out = {k: sum(r.outcome == k for r in recs) for k in ("completed", "cancelled", "failed")}
    ttft = [r.t_first - r.t_start for r in recs if r.t_first is not None]
    itl = [x for r in recs for x in r.itl]
    tokens = sum(len(r.tokens) for r in recs)
    errors: dict[str, int] = {}
    for r in recs:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    kinds: dict[str, int] = {}
    for r in recs:
        kinds[f"{r.kind}/{r.transport}"] = kinds.get(f"{r.kind}/{r.transport}", 0) + 1
    ms = lambda v: None if v is None else round(v * 1000, 3)  # noqa: E731
    return {
        "requests": len(recs), **out, "errors": errors, "kinds": dict(sorted(kinds.items())),
        "elapsed_s": round(elapsed, 3), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else 0.0,
        "requests_per_s": round(len(recs) / elapsed, 2) if elapsed > 0 else 0.0,
        "ttft_ms": {f"p{q}": ms(pct(ttft, q)) for q in (50, 90, 99)},
        "itl_ms": {f"p{q}": ms(pct(itl, q)) for q in (50, 90, 99)},
        "ttft_samples": len(ttft), "itl_samples": len(itl),
        "preemptions": sum(r.preemptions for r in recs),
    }


def print_summary(report: dict[str, Any]) -> None:
    f = report["figures"]
    print(f"\nqil load test: {report['target']}  concurrency {report['config']['concurrency']}  "
          f"duration {report['config']['duration']}s  seed {report['config']['seed']}")
    rows = [
        ("requests", f"{f['requests']}  ({f['requests_per_s']}/s)"),
        ("completed / cancelled / failed", f"{f['completed']} / {f['cancelled']} / {f['failed']}"),
        ("errors", json.dumps(f["errors"]) if f["errors"] else "-"),
        ("preemptions (server)", str(f["preemptions"])),
        ("output tokens", f"{f['output_tokens']}  ({f['output_tokens_per_s']} tok/s over {f['elapsed_s']}s)"),
        ("TTFT p50 / p90 / p99 ms", " / ".join(str(f["ttft_ms"][k]) for k in ("p50", "p90", "p99"))),
        ("ITL p50 / p90 / p99 ms", " / ".join(str(f["itl_ms"][k]) for k in ("p50", "p90", "p99"))),
    ]
    for name, m in report.get("memory_kib", {}).get("before", {}).items():
        rows.append((f"VmRSS {name} KiB (before -> after)", f"{m} -> {report['memory_kib']['after'].get(name)}"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print("invariants:")
    for name, v in report["invariants"].items():
        status = "skip" if v["skipped"] else ("ok" if v["ok"] else "FAIL")
        print(f"  {status:<4}  {name:<20} {v['detail']}")
        for ex in v["examples"][:5]:
            print(f"          {ex}")
    print("RESULT:", "PASS" if report["ok"] else "FAIL")


# ---------------------------------------------------------------------------- main


def loopback_target(target: str) -> str:
    """Only a loopback HOST:PORT is accepted: this tool is for servers on this machine."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise Unusable(f"--target must be HOST:PORT, got {target!r}")
    host = host.strip("[]")
    try:
        addrs = {ipaddress.ip_address(host)}
    except ValueError:
        try:
            addrs = {ipaddress.ip_address(a[4][0]) for a in socket.getaddrinfo(host, int(port))}
        except OSError as exc:
            raise Unusable(f"cannot resolve {host!r}: {exc}") from None
    if not addrs or not all(a.is_loopback for a in addrs):
        raise Unusable(f"{target!r} is not a loopback address")
    return target


def int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 0 or hi_i < lo_i:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want LO,HI with 0 <= LO <= HI")
    return lo_i, hi_i


def share(text: str) -> float:
    v = float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError("a share is in [0, 1]")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--target", required=True, help="HOST:PORT of a server on this machine")
    p.add_argument("--concurrency", type=int, default=8, help="clients, one request in flight each")
    p.add_argument("--duration", type=float, default=30.0, help="seconds during which requests start")
    p.add_argument("--warmup", type=float, default=None, help="warm-up seconds (default: min(5, duration/4))")
    p.add_argument("--seed", type=int, default=0, help="of the random choices (prompts, lengths, shares)")
    p.add_argument("--prompt-len-range", type=int_range, default=(1, 64), metavar="LO,HI",
                   help="prompt lengths, tokens (default: 1,64)")
    p.add_argument("--max-new-range", type=int_range, default=(1, 64), metavar="LO,HI",
                   help="max_new_tokens of the requests (default: 1,64)")
    p.add_argument("--prompt-pool", type=int, default=24, help="distinct prompts (they recur)")
    p.add_argument("--cancel-share", type=share, default=0.15, help="share of requests cancelled mid-way")
    p.add_argument("--disconnect-share", type=share, default=0.15,
                   help="share of requests whose client goes away mid-way")
    p.add_argument("--slow-share", type=share, default=0.15, help="share of requests read by a slow client")
    p.add_argument("--slow-sleep-ms", type=int_range, default=(5, 50), metavar="LO,HI",
                   help="a slow client's pause between events, ms (default: 5,50)")
    p.add_argument("--vocab", type=int, default=None, help="token ids drawn below this (default: GetInfo)")
    p.add_argument("--channels", type=int, default=4, help="gRPC channels the clients share")
    p.add_argument("--request-timeout", type=float, default=60.0, help="deadline of every RPC")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to wait for the pool to drain")
    p.add_argument("--server-pid", type=int, default=None,
                   help="front pid: check resident memory (default: no memory check)")
    p.add_argument("--rss-tolerance", type=float, default=0.10,
                   help="how far resident memory may move from its baseline, as a fraction")
    p.add_argument(
        "--rss-per-process", action="store_true",
        help="hold the front and the worker to the tolerance each (default: their sum). The front "
        "legitimately grows while it fills its store of finished requests (--retain-finished)",
    )
    p.add_argument("--no-consistency", action="store_true", help="do not compare outputs (sampling)")
    p.add_argument("--json", default=None, help="write the report here (default: not written)")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.duration <= 0:
        p.error("--concurrency and --duration must be positive")
    if args.cancel_share + args.disconnect_share + args.slow_share > 1.0:
        p.error("the shares add up to more than 1")
    if args.max_new_range[0] < 1:
        p.error("--max-new-range starts at 1 or more")
    if args.prompt_len_range[0] < 1:
        p.error("--prompt-len-range starts at 1 or more")
    try:
        args.target = loopback_target(args.target)
    except Unusable as exc:
        p.error(str(exc))
    if args.warmup is None:
        args.warmup = min(5.0, args.duration / 4)
    return args


async def amain(args) -> dict[str, Any]:
    async with AsyncClient(args.target) as ac:
        info = await ac.info(timeout=30)
        if info.worker.state != pb.WORKER_STATE_READY:
            raise Unusable(f"worker is {pb.WorkerState.Name(info.worker.state)}")
        server_memory(args.server_pid, info.worker.pid)  # a wrong --server-pid fails now
        wl = make_workload(args, info)
        nonce = secrets.token_hex(3)  # request ids unique across runs against one server
        warm: list[Rec] = []
        if args.warmup > 0:
            warm, _ = await run_round(args, wl, "warmup", args.warmup, args.seed + 1, nonce)
        before, _ = await settle(ac, args.settle)
        mem_before = server_memory(args.server_pid, before.worker.pid)
        recs, elapsed = await run_round(args, wl, "run", args.duration, args.seed, nonce)
        after, settle_s = await settle(ac, args.settle)
        mem_after = server_memory(args.server_pid, after.worker.pid)
    inv = evaluate(args, recs, before, after, settle_s, mem_before, mem_after)
    warm_problems = sorted({k for r in warm for k in r.problems})
    if warm_problems:  # the warm-up is checked too, just not counted in the figures
        inv.setdefault("warmup", {"ok": False, "skipped": False, "problems": len(warm_problems),
                                  "detail": "problems in the warm-up round", "examples": warm_problems})
    report = {
        "target": args.target,
        "config": {k: v for k, v in vars(args).items() if k not in ("json",)},
        "model": {"name": info.model.name, "vocab_size": info.model.vocab_size,
                  "hidden_size": info.model.hidden_size, "num_hidden_layers": info.model.num_hidden_layers},
        "warmup_requests": len(warm),
        "figures": figures(recs, elapsed),
        "memory_kib": {"before": mem_before, "after": mem_after},
        "pages_after": {"total": after.pages.total, "used": after.pages.used, "settle_s": round(settle_s, 2)},
        "invariants": inv,
        "ok": all(v["ok"] for v in inv.values()),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(amain(args))
    except QilError as err:
        print(f"error: the server failed outside of a request: {err}", file=sys.stderr)
        return 2
    except Unusable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=list) + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
