"""scripts/bench_tools.py runs end to end on the quick model and reports what docs/performance.md
quotes: both ratios against the free run of the same session, and the new tool set's TTFT."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llguidance")
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_tools.py"


def test_tool_benchmark_reports_ratios_and_ttft(tmp_path):
    report = tmp_path / "tools.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--dtype", "float32", "--threads", "1", "--requests", "3",
         "--prompt-len", "8", "--new-tokens", "8", "--repeat", "1", "--ttft-trials", "2",
         "--model-dir", str(tmp_path / "model"), "--tokenizer-dir", str(tmp_path / "tokenizer"),
         "--json", str(report)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(report.read_text())
    for choice in ("required", "auto"):
        row = result[choice]
        assert row["constrained_tok_s"] > 0 and row["free_tok_s"] > 0 and row["ratio"] > 0
        assert row["compile_ms"] > 0
    assert result["ttft"]["new_ms"] > 0 and result["ttft"]["cached_ms"] > 0
    assert "new-tool-set overhead" in proc.stdout
