"""scripts/validate.py end to end on tiny random checkpoints (each run is a fresh interpreter),
and its verdicts on synthetic inputs: default tolerances, the float32 token rule, early EOS, one
bad prompt failing its case, bf16 divergence at a clear choice, and the schedules feeding the
chunks they describe."""

from __future__ import annotations

import importlib.util
import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import make_checkpoint

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "validate.py"
CASES = ("prefill", "decode", "chunked", "generate")
spec = importlib.util.spec_from_file_location("validate", SCRIPT)
validate = importlib.util.module_from_spec(spec)
sys.modules["validate"] = validate
spec.loader.exec_module(validate)


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



def args(**kw):
    return validate.parse_args(["--model", "x", *kw.get("argv", [])])


def test_default_tolerances():
    assert validate.make_tolerance(args(), torch.float32, 64).atol == 1e-4
    assert validate.make_tolerance(args(), torch.float32, 4096).atol == 1e-3
    assert validate.make_tolerance(args(), torch.bfloat16, 64).rel_tol == 2e-2
    assert validate.make_tolerance(args(), torch.float16, 64).rel_tol == 5e-3


def test_float32_argmax_disagreement_within_tolerance_fails():
    tol = validate.make_tolerance(args(), torch.float32, 64)
    ref = torch.tensor([[1.0, 1.00005, 0.0]])
    ours = torch.tensor([[1.00005, 1.0, 0.0]])  # within 1e-4, but the argmax flips
    case = validate.compare_logits("prefill", [ours], [ref], tol)
    assert case["logits_ok"] and not case["tokens_ok"] and not case["passed"]


def test_generation_that_stops_early_at_eos_fails():
    tol = validate.make_tolerance(args(), torch.float32, 64)
    case = validate.compare_generations([[3, 4]], [[3, 4, 5, 6]], [[torch.zeros(8)] * 4], {0}, tol)
    assert not case["passed"] and case["per_prompt"][0]["first_divergence"] == 2  # qil produced fewer tokens


def test_one_bad_prompt_fails_the_case():
    tol = validate.make_tolerance(args(), torch.float32, 64)
    case = validate.compare_generations([[1, 2], [3, 4]], [[1, 9], [3, 4]], [[], []], set(), tol)
    assert not case["passed"]


def test_bf16_divergence_at_a_clear_choice_fails():
    tol = validate.make_tolerance(args(), torch.bfloat16, 64)
    step = torch.tensor([0.0, 10.0, 0.0])
    case = validate.compare_generations([[0]], [[1]], [[step]], set(), tol)
    assert not case["passed"]


def test_schedules_feed_the_chunks_they_describe(tmp_path, monkeypatch):
    model = make_checkpoint(tmp_path / "m")
    seen = {}
    real = validate.run_schedule

    def spy(probe, prompts, chunk_sizes):
        seen.setdefault(len(seen), list(itertools.islice(chunk_sizes(1), 3)))
        return real(probe, prompts, chunk_sizes)

    monkeypatch.setattr(validate, "run_schedule", spy)
    assert validate.main(["--model", str(model), "--cases", "prefill,decode,chunked", "--prompt-lengths", "4,9",
                          "--threads", "1"]) == 0
    assert seen[1] == [1, 1, 1]  # decode: one token per step
    assert seen[2] == [1, 7, 5]  # chunked: the pattern, offset by the prompt index


def test_an_empty_case_list_is_refused_not_a_pass(capsys):
    with pytest.raises(SystemExit) as exit_info:
        validate.parse_args(["--model", "x", "--cases", ","])
    assert exit_info.value.code == 2
    assert "need at least one case" in capsys.readouterr().err
