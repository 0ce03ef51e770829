#!/usr/bin/env python
"""qil against llama.cpp on the CPU: the same random Qwen3-0.6B-shaped checkpoint, one run.

llama.cpp comes from the ``llama-cpp-python`` source distribution on the package index (it
vendors llama.cpp with its converter and gguf-py): downloaded once with pip, unpacked and built
under ``~/.cache/qil/llamacpp`` (cmake, CPU only, GGML_NATIVE, Release, only the tools used).
bench_engine.py's checkpoint (random weights, Qwen3-0.6B's shapes) is converted to GGUF f32,
bf16 and q8_0 by llama.cpp's own ``convert_hf_to_gguf.py``, with bench_structured.py's locally
trained Qwen-style tokenizer beside it (no download). The converter runs in a small venv under
the cache (sentencepiece, requests) that borrows torch, transformers and numpy from this
interpreter's site-packages through PYTHONPATH; the locally trained vocabulary does not hash to
any known pre-tokenizer, so it is named "qwen2" (its split regex is Qwen2's) when, and only
when, the converter's own detection gives up.

Measured, per dtype pair (qil fp32 / llama.cpp f32, bf16 / bf16, int8 / q8_0), with --threads
threads on both sides (default 2), random prompt tokens:

  prefill 128   tokens/s of one --prompt-len prompt from an empty cache. llama.cpp:
                ``llama-bench -p 128 -n 0``; qil: submit → first token of one request.
  decode b=1    tokens/s of --new-tokens tokens after a --prompt-len prompt. llama.cpp:
                ``llama-bench -p 0 -n N -d 128``; qil: N engine steps after the prefill.
  decode b=8/16 tokens/s counting every row: B prompts prefilled, then N steps of B tokens.
                llama.cpp: ``llama-batched-bench -npp 128 -ntg N -npl 1,8,16 -pps`` (S_TG; the
                prompt is prefilled once and copied to every row's own cache, which the timed
                steps do not see but which saves the untimed prefill of B prompts); qil: the
                engine (in-process, as bench_engine.py) with all B prompts prefilled in one step.
                llama-batched-bench's own b=1 is printed as a cross-check of llama-bench's.

qil int8 runs only where ``Qwen3.from_directory`` takes ``quantize=`` (else "n/a"). Rounds
alternate the engines (llama.cpp first in even rounds, qil first in odd ones), so machine drift
hits both; the table gives medians and ranges over rounds, the ratios (qil ÷ llama.cpp, > 1:
qil faster) are taken round by round, from measurements minutes apart at most.

``--model moe`` runs the same comparison on bench_moe.py's random Qwen3-MoE (Qwen3-30B-A3B's
experts, width and heads in 4 layers, a 16,384-token vocabulary; llama.cpp's ``qwen3moe``),
with a locally trained tokenizer of that vocabulary beside it; its default dtypes are bf16 and
int8 (an f32 copy of its 5 GB would not fit beside qil's on a 24 GB machine) and its targets
are issue 30's: batch 8 at least llama.cpp's, batch 1 reported.

    python scripts/bench_llamacpp.py                          # build/convert once, 3 rounds
    python scripts/bench_llamacpp.py --dtypes bf16 int8 --compile-decode   # qil b=1 compiled
    python scripts/bench_llamacpp.py --rounds 1 --new-tokens 16 --dtypes bf16   # quick look
    python scripts/bench_llamacpp.py --model moe              # Qwen3-MoE: bf16 and int8
    python scripts/bench_llamacpp.py --dtypes int4 int4-km    # qil int4 vs q4_0 and Q4_K_M
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import FULL_SHAPE, ensure_model  # noqa: E402
from bench_moe import FULL_SHAPE as MOE_SHAPE, ensure_moe_model  # noqa: E402

CACHE = Path.home() / ".cache" / "qil"
LLAMA_CACHE = CACHE / "llamacpp"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize")
# qil dtype -> its llama.cpp peer; "int4-km" is qil int4 again, measured against Q4_K_M
GGUF_TYPES = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int4": "q4_0", "int4-km": "q4_k_m"}
QIL_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": None, "int4": None, "int4-km": None}
# quantized qil dtypes -> their --quantize (activations in --int8-compute)
QIL_QUANTIZE = {"int8": "int8", "int4": "int4", "int4-km": "int4"}
# GGUF types convert_hf_to_gguf.py cannot write: llama-quantize makes them from the bf16 file
QUANTIZED_GGUF = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}
BATCHES = (8, 16)
CONVERTER_DEPS = ("sentencepiece", "requests")  # what the converter imports beyond torch/transformers/numpy


# --------------------------------------------------------------------------------------------
# pure helpers: parsing llama.cpp's output, statistics, the table
# --------------------------------------------------------------------------------------------


def parse_llama_bench(text: str) -> dict[tuple[int, int, int], float]:
    """``llama-bench -o json`` output → {(n_prompt, n_gen, n_depth): mean tokens/s}."""
    return {(r["n_prompt"], r["n_gen"], r.get("n_depth", 0)): float(r["avg_ts"]) for r in json.loads(text)}


def parse_batched_bench(text: str) -> dict[int, dict]:
    """``llama-batched-bench --output-format jsonl`` output → {batch: record}; lines that are
    not JSON records (logs) are skipped."""
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            record = json.loads(line)
            out[int(record["pl"])] = record
    return out


def changelog_commit(changelog: str) -> str | None:
    """The llama.cpp commit llama-cpp-python's newest changelog entry vendors."""
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", changelog)
    return m.group(1) if m else None


def spread(values: list[float]) -> str:
    """'median (min–max)', or the value alone for one round, or 'n/a'."""
    if not values:
        return "n/a"
    fmt = (lambda v: f"{v:.0f}") if statistics.median(values) >= 100 else (lambda v: f"{v:.1f}")
    med = fmt(statistics.median(values))
    return med if len(values) == 1 else f"{med} ({fmt(min(values))}–{fmt(max(values))})"


def ratio_spread(values: list[float]) -> str:
    if not values:
        return "n/a"
    med = f"{statistics.median(values):.2f}"
    return med if len(values) == 1 else f"{med} ({min(values):.2f}–{max(values):.2f})"


def paired_ratios(num: list[float], den: list[float]) -> list[float]:
    """Round-by-round num/den (both lists are indexed by round)."""
    return [a / b for a, b in zip(num, den) if b > 0]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, first column left-aligned, the others right-aligned."""
    align = ["---"] + ["---:"] * (len(header) - 1)
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


# --------------------------------------------------------------------------------------------
# llama.cpp: source, build, conversion
# --------------------------------------------------------------------------------------------


@dataclass
class LlamaCpp:
    src: Path  # vendor/llama.cpp inside the unpacked sdist
    bin_dir: Path
    package: str  # e.g. "llama_cpp_python-0.3.36"
    commit: str | None

    def tool(self, name: str) -> Path:
        return self.bin_dir / name


def say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def find_sdist(version: str | None) -> Path:
    """The unpacked llama-cpp-python sdist in the cache: download and unpack it if missing."""
    LLAMA_CACHE.mkdir(parents=True, exist_ok=True)
    pattern = f"llama_cpp_python-{version}" if version else "llama_cpp_python-*"
    unpacked = sorted(p for p in LLAMA_CACHE.glob(pattern) if (p / "vendor" / "llama.cpp").is_dir())
    if unpacked:
        return unpacked[-1]
    tarballs = sorted(LLAMA_CACHE.glob(pattern + ".tar.gz"))
    if not tarballs:
        spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
        say(f"downloading the {spec} source distribution into {LLAMA_CACHE} ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        spec, "-d", str(LLAMA_CACHE)], check=True)
        tarballs = sorted(LLAMA_CACHE.glob(pattern + ".tar.gz"))
        if not tarballs:
            raise SystemExit(f"pip download left no {pattern}.tar.gz in {LLAMA_CACHE}")
    say(f"unpacking {tarballs[-1].name}")
    with tarfile.open(tarballs[-1]) as tar:
        tar.extractall(LLAMA_CACHE, filter="data")
    return find_sdist(version)


def ensure_llamacpp(args) -> LlamaCpp:
    """llama.cpp's tools, built once under the cache (or taken from --llama-bin)."""
    sdist = find_sdist(args.llama_version)
    src = sdist / "vendor" / "llama.cpp"
    changelog = sdist / "CHANGELOG.md"
    commit = changelog_commit(changelog.read_text()) if changelog.exists() else None
    if args.llama_bin:
        llama = LlamaCpp(src, args.llama_bin, sdist.name, commit)
        say(f"llama.cpp tools from {args.llama_bin} (--llama-bin), converter from {src}")
    else:
        build = LLAMA_CACHE / f"build-{sdist.name.removeprefix('llama_cpp_python-')}-native"
        llama = LlamaCpp(src, build / "bin", sdist.name, commit)
        missing = [t for t in TOOLS if not llama.tool(t).exists()]
        if missing and args.skip_build:
            raise SystemExit(f"--skip-build: {', '.join(missing)} not built in {build}")
        if missing:
            build_tools(src, build, commit, args.jobs)
        else:
            say(f"found llama.cpp tools in {llama.bin_dir} (built before)")
    for t in TOOLS:
        if not llama.tool(t).exists():
            raise SystemExit(f"{llama.tool(t)} does not exist")
    say(f"llama.cpp {commit or 'unknown commit'} as vendored by {sdist.name}")
    return llama


def build_tools(src: Path, build: Path, commit: str | None, jobs: int) -> None:
    """CPU-only native Release build of just the tools this script runs."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        "cmake", "-S", str(src), "-B", str(build), *generator, "-DCMAKE_BUILD_TYPE=Release",
        "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
        "-DGGML_VULKAN=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
        # the sdist carries no git metadata: record the vendored commit in the tools' output
        *([f"-DLLAMA_BUILD_COMMIT={commit}"] if commit else []),
    ]
    say(f"building {', '.join(TOOLS)} in {build} with -j{jobs} (minutes) ...")
    t = time.perf_counter()
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", *TOOLS, f"-j{jobs}"], check=True,
                   stdout=subprocess.DEVNULL)
    say(f"built llama.cpp in {time.perf_counter() - t:.0f}s")


# The converter, with one fallback: a vocabulary whose pre-tokenizer it cannot identify by hash
# (ours is trained locally, so its token ids hash to nothing known) is named "qwen2" — its
# split regex is Qwen2's — instead of stopping the conversion.
CONVERTER_SHIM = """
import runpy, sys
convert = sys.argv[1]
sys.argv = [convert] + sys.argv[2:]
from conversion.base import TextModel
detect = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return detect(self, tokenizer)
    except NotImplementedError:
        print("bench: pre-tokenizer not recognised by hash; using qwen2 (same split regex)", file=sys.stderr)
        return "qwen2"
TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(convert, run_name="__main__")
"""


def converter_python() -> Path:
    """A small venv with the converter's extra imports; torch & co. come from PYTHONPATH."""
    venv = LLAMA_CACHE / "convert-venv"
    python = venv / "bin" / "python"
    probe = "import " + ", ".join(CONVERTER_DEPS)
    if python.exists() and subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0:
        return python
    say(f"creating the converter's venv {venv} ({', '.join(CONVERTER_DEPS)})")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *CONVERTER_DEPS], check=True)
    return python


def staged_checkpoint(model_dir: Path, tokenizer_dir: Path) -> Path:
    """The checkpoint with the tokenizer beside it (symlinks), as the converter wants it."""
    stage = LLAMA_CACHE / f"hf-{model_dir.name}"
    stage.mkdir(parents=True, exist_ok=True)
    for source in [*model_dir.iterdir(), *tokenizer_dir.iterdir()]:
        link = stage / source.name
        if link.is_symlink() or link.exists():
            if link.resolve() == source.resolve():
                continue
            link.unlink()
        link.symlink_to(source.resolve())
    return stage


def quantize_command(llama: LlamaCpp, source: Path, out: Path, outtype: str, threads: int) -> list[str]:
    """llama.cpp's own ``llama-quantize SOURCE OUT TYPE THREADS`` for a ``QUANTIZED_GGUF`` type."""
    return [str(llama.tool("llama-quantize")), str(source), str(out), QUANTIZED_GGUF[outtype], str(threads)]


def ensure_gguf(llama: LlamaCpp, model_dir: Path, tokenizer_dir: Path, outtype: str, skip: bool,
                threads: int = 2) -> Path:
    out = LLAMA_CACHE / "gguf" / f"{model_dir.name}-{outtype}.gguf"
    newest_source = max(f.stat().st_mtime for f in [*model_dir.iterdir(), *tokenizer_dir.iterdir()])
    if out.exists() and out.stat().st_mtime >= newest_source:
        return out
    if skip:
        raise SystemExit(f"--skip-build: {out} was not converted")
    if outtype in QUANTIZED_GGUF:
        source = ensure_gguf(llama, model_dir, tokenizer_dir, "bf16", skip, threads)
        partial = out.with_name(out.name + ".partial")
        say(f"quantizing {source.name} to {QUANTIZED_GGUF[outtype]} with llama-quantize ...")
        log = out.with_suffix(".log")
        with log.open("w") as f:
            r = subprocess.run(quantize_command(llama, source, partial, outtype, threads), stdout=f,
                               stderr=subprocess.STDOUT)
        if r.returncode != 0:
            raise SystemExit(f"llama-quantize failed ({r.returncode}); its log {log} ends:\n" + log.read_text()[-3000:])
        partial.rename(out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = staged_checkpoint(model_dir, tokenizer_dir)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(llama.src / "gguf-py"), str(llama.src), sysconfig.get_paths()["purelib"]])
    partial = out.with_name(out.name + ".partial")
    say(f"converting {model_dir.name} to GGUF {outtype} with {llama.src / 'convert_hf_to_gguf.py'} ...")
    t = time.perf_counter()
    log = out.with_suffix(".log")
    with log.open("w") as f:
        r = subprocess.run([str(converter_python()), "-c", CONVERTER_SHIM, str(llama.src / "convert_hf_to_gguf.py"),
                            str(stage), "--outtype", outtype, "--outfile", str(partial)],
                           env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed ({r.returncode}); its log {log} ends:\n"
                         + log.read_text()[-3000:])
    partial.rename(out)
    say(f"{out.name}: {out.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t:.0f}s (log {log})")
    return out


# --------------------------------------------------------------------------------------------
# llama.cpp: measurements
# --------------------------------------------------------------------------------------------


def killed_by_signal(returncode: int) -> bool:
    """A tool that crashed (a signal: negative from subprocess, or 128 + n through a shell)."""
    return returncode < 0 or returncode > 128


class LlamaRunner:
    """Runs llama.cpp's tools with weight repacking (its default, the fast layouts for this CPU)
    and falls back to ``--repack 0`` for a tool whose repacked run crashes: llama.cpp 0c1e57098's
    repacked q8_0 kernels segfault on prompt processing on some CPUs (seen on a Xeon with AMX).
    ``fallbacks`` names what ran without repacking, for the report."""

    def __init__(self) -> None:
        self.fallbacks: list[str] = []

    def run(self, what: str, cmd: list[str], no_repack: list[str]) -> subprocess.CompletedProcess:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if killed_by_signal(r.returncode):
            say(f"  llama.cpp {what} crashed with repacked weights ({r.returncode}); again with {' '.join(no_repack)}")
            self.fallbacks.append(what)
            r = subprocess.run(cmd + no_repack, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return r


def llamacpp_round(llama: LlamaCpp, gguf: Path, args) -> tuple[dict[str, float], dict]:
    """One round of llama.cpp's measurements on one GGUF file: {metric: tok/s}, raw records."""
    threads = str(args.threads)
    bench = [str(llama.tool("llama-bench")), "-m", str(gguf), "-t", threads, "-r", str(args.llama_reps),
             "-o", "json"]
    runner = LlamaRunner()
    pp_text = runner.run("prefill", bench + ["-p", str(args.prompt_len), "-n", "0"], ["--repack", "0"]).stdout
    tg_text = runner.run("decode b=1", bench + ["-p", "0", "-n", str(args.new_tokens), "-d", str(args.prompt_len)],
                         ["--repack", "0"]).stdout
    pp = parse_llama_bench(pp_text)[(args.prompt_len, 0, 0)]
    tg = parse_llama_bench(tg_text)[(0, args.new_tokens, args.prompt_len)]
    batches = (1, *BATCHES)
    ctx = max(batches) * (args.prompt_len + args.new_tokens)
    r = runner.run("batched decode", [
        str(llama.tool("llama-batched-bench")), "-m", str(gguf), "-t", threads, "-tb", threads,
        "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(args.prompt_len),
        "-ntg", str(args.new_tokens), "-npl", ",".join(map(str, batches)), "-pps", "--output-format", "jsonl",
    ], ["--no-repack"])
    batched = parse_batched_bench(r.stdout + r.stderr)  # where its log lines go depends on the build
    missing = [b for b in batches if b not in batched]
    if missing:
        raise RuntimeError(f"llama-batched-bench gave no record for batch {missing} (context {ctx})")
    rates = {"prefill": pp, "decode1": tg, "decode1_batched": batched[1]["speed_tg"]}
    rates.update({f"decode{b}": batched[b]["speed_tg"] for b in BATCHES})
    if runner.fallbacks:  # what repacked decoding reaches where no prompt comes first (cross-check)
        empty = runner.run("decode b=1 without a prompt", bench + ["-p", "0", "-n", str(args.new_tokens)],
                           ["--repack", "0"]).stdout
        rates["decode1_no_prompt"] = parse_llama_bench(empty)[(0, args.new_tokens, 0)]
    meta = json.loads(pp_text)[0]
    return rates, {**{k: meta.get(k) for k in ("build_commit", "build_number", "cpu_info", "model_type",
                                               "model_size", "n_threads", "type_k", "flash_attn")},
                   "without_repack": runner.fallbacks}


# --------------------------------------------------------------------------------------------
# qil: measurements (the Engine in-process)
# --------------------------------------------------------------------------------------------


def int8_supported() -> bool:
    from qil_worker import Qwen3

    return "quantize" in inspect.signature(Qwen3.from_directory).parameters


def load_qil(model_dir: Path, dtype: str, args):
    import torch
    from qil_worker import Qwen3

    if dtype in QIL_QUANTIZE:
        return Qwen3.from_directory(model_dir, device="cpu", dtype=getattr(torch, args.int8_compute),
                                    quantize=QIL_QUANTIZE[dtype])
    return Qwen3.from_directory(model_dir, device="cpu", dtype=getattr(torch, QIL_DTYPES[dtype]))


def qil_engine(model, args):
    from qil_worker import Engine

    rows = max(BATCHES)
    pages = rows * -(-(args.prompt_len + args.new_tokens + 1) // args.page_size) + 8
    # all rows' prompts in one step, so every decode step carries the whole batch; the prefix
    # cache off: prompts differ anyway, and llama.cpp's tools never reuse a prefix either
    return Engine(model, num_pages=pages, page_size=args.page_size, token_budget=rows * args.prompt_len,
                  prefill_chunk=args.prompt_len, max_active=rows, prefix_cache=False,
                  compile_decode=args.compile_decode)


def qil_prefill(engine, prompt: list[int]) -> float:
    """Tokens/s of one prompt: submit → its first token on the host."""
    t0 = time.perf_counter()
    rid = engine.submit(prompt, max_new_tokens=1, ignore_eos=True)
    while True:
        events = engine.step()
        if any(e.token_id is not None for e in events):
            break
    elapsed = time.perf_counter() - t0
    while not engine.idle:
        engine.step()
    engine.release(rid)
    return len(prompt) / elapsed


def qil_decode(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens/s counting every row: all prompts prefilled, then ``new_tokens`` timed steps."""
    ids = [engine.submit(p, max_new_tokens=new_tokens + 1, ignore_eos=True) for p in prompts]
    made = dict.fromkeys(ids, 0)
    while not all(made.values()):
        for e in engine.step():
            if e.error:
                raise RuntimeError(f"qil request {e.request_id} failed: {e.error}")
            if e.token_id is not None:
                made[e.request_id] += 1
    if any(n != 1 for n in made.values()):
        raise RuntimeError("the prompts did not all prefill in one step (token budget)")
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        events = engine.step()
        if sum(e.token_id is not None for e in events) != len(ids):
            raise RuntimeError(f"a decode step did not carry all {len(ids)} rows")
    elapsed = time.perf_counter() - t0
    for i in ids:
        engine.release(i)
    return len(ids) * new_tokens / elapsed


def qil_round(engine, prompts: list[list[int]], args) -> dict[str, float]:
    rates = {"prefill": qil_prefill(engine, prompts[0]), "decode1": qil_decode(engine, prompts[:1], args.new_tokens)}
    rates.update({f"decode{b}": qil_decode(engine, prompts[:b], args.new_tokens) for b in BATCHES})
    return rates


def qil_warmup(engine, prompts: list[list[int]]) -> None:
    qil_prefill(engine, prompts[0])
    for b in (1, *BATCHES):
        qil_decode(engine, prompts[:b], 2)


# --------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------

ROWS = [("prefill", "prefill {p}"), ("decode1", "decode b=1"), ("decode8", "decode b=8, all rows"),
        ("decode16", "decode b=16, all rows")]
# (label, qil dtype, metric, target qil/llama.cpp): the targets of issue 21
RATIOS = [
    ("int8 b=1 ÷ q8_0", "int8", "decode1", 1.0),
    ("bf16 b=1", "bf16", "decode1", 1.0),
    ("fp32 b=1", "fp32", "decode1", 1.0),
    ("fp32 b=8", "fp32", "decode8", 1.0),
    ("bf16 b=8", "bf16", "decode8", 1.2),
    ("bf16 b=16", "bf16", "decode16", 1.2),
    ("prefill fp32", "fp32", "prefill", 1.0),
    ("prefill bf16", "bf16", "prefill", 1.0),
    ("prefill int8 ÷ q8_0", "int8", "prefill", 1.0),
    ("int4 b=1 ÷ q4_0", "int4", "decode1", None),
    ("int4 b=8 ÷ q4_0", "int4", "decode8", None),
    ("prefill int4 ÷ q4_0", "int4", "prefill", None),
    ("int4 b=1 ÷ Q4_K_M", "int4-km", "decode1", None),
    ("int4 b=8 ÷ Q4_K_M", "int4-km", "decode8", None),
    ("prefill int4 ÷ Q4_K_M", "int4-km", "prefill", None),
]


# the MoE's targets (issue 30): batch 8 at least llama.cpp's; batch 1 and prefill reported
MOE_RATIOS = [
    ("bf16 b=8", "bf16", "decode8", 1.0),
    ("int8 b=8 ÷ q8_0", "int8", "decode8", 1.0),
    ("bf16 b=16", "bf16", "decode16", None),
    ("int8 b=16 ÷ q8_0", "int8", "decode16", None),
    ("bf16 b=1", "bf16", "decode1", None),
    ("int8 b=1 ÷ q8_0", "int8", "decode1", None),
    ("prefill bf16", "bf16", "prefill", None),
    ("prefill int8 ÷ q8_0", "int8", "prefill", None),
]
# per --model: the checkpoint's shape, its writer, its default directory and dtypes, its targets
MODELS = {
    "dense": (FULL_SHAPE, ensure_model, "bench-qwen3-0.6b-shape", ["fp32", "bf16", "int8"], RATIOS),
    "moe": (MOE_SHAPE, ensure_moe_model, "bench-qwen3-moe-4l", ["bf16", "int8"], MOE_RATIOS),
}


def report(results: dict[str, dict[str, list[float]]], args, int8: bool, meta: dict[str, dict] | None = None) -> str:
    """The table and the ratios, as markdown; ``meta``: llama.cpp's records per dtype (which
    tools ran without weight repacking)."""
    columns = [f"llama.cpp {GGUF_TYPES[d]}" for d in args.dtypes] + [f"qil {d}" for d in args.dtypes]
    rows = []
    for metric, label in ROWS:
        cells = [spread(results.get(c, {}).get(metric, [])) for c in columns]
        rows.append([label.format(p=args.prompt_len), *cells])
    cross = [spread(results.get(f"llama.cpp {GGUF_TYPES[d]}", {}).get("decode1_batched", [])) for d in args.dtypes]
    out = [markdown_table(["tok/s", *columns], rows), "",
           "llama-batched-bench's own b=1 (cross-check of llama-bench's): "
           + ", ".join(f"{GGUF_TYPES[d]} {c}" for d, c in zip(args.dtypes, cross)), ""]
    for d, record in (meta or {}).items():
        if record.get("without_repack"):
            empty = spread(results.get(f"llama.cpp {GGUF_TYPES[d]}", {}).get("decode1_no_prompt", []))
            out.insert(len(out) - 1, f"llama.cpp {GGUF_TYPES[d]} crashed with its repacked weights in "
                       f"{', '.join(record['without_repack'])}; those ran with repacking off (slower). "
                       f"Repacked decode b=1 without a prompt: {empty}")
    ratio_rows = []
    for label, dtype, metric, target in MODELS[args.model][4]:
        if dtype not in args.dtypes:
            continue
        qil = results.get(f"qil {dtype}", {}).get(metric, [])
        ref = results.get(f"llama.cpp {GGUF_TYPES[dtype]}", {}).get(metric, [])
        r = paired_ratios(qil, ref)
        if target is None:
            ratio_rows.append([label, "report", ratio_spread(r), ""])
            continue
        verdict = "n/a" if not r else ("meets" if statistics.median(r) >= target else "below")
        ratio_rows.append([label, f"≥ {target:.1f}", ratio_spread(r), verdict])
    out.append(markdown_table(["qil ÷ llama.cpp (per round)", "target", "median (range)", ""], ratio_rows))
    if "int8" in args.dtypes and not int8:
        out.append("\nqil int8: n/a (Qwen3.from_directory takes no quantize= here)")
    return "\n".join(out)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of both engines (default %(default)s)")
    p.add_argument("--model", default="dense", choices=list(MODELS),
                   help="dense: Qwen3-0.6B's shape; moe: bench_moe.py's Qwen3-MoE (default %(default)s)")
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(GGUF_TYPES),
                   help="qil dtypes, each against its llama.cpp peer f32/bf16/q8_0/q4_0/Q4_K_M (int4-km: "
                        "qil int4 against Q4_K_M; q4 files made by llama-quantize from the bf16 GGUF) "
                        "(default: fp32 bf16 int8; bf16 and int8 with --model moe)")
    p.add_argument("--engines", nargs="+", default=["llama.cpp", "qil"], choices=["llama.cpp", "qil"],
                   help="measure only some engines (default: both)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64, help="timed decode steps (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads and llama.cpp -t (default %(default)s)")
    p.add_argument("--int8-compute", default="bfloat16", choices=["bfloat16", "float32"],
                   help="qil int8's activation dtype (default %(default)s)")
    p.add_argument("--llama-reps", type=int, default=1,
                   help="llama-bench -r: its repetitions per round, averaged (default %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="qil KV page size (default %(default)s)")
    p.add_argument("--compile-decode", action="store_true",
                   help="qil's batch-1 decode steps through the model's compiled forward (Engine compile_decode)")
    p.add_argument("--seed", type=int, default=0, help="prompt tokens (default %(default)s)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="the random checkpoint, made once by bench_engine.ensure_model (bench_moe's "
                        "ensure_moe_model with --model moe); default ~/.cache/qil/bench-qwen3-0.6b-shape "
                        "(bench-qwen3-moe-4l)")
    p.add_argument("--tokenizer-dir", type=Path, default=None,
                   help="tokenizer for the GGUF files, trained once by bench_structured.ensure_tokenizer "
                        "with the model's vocabulary (default ~/.cache/qil/bench-tokenizer-<regular tokens>)")
    p.add_argument("--llama-version", default=None,
                   help="llama-cpp-python version whose vendored llama.cpp to use (default: the one in "
                        "the cache, else the newest on the index)")
    p.add_argument("--llama-bin", type=Path, default=None,
                   help="use llama-bench and llama-batched-bench from this directory instead of building")
    p.add_argument("--skip-build", action="store_true",
                   help="never build llama.cpp or convert GGUF files: fail if they are not in the cache")
    p.add_argument("--jobs", type=int, default=2, help="parallel build jobs (default %(default)s)")
    p.add_argument("--json", type=Path, default=None, help="also write every round's figures here")
    args = p.parse_args(argv)
    if min(args.rounds, args.prompt_len, args.new_tokens, args.threads, args.llama_reps) < 1:
        p.error("--rounds, --prompt-len, --new-tokens, --threads and --llama-reps must be >= 1")
    shape, _, directory, dtypes, _ = MODELS[args.model]
    args.dtypes = [d for d in GGUF_TYPES if d in (args.dtypes or dtypes)]
    args.model_dir = args.model_dir or CACHE / directory
    args.tokenizer_dir = args.tokenizer_dir or CACHE / f"bench-tokenizer-{regular_tokens(shape)}"
    return args


def regular_tokens(shape: dict) -> int:
    """The tokenizer's regular vocabulary for ``shape``: Qwen3's own, or what leaves room for
    Qwen3's special tokens within a smaller model's embedding."""
    from bench_structured import FULL_TOKENIZER_SIZE, QWEN3_SPECIALS

    return min(FULL_TOKENIZER_SIZE, shape["vocab_size"] - len(QWEN3_SPECIALS))


def machine() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "?"
    name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln for ln in lscpu.splitlines() if ln.startswith("Flags")), "")
    have = [f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags.split()]
    return f"{name} ({', '.join(have) or 'no avx512_bf16/vnni/amx'})"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from qil_worker import cpu_memory

    cpu_memory.configure_process("cpu")
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    shape, ensure, *_ = MODELS[args.model]
    model_dir = ensure(args.model_dir, shape)
    int8 = int8_supported()
    qil_dtypes = [d for d in args.dtypes if "qil" in args.engines and (d not in QIL_QUANTIZE or int8)]

    llama, ggufs, meta = None, {}, {}
    if "llama.cpp" in args.engines:
        from bench_structured import CORPUS_BYTES, ensure_tokenizer

        llama = ensure_llamacpp(args)
        tokenizer_dir = ensure_tokenizer(args.tokenizer_dir, regular_tokens(shape), CORPUS_BYTES)
        ggufs = {d: ensure_gguf(llama, model_dir, tokenizer_dir, GGUF_TYPES[d], args.skip_build, args.threads)
                 for d in args.dtypes}

    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, shape["vocab_size"], (max(BATCHES), args.prompt_len), generator=g).tolist()
    engines = {}
    for d in qil_dtypes:
        t = time.perf_counter()
        engines[d] = qil_engine(load_qil(model_dir, d, args), args)
        qil_warmup(engines[d], prompts)
        say(f"qil {d}: loaded and warmed up in {time.perf_counter() - t:.0f}s")

    results: dict[str, dict[str, list[float]]] = {}

    def record(column: str, rates: dict[str, float]) -> None:
        for k, v in rates.items():
            results.setdefault(column, {}).setdefault(k, []).append(v)
        say(f"  {column:16s} " + "  ".join(f"{k} {v:.1f}" for k, v in rates.items()))

    for r in range(args.rounds):
        say(f"round {r + 1}/{args.rounds}")
        for d in args.dtypes:
            order = ["llama.cpp", "qil"] if r % 2 == 0 else ["qil", "llama.cpp"]
            for who in order:
                if who == "llama.cpp" and llama is not None:
                    rates, meta[d] = llamacpp_round(llama, ggufs[d], args)
                    record(f"llama.cpp {GGUF_TYPES[d]}", rates)
                elif who == "qil" and d in engines:
                    record(f"qil {d}", qil_round(engines[d], prompts, args))
    for e in engines.values():
        e.close()

    load_after = os.getloadavg()
    print()
    print(f"{machine()}; torch {torch.__version__}, {args.threads} threads; "
          + (f"llama.cpp {llama.commit} ({llama.package}, build {next(iter(meta.values()), {}).get('build_commit')}); "
             if llama else "")
          + f"model {args.model} ({model_dir.name}); "
          f"prompt {args.prompt_len}, {args.new_tokens} decode steps, {args.rounds} round(s); "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    if ggufs:
        print("GGUF files: " + ", ".join(f"{GGUF_TYPES[d]} {p.stat().st_size / 1e9:.2f} GB" for d, p in ggufs.items()))
    if int8 and "int8" in qil_dtypes:
        print(f"qil int8: weight-only int8, activations in {args.int8_compute}")
    print()
    print(report(results, args, int8, meta))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "llamacpp": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
