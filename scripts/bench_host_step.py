#!/usr/bin/env python
"""Host (Python) time of one ``Engine.step()`` at 256, 64 and 1 decode rows, split by phase.

A tiny model (hidden 64, 2 layers) keeps the forward small, so what is measured is the host's
own work per step — what a GPU waits for unless it is overlapped:

  schedule   ``Scheduler.schedule`` + ``Scheduler.commit``
  build      the step's input tensors: ``build_step_inputs`` (eager path) or
             ``DecodeGraphs._stage`` (padded decode path)
  attn-meta  of which (eager path) the attention backend's ``step_metadata`` (qil_worker/attention)
  prepare    ``Sampler.prepare`` (grammar masks; nothing for these requests)
  sample     ``Sampler.sample_on_device``: per-request parameters, their ``to_device``, the
             draw's ops over [rows, vocab] logits
  accept     the rest of ``step()``: the tokens' ``tolist``, ``_accept_token``, events,
             bookkeeping, which path to take
  host       everything but the forward (schedule + build + prepare + sample + accept)
  forward    the model call (``Qwen3.forward``, or ``DecodeGraphs.run`` minus staging): not host

Requests as the 256-request benchmark has them (``bench_throughput.py --temperature``): token-id
prompts of 100-1024 tokens (seeded), EOS ignored, half greedy, half sampled with temperature 0.8
and a seed each, on a model with a 64-id vocabulary, so that the sampler's ops over
[rows, vocab] cost their dispatch (host work) rather than their arithmetic. Variant ``text``: an
engine with a tokenizer (every token detokenized; ~300 ids), two stop strings per request, and
top-p 0.95 on the sampled ones (its ``sample`` includes the CPU's top-p sort of [rows, ~300],
device work on a GPU). Path ``eager`` is the engine's CPU default (``build_step_inputs``);
``padded`` the decode-graph path (``cuda_graphs=True``; on a GPU these steps replay a graph, so
its host work is this path's). Each configuration first computes every prompt, then times
``--steps`` pure decode steps (no request ends meanwhile) and reports the mean ms per step.

Phases are timed by wrapping the named calls inside this script (nothing is added to the
engine), by default in this thread's CPU time (``--clock cpu``), which other work on a shared
machine inflates less than wall time.

A/B: ``--before REV`` also runs the engine package (``qil_worker/engine/``; ``--swap`` names
the packages of ``qil_worker`` to take, e.g. ``--swap engine text``) as it is at git revision
REV over the rest of this tree, in child processes alternating with the current one
(``--rounds`` times each), and prints before / after / ratio per phase with the load average.

    python scripts/bench_host_step.py --before 87e3f10 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("schedule", "build", "attn-meta", "prepare", "sample", "accept", "host", "forward")
VARIANTS = ("plain", "text")
PREFILL_STEPS = 64  # at most, to compute every prompt
PATHS = ("eager", "padded")


# -- the child: one code version, every configuration --------------------------------------


class PhaseClock:
    """Seconds spent in each phase while ``on``; wrappers installed on one engine's objects."""

    def __init__(self, now) -> None:
        self.on = False
        self.now = now
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += self.now() - t0

        return timed


def instrument(engine, clock: "PhaseClock") -> None:
    # the step's device side: the engine's runner (an engine before it held it all itself)
    runner = getattr(engine, "runner", engine)
    try:
        import qil_worker.engine.runner.model_runner as step_module
    except ImportError:
        import qil_worker.engine.engine as step_module
    build = "build_step_inputs" if hasattr(step_module, "build_step_inputs") else "build_step_batch"

    engine.scheduler.schedule = clock.wrap("schedule", engine.scheduler.schedule)
    engine.scheduler.commit = clock.wrap("schedule", engine.scheduler.commit)
    runner.sampler.prepare = clock.wrap("prepare", runner.sampler.prepare)
    # the device part of sampling (the readout is in accept); ``sample`` in an engine before it
    sampling = "sample_on_device" if hasattr(runner.sampler, "sample_on_device") else "sample"
    setattr(runner.sampler, sampling, clock.wrap("sample", getattr(runner.sampler, sampling)))
    setattr(step_module, build, clock.wrap("build", getattr(step_module, build)))
    runner.attention.step_metadata = clock.wrap("attn-meta", runner.attention.step_metadata)
    engine.model.forward = clock.wrap("forward", engine.model.forward)
    graphs = runner.decode_graphs
    if graphs is not None:
        stage = graphs._stage
        graphs._stage = clock.wrap("build", stage)
        run = graphs.run

        def run_minus_stage(chunks, *in_flight):
            if not clock.on:
                return run(chunks, *in_flight)
            before = clock.seconds["build"]
            t0 = clock.now()
            out = run(chunks, *in_flight)
            clock.seconds["forward"] += clock.now() - t0 - (clock.seconds["build"] - before)
            return out

        graphs.run = run_minus_stage


def measure(
    model, tokenizer, variant: str, path: str, rows: int, steps: int, warmup: int, seed: int, clock: str
) -> dict:
    from qil_worker.engine import Engine

    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))] for _ in range(rows)]
    page_size = 16
    # room for the decodes of the steps that compute the prompts too: no request ends before
    # the timed steps are done
    new_tokens = PREFILL_STEPS + warmup + steps
    pages = sum(-(-(len(p) + new_tokens) // page_size) for p in prompts)
    engine = Engine(
        model, num_pages=pages, page_size=page_size, token_budget=8192, prefill_chunk=1024,
        max_active=max(rows, 1), tokenizer=tokenizer if variant == "text" else None,
        prefix_cache=True, cuda_graphs=path == "padded",
    )
    extra = {"stop_strings": ["<<never>>", "STOP here"]} if variant == "text" else {}
    drawn = {"temperature": 0.8, "seed": 0} | ({"top_p": 0.95} if variant == "text" else {})
    for i, prompt in enumerate(prompts):
        sampling = {} if i % 2 == 0 else dict(drawn, seed=i)
        engine.submit(prompt, max_new_tokens=new_tokens, ignore_eos=True, **sampling, **extra)
    for _ in range(PREFILL_STEPS):  # until every prompt is computed: then every step is pure decode
        if not engine.scheduler.waiting and all(
            r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running
        ):
            break
        engine.step()
    if len(engine.scheduler.running) != rows:
        sys.exit(f"{rows} requests should be decoding, {len(engine.scheduler.running)} are")
    timer = PhaseClock(time.thread_time if clock == "cpu" else time.perf_counter)
    instrument(engine, timer)
    for _ in range(warmup):
        engine.step()
    timer.on = True
    row_counts = []
    t0 = timer.now()
    for _ in range(steps):
        row_counts.append(len(engine.step()))
    total = timer.now() - t0
    timer.on = False
    s = timer.seconds
    s["host"] = total - s["forward"]
    s["accept"] = s["host"] - s["schedule"] - s["build"] - s["prepare"] - s["sample"]  # attn-meta is in build
    engine.close()
    return {
        "variant": variant, "path": path, "rows": rows, "mean_rows": statistics.mean(row_counts),
        "ms": {phase: 1000 * s[phase] / steps for phase in PHASES},
    }


def child(args: argparse.Namespace) -> None:
    import torch

    from qil_worker.model import Qwen3

    torch.set_num_threads(args.threads)
    out = []
    for variant in args.variants:
        model_dir = args.model_dir / variant
        model = Qwen3.from_directory(model_dir, device="cpu", dtype=torch.float32)
        tokenizer = None
        if variant == "text":
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for path in args.paths:
            for rows in args.rows:
                out.append(
                    measure(model, tokenizer, variant, path, rows, args.steps, args.warmup, args.seed, args.clock)
                )
    print(json.dumps({"label": args.label, "qil_worker": _qil_worker_file(), "results": out}))


def _qil_worker_file() -> str:
    import qil_worker

    return qil_worker.__file__


# -- the parent: model, checkouts, alternation, table --------------------------------------


PLAIN_VOCAB = 64  # token-id prompts need no tokenizer: a vocabulary this small makes the
# sampler's ops over [rows, vocab] cost their dispatch (host work), not their arithmetic


def make_models(directory: Path, variants: list[str]) -> None:
    """Random checkpoints as the tests make them (``tests/helpers/checkpoints.py``), with room for long
    prompts, in ``directory / variant``: ``plain`` with a vocabulary of ``PLAIN_VOCAB`` ids,
    ``text`` with a small local tokenizer's (about 300)."""
    sys.path.insert(0, str(REPO))
    from tests.helpers.checkpoints import make_checkpoint, make_tokenizer

    if "text" in variants:
        tokenizer = make_tokenizer(directory / "text")
        make_checkpoint(
            directory / "text", seed=5, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
            max_position_embeddings=4096,
        )
    if "plain" in variants:
        make_checkpoint(directory / "plain", seed=5, vocab_size=PLAIN_VOCAB, max_position_embeddings=4096)


def overlay(rev: str, into: Path, packages: list[str]) -> Path:
    """This tree's ``qil_worker`` with ``qil_worker/<package>/`` for each of ``packages`` as it
    is at ``rev``."""
    import shutil

    root = into / f"qil-{rev}"
    shutil.copytree(REPO / "qil_worker", root / "qil_worker", ignore=shutil.ignore_patterns("__pycache__"))
    for package in packages:
        package_dir = root / "qil_worker" / package
        shutil.rmtree(package_dir)
        package_dir.mkdir()
        files = subprocess.run(  # (-r: a package's subpackages too)
            ["git", "-C", str(REPO), "ls-tree", "-r", "--name-only", f"{rev}:qil_worker/{package}"],
            check=True, capture_output=True, text=True,
        ).stdout.split()
        for name in files:
            text = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{rev}:qil_worker/{package}/{name}"],
                check=True, capture_output=True, text=True,
            ).stdout
            (package_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (package_dir / name).write_text(text)
    return root


def run_child(label: str, pythonpath: Path, args: argparse.Namespace, model_dir: Path) -> dict:
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child", "--label", label, "--model-dir", str(model_dir),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--seed", str(args.seed),
        "--threads", str(args.threads), "--rows", *map(str, args.rows), "--variants", *args.variants,
        "--paths", *args.paths, "--clock", args.clock,
    ]
    env = dict(os.environ, PYTHONPATH=str(pythonpath))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=pythonpath)
    if proc.returncode != 0:
        sys.exit(f"{label} child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(runs: dict[str, list[dict]], labels: list[str]) -> str:
    """Median over rounds of each phase's mean ms per step, per configuration."""
    first = runs[labels[0]][0]["results"]
    lines = []
    for i, cfg in enumerate(first):
        lines.append(
            f"\n{cfg['variant']} / {cfg['path']} / {cfg['rows']} rows (mean rows per step "
            f"{cfg['mean_rows']:.1f}): ms per step, median of {len(runs[labels[0]])} rounds"
        )
        head = f"  {'phase':<9}" + "".join(f"{label:>10}" for label in labels)
        if len(labels) == 2:
            head += f"{'ratio':>8}"
        lines.append(head)
        for phase in PHASES:
            values = [statistics.median(r["results"][i]["ms"][phase] for r in runs[label]) for label in labels]
            line = f"  {phase:<9}" + "".join(f"{v:>10.3f}" for v in values)
            if len(labels) == 2:
                line += f"{values[1] / values[0]:>8.2f}" if values[0] > 1e-6 else f"{'-':>8}"
            lines.append(line)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 64, 1])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per configuration")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="runs of each code version, alternating")
    p.add_argument("--before", metavar="REV", help="also run qil_worker/engine/ as of this git revision")
    p.add_argument(
        "--swap", nargs="+", default=["engine"], metavar="PACKAGE",
        help="the packages of qil_worker that --before takes from REV (default: engine)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (the forward's, not host work)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clock", choices=("cpu", "wall"), default="cpu",
        help="cpu: this thread's CPU time (time.thread_time: what the host spends, whatever else "
        "the machine runs); wall: perf_counter",
    )
    p.add_argument("--json", type=Path, help="write every round's results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--label", default="after", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="qil-host-step-") as tmp:
        model_dir = Path(tmp) / "models"
        make_models(model_dir, args.variants)
        versions = {"after": REPO}
        if args.before:
            versions = {"before": overlay(args.before, Path(tmp), args.swap), **versions}
        labels = list(versions)
        runs: dict[str, list[dict]] = {label: [] for label in labels}
        for round_ in range(args.rounds):
            for label in labels if round_ % 2 == 0 else reversed(labels):
                runs[label].append(run_child(label, versions[label], args, model_dir))
                print(f"round {round_ + 1}: {label} done", file=sys.stderr, flush=True)
    print("command: python scripts/bench_host_step.py " + " ".join(sys.argv[1:]))
    print(
        f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch threads "
        f"{args.threads}; clock: {'thread CPU time' if args.clock == 'cpu' else 'wall time'}"
    )
    if args.before:
        swapped = ", ".join(f"qil_worker/{package}/" for package in args.swap)
        print(f"before = {swapped} at {args.before}; after = this tree")
    print(table(runs, labels))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
