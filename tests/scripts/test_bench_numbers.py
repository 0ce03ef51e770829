"""The benchmark scripts' numbers: percentiles, tok/s, hit rates, ratios and their direction,
best-of and median rounds, Poisson arrivals — computed from fakes whose timings are known, so a
script that misreports fails here."""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from types import SimpleNamespace
import types
from contextlib import redirect_stdout
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_decode_step as bd  # noqa: E402
import bench_engine as be  # noqa: E402
import bench_service as bs  # noqa: E402
import bench_throughput as bt  # noqa: E402
import qil_worker  # noqa: E402


class FakeEvent:
    def __init__(self, request_id, token_id, finished):
        self.request_id, self.token_id, self.finished, self.error = request_id, token_id, finished, None


class FakeEngine:
    """Every step (1 ms) gives each request one token; half of each prompt counts as cached."""

    def __init__(self, model, **kwargs):
        self.prompts, self.left = {}, {}
        self.runner, self.attention_backend = SimpleNamespace(decode_graphs=None, step_graphs=None), "fake"

    def submit(self, prompt, max_new_tokens, **kwargs):
        rid = f"r{len(self.prompts)}"
        self.prompts[rid], self.left[rid] = prompt, max_new_tokens
        return rid

    @property
    def idle(self):
        return not self.left

    def step(self, *args):
        time.sleep(0.001)  # a step that takes time: the timings under test are measured
        events = []
        for rid in list(self.left):
            self.left[rid] -= 1
            events.append(FakeEvent(rid, 1, self.left[rid] == 0))
            if not self.left[rid]:
                del self.left[rid]
        return events

    def stats(self):
        return types.SimpleNamespace(num_pages_used=1)

    def result(self, rid):
        return types.SimpleNamespace(num_cached_tokens=len(self.prompts[rid]) // 2, ttft=0.01)

    def release(self, rid):
        pass

    def close(self):
        pass


def _no_model(monkeypatch, model=None):
    monkeypatch.setattr(qil_worker.Qwen3, "from_directory", classmethod(lambda cls, *a, **k: model or object()))


# -- bench_throughput


def test_p99_is_nearest_rank_of_sorted_samples():
    assert bt.p99([1.0, 2.0]) == 2.0 and bt.p99([3.0, 1.0, 2.0]) == 3.0


def test_summary_counts_output_and_total_tokens_and_ttft_apart():
    s = bt.summarize("x", 2.0, [([1, 2, 3], 4)], [0.5], [0.1])
    assert s["output_tok_s"] == 2.0 and s["total_tok_s"] == 3.5 and s["ttft_p99_s"] == 0.5


def test_the_ratio_column_is_qil_over_the_system():
    def row(name, tok_s):
        return dict(system=name, output_tok_s=tok_s, total_tok_s=tok_s, ttft_mean_s=1, ttft_p99_s=1,
                    itl_mean_ms=1, itl_p99_ms=1)

    out = io.StringIO()
    with redirect_stdout(out):
        bt.print_table([row("qil", 100.0), row("hf-static", 50.0)], "t")
    assert out.getvalue().splitlines()[-1].endswith("2.00x")


def test_poisson_arrivals_have_the_asked_rate():
    t = bt.arrival_times(4000, 100.0, 0)
    assert 0.009 < statistics.fmean(b - a for a, b in zip(t, t[1:])) < 0.011


def test_prefix_hit_rate_is_cached_over_prompt_tokens(monkeypatch):
    monkeypatch.setattr(qil_worker, "Engine", FakeEngine)
    args = argparse.Namespace(num_pages=1, page_size=16, token_budget=1, prefill_chunk=1, max_active=1,
                              schedule_policy="fcfs", attention="auto", temperature=0, seed=0,
                              request_rate=float("inf"))
    assert bt.run_qil(None, [([1] * 10, 2), ([1] * 20, 3)], args)["prefix_hit_rate"] == 0.5


def test_the_prefix_cache_ratio_printed_is_without_over_with(monkeypatch, tmp_path):
    ttft = {"qil": 0.4, "qil-no-cache": 1.2, "qil-warm": 0.2}
    monkeypatch.setattr(bt, "ensure_model", lambda path, shape: path)
    _no_model(monkeypatch)

    def fake_run(model, requests, args, prefix_cache=True, name="qil", **kwargs):
        return dict(system=name, output_tok_s=1.0, total_tok_s=1.0, ttft_mean_s=ttft[name], ttft_p99_s=1.0,
                    itl_mean_ms=1.0, itl_p99_ms=1.0, prefix_hit_rate=0.5)

    monkeypatch.setattr(bt, "run_qil", fake_run)
    out = io.StringIO()
    with redirect_stdout(out):
        bt.main(["--quick", "--prefix-heavy", "--systems", "qil", "--dtype", "float32",
                 "--model-dir", str(tmp_path)])
    assert "TTFT mean 3.00x lower" in out.getvalue() and "; 6.00x when" in out.getvalue()


def test_prefix_heavy_rounds_report_each_rounds_ratios_and_their_median(monkeypatch, tmp_path):
    ttft = {"qil": iter([0.4, 0.5, 0.3]), "qil-no-cache": iter([1.2, 1.0, 1.5]), "qil-warm": iter([0.2, 0.25, 0.3])}
    monkeypatch.setattr(bt, "ensure_model", lambda path, shape: path)
    _no_model(monkeypatch)

    def fake_run(model, requests, args, prefix_cache=True, name="qil", **kwargs):
        value = 1.0 if len(requests) == 2 else next(ttft[name])  # (the 2-request warm-up run)
        return dict(system=name, output_tok_s=1.0, total_tok_s=1.0, ttft_mean_s=value, ttft_p99_s=1.0,
                    itl_mean_ms=1.0, itl_p99_ms=1.0, prefix_hit_rate=0.5)

    monkeypatch.setattr(bt, "run_qil", fake_run)
    out = io.StringIO()
    report = tmp_path / "report.json"
    with redirect_stdout(out):
        bt.main(["--quick", "--prefix-heavy", "--systems", "qil", "--dtype", "float32", "--rounds", "3",
                 "--model-dir", str(tmp_path), "--json", str(report)])
    text = out.getvalue()
    assert "TTFT mean 3.00x lower" in text and "; 6.00x when" in text  # the first round, as the table
    assert "round 2: cold 2.00x, warm 4.00x" in text and "round 3: cold 5.00x, warm 5.00x" in text
    assert "median TTFT ratio cold 3.00x, warm 5.00x" in text
    cold = [r["cold"] for r in json.loads(report.read_text())["prefix_ttft_ratios"]["float32"]]
    assert cold == pytest.approx([3.0, 2.0, 5.0])


def test_prefix_heavy_needs_the_qil_system_and_a_round(tmp_path):
    for argv in (["--prefix-heavy", "--systems", "hf-static"], ["--prefix-heavy", "--rounds", "0"]):
        with pytest.raises(SystemExit):
            bt.main(["--quick", "--model-dir", str(tmp_path), *argv])


# -- bench_service


def test_service_percentile_is_nearest_rank():
    assert bs.pct([float(i) for i in range(1, 101)], 99) == 99.0


def test_service_ratio_is_best_grpc_round_over_best_in_process_round(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    in_process, over_grpc = iter([100.0, 80.0]), iter([90.0, 70.0])
    monkeypatch.setattr(bs, "load_engine", lambda args, d: types.SimpleNamespace(close=lambda: None))
    server = types.SimpleNamespace(terminate=lambda: None, wait=lambda timeout: 0)
    monkeypatch.setattr(bs, "start_server", lambda args, d: (server, "x", None))
    monkeypatch.setattr(bs, "_closed_loop", lambda engine, args, prompts: {"tokens_per_s": next(in_process)})

    async def fake_grpc(args, target, prompts):
        return {"tokens_per_s": next(over_grpc)}

    monkeypatch.setattr(bs, "run_grpc", fake_grpc)
    out = io.StringIO()
    with redirect_stdout(out):
        bs.main(["--model", str(tmp_path), "--warmup-rounds", "0", "--repeat", "2", "--json"])
    assert json.loads(out.getvalue())["ratio"] == pytest.approx(0.9)


# -- bench_engine


def test_the_median_run_is_kept():
    runs = iter([{"wall": 3}, {"wall": 1}, {"wall": 2}])
    assert be.median_run(lambda: next(runs), 3)[0]["wall"] == 2


def test_qil_runs_make_every_token_as_the_transformers_runs_do(monkeypatch):
    """transformers runs with min_new_tokens=n (EOS masked); qil must too, or a checkpoint that
    emits EOS would make qil's runs shorter and its tok/s look better."""
    asked = []

    class RecordingEngine(FakeEngine):
        def submit(self, prompt, max_new_tokens, **kwargs):
            asked.append(kwargs)
            return super().submit(prompt, max_new_tokens)

    result = be.qil_run(RecordingEngine(None), [[1, 2], [3]], 3)
    assert [kw.get("min_new_tokens") for kw in asked] == [3, 3]
    assert [len(t) for t in result["tokens"]] == [3, 3]


def test_agreement_divides_by_the_reference_length():
    assert be.agreement([[1, 2, 3]], [[1, 2]]) == pytest.approx(2 / 3)


def test_engine_ratios_are_qil_over_transformers(monkeypatch):
    class QuietEngine:
        def __init__(self, model, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(qil_worker, "Engine", QuietEngine)
    _no_model(monkeypatch)
    monkeypatch.setattr(be, "load_hf", lambda path, dtype: object())

    def timings(wall, ttft, decode):
        return lambda model, prompts, n: {"wall": wall, "ttft": [ttft] * len(prompts),
                                          "decode": [decode] * len(prompts), "tokens": [[1] * n] * len(prompts)}

    monkeypatch.setattr(be, "qil_run", timings(1.0, 0.1, 0.4))
    monkeypatch.setattr(be, "hf_run", timings(2.0, 0.2, 0.8))
    args = argparse.Namespace(quantize="none", new_tokens=5, batch=2, prompt_len=4, page_size=16, token_budget=512,
                              prefill_chunk=512, prefix_cache=False, warmup=0, repeat=1)
    r = be.bench_dtype(args, Path("/nonexistent"), "float32", [[1, 2, 3, 4]] * 2)
    assert r["single"]["qil"]["decode_tok_s"] == pytest.approx(10.0)  # 4 gaps after the first token
    assert r["single"]["ratio_ttft"] == pytest.approx(2.0) and r["single"]["ratio_decode"] == pytest.approx(2.0)
    assert r["batch"]["qil"]["output_tok_s"] == pytest.approx(10.0)
    assert r["batch"]["ratio_output_tok_s"] == pytest.approx(2.0)


# -- bench_decode_step


def test_prompt_lengths_spread_from_the_first_to_the_last():
    assert bd.prompt_lengths(3, [5, 40]) == [5, 22, 40] and bd.prompt_lengths(2, [7]) == [7, 7]


def test_a_step_time_is_per_step_not_per_row(monkeypatch):
    monkeypatch.setattr(qil_worker, "Engine", FakeEngine)
    model = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=100))
    assert bd.time_steps(model, 4, [5], 5, None, 16) >= 0.001  # every fake step sleeps 1 ms


def test_the_speed_up_is_plain_over_packed(monkeypatch, tmp_path):
    packed = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"), dtype="f32")
    plain = types.SimpleNamespace(device=packed.device, dtype="f32")
    monkeypatch.setattr(bd, "ensure_model", lambda path, shape: path)
    monkeypatch.setattr(qil_worker.Qwen3, "from_directory",
                        classmethod(lambda cls, *a, pack_weights=True, **k: packed if pack_weights else plain))
    monkeypatch.setattr(bd, "time_steps", lambda model, *a: 0.02 if model is plain else 0.01)
    out = io.StringIO()
    with redirect_stdout(out):
        bd.main(["--batch", "4", "--model-dir", str(tmp_path)])
    assert out.getvalue().splitlines()[-1].split() == ["4", "20.00", "10.00", "200", "400", "2.00x"]
