"""scripts/validate.py end to end on tiny random checkpoints (each run is a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from checkpoints import make_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "validate.py"
CASES = ("prefill", "decode", "chunked", "generate")


def run_validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--threads", "1", *args],
        capture_output=True, text=True, timeout=120,
    )


def test_validate_passes_on_a_tiny_checkpoint(tiny_dir, tmp_path):
    report_path = tmp_path / "report.json"
    proc = run_validate(
        "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32",
        "--prompt-lengths", "1,5,17,33", "--max-new-tokens", "8", "--output", str(report_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["passed"] is True
    assert set(report["cases"]) == set(CASES)
    for name in ("prefill", "decode", "chunked"):
        case = report["cases"][name]
        assert case["passed"] and case["logits_ok"] and case["tokens_ok"], (name, case)
        assert case["token_agreement"] == 1.0
        assert case["positions"] == 1 + 5 + 17 + 33
        assert case["max_abs_err"] <= case["tolerance"]
    gen = report["cases"]["generate"]
    assert gen["passed"] and gen["token_agreement"] == 1.0
    assert [len(p["qil_tokens"]) for p in gen["per_prompt"]] == [8, 8, 8, 8]  # no EOS in tiny config


def test_validate_fails_against_different_weights(tiny_dir, tmp_path):
    other = make_checkpoint(tmp_path / "other", seed=123)
    report_path = tmp_path / "report.json"
    proc = run_validate(
        "--model", str(tiny_dir), "--reference", str(other), "--cases", "prefill,generate",
        "--prompt-lengths", "4,9", "--max-new-tokens", "4", "--output", str(report_path),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["passed"] is False
    assert not report["cases"]["prefill"]["logits_ok"]
    assert set(report["cases"]) == {"prefill", "generate"}


def test_validate_reports_a_bad_model_directory_in_one_line(tmp_path):
    proc = run_validate("--model", str(tmp_path))
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr and "Traceback" not in proc.stderr
