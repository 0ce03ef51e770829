"""The benchmark scripts run end to end at their --quick sizes (fresh interpreters, tiny model).

They are how speed targets are judged, so a flag combination that crashes them (as
``--quick --prefix-heavy`` did until its prefix fit the tiny model) should fail here, not on
the machine that has a GPU for fifteen minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True, timeout=300,
    )


def test_prefix_heavy_throughput_reports_cold_warm_and_uncached_runs(tmp_path):
    report = tmp_path / "throughput.json"
    proc = run_script(
        "bench_throughput.py", "--quick", "--prefix-heavy", "--systems", "qil", "--dtype", "float32",
        "--threads", "1", "--model-dir", str(tmp_path / "model"), "--json", str(report),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["system"]: r for r in json.loads(report.read_text())["results"]["float32"]}
    assert set(rows) == {"qil", "qil-no-cache", "qil-warm"}
    assert rows["qil-no-cache"]["prefix_hit_rate"] == 0
    # warm: every measured request finds the prefix; cold: the first one computes it
    assert rows["qil-warm"]["prefix_hit_rate"] > rows["qil"]["prefix_hit_rate"] > 0
    assert "prefix cache: TTFT mean" in proc.stdout and "qil-warm" in proc.stdout
    # the device check's one table of every report in its folder
    (tmp_path / "not_a_report.json").write_text("[1, 2]")
    table = run_script("throughput_table.py", str(tmp_path))
    assert table.returncode == 0, table.stdout + table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["run", "system", "out"] and len(lines) == 1 + 3
    by_system = {line.split()[2]: line for line in lines[1:]}
    assert set(by_system) == {"qil", "qil-no-cache", "qil-warm"}
    assert f"{rows['qil']['output_tok_s']:.0f}" in by_system["qil"]


def test_decode_step_compares_two_attention_backends(tmp_path):
    proc = run_script(
        "bench_decode_step.py", "--quick", "--batch", "1", "3", "--steps", "2", "--prompt-len", "5", "40",
        "--attention", "auto", "sdpa", "--model-dir", str(tmp_path / "model"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(row[0]) for row in lines] == [1, 3]
    assert "auto ms" in proc.stdout and "sdpa ms" in proc.stdout


def test_structured_output_benchmark_reports_throughput_ratio_and_ttft(tmp_path):
    report = tmp_path / "structured.json"
    proc = run_script(
        "bench_structured.py", "--quick", "--dtype", "float32", "--threads", "1", "--requests", "3",
        "--prompt-len", "8", "--new-tokens", "8", "--repeat", "1", "--ttft-trials", "2",
        "--model-dir", str(tmp_path / "model"), "--tokenizer-dir", str(tmp_path / "tokenizer"),
        "--json", str(report),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(report.read_text())
    assert result["constrained_tok_s"] > 0 and result["free_tok_s"] > 0 and result["ratio"] > 0
    assert result["ttft_new_ms"] > 0 and result["ttft_cached_ms"] > 0 and result["fill_ms"] > 0
    assert "constrained" in proc.stdout and "new-schema overhead" in proc.stdout


def test_step_parts_times_every_variant_in_one_engine(tmp_path):
    proc = run_script(
        "bench_step_parts.py", "--quick", "--dtype", "float32", "--threads", "1", "--rounds", "2",
        "--steps", "1", "--prompt-len", "20", "--model-dir", str(tmp_path / "model"),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:18].strip(): line[18:].split() for line in proc.stdout.splitlines()[2:]}
    assert list(rows) == ["full", "no norms", "no rope", "no attention", "projections only"]
    assert len(rows["full"]) == 2 and all(len(v) == 4 for name, v in rows.items() if name != "full")
    assert all(float(v[0]) > 0 for v in rows.values())
    # a subset, without the full step to cost the parts against
    proc = run_script(
        "bench_step_parts.py", "--quick", "--dtype", "float32", "--threads", "1", "--rounds", "1",
        "--steps", "1", "--prompt-len", "20", "--model-dir", str(tmp_path / "model"),
        "--variants", "projections only",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:18].strip(): line[18:].split() for line in proc.stdout.splitlines()[2:]}
    assert list(rows) == ["projections only"] and len(rows["projections only"]) == 2


def test_the_hostile_input_run_refuses_every_case_and_leaves_the_server_idle():
    out = run_script("hostile_inputs.py")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| gRPC") or line.startswith("| HTTP")]
    assert len(rows) > 30 and all(row.endswith("| yes | yes |") for row in rows), out.stdout


def test_moe_benchmark_prints_both_systems_and_their_ratios():
    out = run_script("bench_moe.py", "--quick")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "qwen3_moe:" in text and "active per token" in text
    for metric in ("(a) TTFT [ms]", "(a) decode [tok/s]", "(b) x8 output [tok/s]"):
        row = next(line for line in text.splitlines() if line.startswith(metric))
        qil, transformers, ratio = (float(x) for x in row[len(metric):].split())
        assert qil > 0 and transformers > 0 and ratio > 0, row


def test_throughput_runs_a_random_moe_shape_built_in_memory():
    out = run_script("bench_throughput.py", "--quick", "--random-shape", "moe-quick", "--systems", "qil",
                     "--dtype", "float32")
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("qil "))
    assert float(row.split()[1]) > 0  # output tok/s
    refused = run_script("bench_throughput.py", "--quick", "--random-shape", "moe-quick")
    assert refused.returncode == 2 and "--random-shape builds no checkpoint" in refused.stderr


def test_embedding_benchmark_prints_both_systems_and_agrees_with_transformers():
    out = run_script("bench_embed.py", "--quick", "--rounds", "2", "--threads", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    rates = {}
    for system in ("qil", "transformers"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {system} |"))
        rates[system] = float(row.split("|")[2])
        assert rates[system] > 0, row
    assert "ratio qil / transformers (median of rounds):" in text
    cosine = float(text.rsplit("smallest cosine between the systems' embeddings:", 1)[1].split()[0])
    assert cosine > 0.999  # bf16 both sides: the same pooling of the same model


def test_tp_benchmark_reports_each_tp_size_and_its_ranks(tmp_path):
    out = run_script("bench_tp.py", "--quick", "--threads", "1", "--new", "4", "--batch", "2",
                     "--model-dir", str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr[-3000:]
    tp1 = next(line for line in out.stdout.splitlines() if line.startswith("TP 1 "))
    tp2 = next(line for line in out.stdout.splitlines() if line.startswith("TP 2 "))
    assert "rank 0:" in tp1 and "rank 1:" not in tp1
    assert "rank 1:" in tp2 and "all-reduce" in tp2 and float(tp2.split(": ")[1].split()[0]) > 0


def test_compiled_layer_probe_documents_its_flags():
    proc = run_script("bench_compiled_layer.py", "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for flag in ("--batch", "--dtype", "--threads", "--rounds", "--iters", "--linear"):
        assert flag in proc.stdout
    assert all(mode in proc.stdout for mode in ("custom", "mkldnn", "outside", "freezing"))
