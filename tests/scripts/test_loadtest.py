"""scripts/loadtest.py: a short run against a real server passes every invariant, and the checks
themselves catch what they are meant to catch (gaps, repeats, double finals, diverging outputs,
a server that forgets requests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import loadtest  # noqa: E402
from qil_client import pb  # noqa: E402
from service_fixtures import serve_process, stop_server_process  # noqa: E402

INVARIANTS = {"one_final_event", "gap_free", "cancel_semantics", "no_failures", "server_counts",
              "pages_free", "memory", "consistent_outputs"}


def run_loadtest(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "loadtest.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def test_short_load_test_passes_every_invariant(tiny_dir, tmp_path):
    proc, target, _ = serve_process("--model", str(tiny_dir), "--log-level", "WARNING")
    try:
        out = run_loadtest("--target", target, "--concurrency", "8", "--duration", "6",
                           "--warmup", "2", "--seed", "3", "--server-pid", str(proc.pid), "--rss-per-process",
                           "--json", str(tmp_path / "report.json"))
        # a --server-pid that is not this server's front would make the memory check void
        wrong = run_loadtest("--target", target, "--duration", "1", "--server-pid", str(os.getpid()))
    finally:
        stop_server_process(proc)
    assert wrong.returncode == 2 and "is not a child of --server-pid" in wrong.stderr, wrong.stderr
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "RESULT: PASS" in out.stdout and "TTFT p50" in out.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is True
    inv = report["invariants"]
    assert set(inv) == INVARIANTS
    assert all(v["ok"] and not v["skipped"] for v in inv.values()), inv
    f = report["figures"]
    assert f["requests"] == f["completed"] + f["cancelled"] + f["failed"]
    assert f["failed"] == 0 and f["errors"] == {}
    # every kind of request ran, and some of them really got cancelled
    kinds = {k.split("/")[0] for k in f["kinds"]}
    transports = {k.split("/")[1] for k in f["kinds"]}
    assert kinds == {"normal", "slow", "cancel", "disconnect"}
    assert transports == {"generate", "submit", "session"}
    assert f["completed"] > 20 and f["cancelled"] > 0
    assert f["output_tokens"] > 0 and f["output_tokens_per_s"] > 0
    for lat in (f["ttft_ms"], f["itl_ms"]):
        assert 0 <= lat["p50"] <= lat["p90"] <= lat["p99"]
    mem = report["memory_kib"]
    assert set(mem["before"]) == {"front", "worker"} and all(v > 0 for v in mem["before"].values())
    assert report["pages_after"]["used"] == 0


def test_load_test_fails_when_the_server_forgets_finished_requests(tiny_dir, tmp_path):
    """--retain-finished 0: a late subscription gets NOT_FOUND, which the load test must report as
    a failure (exit 1), not hide. One-token requests make it certain for the Submit-then-subscribe
    ones: the worker answers the submit and ends the request in the same batch, so the front has
    forgotten it before Submit returns (a subscription after a disconnect races the cancel)."""
    proc, target, _ = serve_process("--model", str(tiny_dir), "--log-level", "WARNING", "--retain-finished", "0")
    try:
        out = run_loadtest("--target", target, "--concurrency", "4", "--duration", "2",
                           "--warmup", "0", "--request-timeout", "5", "--max-new-range", "1,1",
                           "--cancel-share", "0", "--disconnect-share", "0", "--slow-share", "0",
                           "--json", str(tmp_path / "report.json"))
    finally:
        stop_server_process(proc)
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["ok"]
    assert not report["invariants"]["no_failures"]["ok"]
    assert report["figures"]["errors"].get("NOT_FOUND", 0) > 0
    assert report["invariants"]["memory"]["skipped"]  # no --server-pid


def test_refuses_a_target_that_is_not_loopback():
    out = run_loadtest("--target", "10.1.2.3:50051", "--duration", "1", timeout=30)
    assert out.returncode != 0 and "not a loopback" in out.stderr


# ---------------------------------------------------------------------------- the checkers alone


def _rec(max_new: int = 4) -> loadtest.Rec:
    return loadtest.Rec(rid="r", kind="normal", transport="generate", prompt_key=0, prompt_len=3,
                        max_new=max_new, warmup=False)


def _ev(seq: int, tokens: list[int], finished: bool = False, n: int | None = None,
        reason: int = pb.FINISH_REASON_LENGTH) -> pb.Event:
    ev = pb.Event(request_id="r", seq=seq, token_ids=tokens, finished=finished)
    if finished:
        ev.finish_reason = reason
        ev.num_output_tokens = seq + len(tokens) if n is None else n
    return ev


def _check(events: list[pb.Event], max_new: int = 4) -> dict[str, list[str]]:
    rec = _rec(max_new)
    check = loadtest.EventChecker(rec, record_latency=True)
    for i, ev in enumerate(events):
        check.add(ev, float(i))
    check.close(primary=True)
    return rec.problems


def test_event_checker_accepts_a_coalesced_gap_free_stream():
    assert _check([_ev(0, [1]), _ev(1, [2, 3]), _ev(3, [4], finished=True)]) == {}


@pytest.mark.parametrize(
    "events, invariant",
    [
        ([_ev(0, [1]), _ev(2, [3, 4], finished=True)], "gap_free"),  # gap
        ([_ev(0, [1, 2]), _ev(1, [2, 3, 4], finished=True)], "gap_free"),  # repeat
        ([_ev(0, [1, 2, 3, 4], finished=True, n=5)], "gap_free"),  # count disagrees
        ([_ev(0, [1, 2], finished=True)], "gap_free"),  # "length" before max_new_tokens
        ([_ev(0, [1, 2, 3, 4])], "one_final_event"),  # no final event
        ([_ev(0, [1, 2, 3, 4], finished=True), _ev(4, [], finished=True)], "one_final_event"),
    ],
)
def test_event_checker_catches(events, invariant):
    assert invariant in _check(events)


def test_latencies_count_coalesced_tokens_as_arriving_together():
    rec = _rec()
    check = loadtest.EventChecker(rec, record_latency=True)
    rec.t_start = 0.0
    for t, ev in ((1.0, _ev(0, [1])), (3.0, _ev(1, [2, 3, 4], finished=True))):
        check.add(ev, t)
    assert rec.t_first == 1.0 and rec.itl == [2.0, 0.0, 0.0]


def test_consistency_check_catches_diverging_outputs_of_one_prompt():
    a, b, c = _rec(), _rec(), _rec()
    a.rid, b.rid, c.rid = "a", "b", "c"
    a.tokens, b.tokens, c.tokens = [1, 2, 3, 4], [1, 2], [1, 2, 3]
    assert loadtest.check_consistency([a, b, c]) == []
    c.replay_tokens = [1, 9, 3]  # a disconnect whose late replay diverges
    bad = loadtest.check_consistency([a, b, c])
    assert len(bad) == 1 and "c differs from a at output token 1" in bad[0]


def test_percentiles_are_nearest_rank():
    values = [float(i) for i in range(1, 101)]
    assert loadtest.pct(values, 50) == 50.0 and loadtest.pct(values, 99) == 99.0
    assert loadtest.pct([7.0], 90) == 7.0 and loadtest.pct([], 50) is None
