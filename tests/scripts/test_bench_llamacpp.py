"""bench_llamacpp.py's handling of a llama.cpp tool that crashes with repacked weights: run
again without repacking, and said in the report (real child processes, no llama.cpp needed);
its Qwen3-MoE mode's defaults and targets."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_llamacpp as bl  # noqa: E402

# a stand-in tool: killed by SIGSEGV unless repacking is off, as llama.cpp's q8_0 is on some CPUs
CRASHES_WITH_REPACK = [sys.executable, "-c",
                       "import os, signal, sys; print('ran', *sys.argv[1:]); "
                       "'0' in sys.argv or os.kill(os.getpid(), signal.SIGSEGV)"]


def test_a_tool_that_crashes_with_repacked_weights_runs_again_without():
    runner = bl.LlamaRunner()
    r = runner.run("prefill", CRASHES_WITH_REPACK, ["--repack", "0"])
    assert r.stdout.strip() == "ran --repack 0"
    assert runner.fallbacks == ["prefill"]
    fine = runner.run("decode b=1", [sys.executable, "-c", "print('ran')"], ["--repack", "0"])
    assert fine.stdout.strip() == "ran" and runner.fallbacks == ["prefill"]


def test_a_tool_that_fails_without_crashing_is_an_error_not_a_fallback():
    runner = bl.LlamaRunner()
    with pytest.raises(RuntimeError, match="failed"):
        runner.run("prefill", [sys.executable, "-c", "raise SystemExit(2)"], ["--repack", "0"])
    assert runner.fallbacks == []
    assert bl.killed_by_signal(-11) and bl.killed_by_signal(139) and not bl.killed_by_signal(2)


def test_the_report_names_what_ran_without_repacking():
    args = argparse.Namespace(dtypes=["int8"], prompt_len=128, model="dense")
    rates = {"prefill": [179.0], "decode1": [20.6], "decode1_batched": [20.3], "decode8": [66.6],
             "decode16": [82.9], "decode1_no_prompt": [41.3]}
    results = {"llama.cpp q8_0": rates, "qil int8": {"prefill": [378.0], "decode1": [17.9], "decode8": [59.1],
                                                      "decode16": [66.6]}}
    text = bl.report(results, args, True, {"int8": {"without_repack": ["prefill", "decode b=1"]}})
    assert "q8_0 crashed with its repacked weights in prefill, decode b=1" in text
    assert "Repacked decode b=1 without a prompt: 41.3" in text
    assert "crashed" not in bl.report(results, args, True, {"int8": {"without_repack": []}})


def test_the_moe_mode_sizes_its_tokenizer_to_the_model_and_judges_batch_8():
    from bench_structured import QWEN3_SPECIALS

    args = bl.parse_args(["--model", "moe"])
    assert args.dtypes == ["bf16", "int8"]  # no f32 copy of a 5 GB model beside qil's
    assert args.model_dir.name == "bench-qwen3-moe-4l"
    regular = bl.regular_tokens(bl.MOE_SHAPE)
    assert regular + len(QWEN3_SPECIALS) == bl.MOE_SHAPE["vocab_size"]  # every id the model has
    assert args.tokenizer_dir.name == f"bench-tokenizer-{regular}"
    assert bl.parse_args([]).tokenizer_dir.name == "bench-tokenizer-151643"  # dense: Qwen3's own
    rates = {"prefill": [100.0, 110.0], "decode1": [10.0, 12.0], "decode8": [40.0, 44.0], "decode16": [50.0, 50.0]}
    faster = {k: [v * 1.1 for v in vs] for k, vs in rates.items()}
    slower = {k: [v * 0.8 for v in vs] for k, vs in rates.items()}
    for qil, verdict in ((faster, "meets"), (slower, "below")):
        text = bl.report({"llama.cpp bf16": rates, "qil bf16": qil}, bl.parse_args(["--model", "moe", "--dtypes", "bf16"]),
                         True)
        (b8,) = [line for line in text.splitlines() if line.startswith("| bf16 b=8 ")]
        assert "≥ 1.0" in b8 and b8.rstrip(" |").endswith(verdict), b8
        (b1,) = [line for line in text.splitlines() if line.startswith("| bf16 b=1 ")]
        assert "report" in b1 and "meets" not in b1 and "below" not in b1, b1


def test_int4_rows_pair_qil_int4_with_llama_quantize_q4_files(tmp_path):
    args = bl.parse_args(["--dtypes", "int4-km", "int4", "bf16"])
    assert args.dtypes == ["bf16", "int4", "int4-km"]  # GGUF_TYPES' order
    assert bl.parse_args([]).dtypes == ["fp32", "bf16", "int8"]  # int4 is opt-in
    assert bl.QIL_QUANTIZE["int4"] == bl.QIL_QUANTIZE["int4-km"] == "int4"
    llama = bl.LlamaCpp(src=tmp_path, bin_dir=tmp_path / "bin", package="p", commit=None)
    cmd = bl.quantize_command(llama, tmp_path / "m-bf16.gguf", tmp_path / "m-q4_0.gguf", "q4_0", 2)
    assert cmd == [str(tmp_path / "bin" / "llama-quantize"), str(tmp_path / "m-bf16.gguf"),
                   str(tmp_path / "m-q4_0.gguf"), "Q4_0", "2"]
    assert bl.quantize_command(llama, tmp_path / "a", tmp_path / "b", "q4_k_m", 1)[3] == "Q4_K_M"
    rates = {"prefill": [100.0], "decode1": [20.0], "decode8": [60.0], "decode16": [70.0]}
    results = {"llama.cpp q4_0": rates, "qil int4": {k: [v[0] * 0.5] for k, v in rates.items()},
               "llama.cpp q4_k_m": rates, "qil int4-km": {k: [v[0] * 2] for k, v in rates.items()}}
    text = bl.report(results, argparse.Namespace(dtypes=["int4", "int4-km"], prompt_len=128, model="dense"), True)
    (q40,) = [line for line in text.splitlines() if line.startswith("| int4 b=1 ÷ q4_0 ")]
    (km,) = [line for line in text.splitlines() if line.startswith("| int4 b=1 ÷ Q4_K_M ")]
    assert "0.50" in q40 and "2.00" in km and "report" in q40
    assert "llama.cpp q4_0" in text and "qil int4-km" in text
    with pytest.raises(SystemExit):
        bl.parse_args(["--dtypes", "int3"])
