"""oneDNN's and ideep's per-shape kernel caches are capped in a process set up to serve on CPU.

Uncapped, each new input shape (the token count of a step) keeps a compiled kernel for the
first 1,024 shapes, so a serving worker's memory grows for a long time, which looks like a leak
(docs/performance.md has the figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qil_worker import cpu_memory
from qil_worker.model.linear import packing_supported

ROOT = Path(__file__).resolve().parents[2]

# In a fresh process: the start-up settings (as the worker, CLI and benchmarks make them), the
# model from a checkpoint (packed for oneDNN), then the LM head for 599 different row counts;
# report the cache settings and malloc's growth in use.
_PROBE = """
import ctypes, json, os, sys
import torch
from qil_worker.cpu_memory import configure_process
from qil_worker.model.qwen3 import Qwen3

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
configure_process("cpu")
model = Qwen3.from_directory(sys.argv[1], dtype=torch.float32)
hidden = torch.randn(600, model.config.hidden_size)
model.logits(hidden[:1])
before = libc.mallinfo2().uordblks
for rows in range(2, 601):
    model.logits(hidden[:rows])
print(json.dumps({
    "growth_mb": (libc.mallinfo2().uordblks - before) / 2**20,
    "caps": [os.environ.get(name) for name in sys.argv[2:]],
}))
"""


def _probe(checkpoint: Path, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in cpu_memory.KERNEL_CACHE_VARIABLES}
    environ.update(env, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(checkpoint), *cpu_memory.KERNEL_CACHE_VARIABLES],
        env=environ, capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_configure_process_sets_both_caps_but_keeps_a_users_choice(monkeypatch):
    first, second = cpu_memory.KERNEL_CACHE_VARIABLES
    monkeypatch.delenv(first, raising=False)
    monkeypatch.setenv(second, "4096")
    cpu_memory.configure_process("cuda")  # nothing to cap off CPU
    assert first not in os.environ
    cpu_memory.configure_process("cpu")
    assert os.environ[first] == str(cpu_memory.KERNEL_CACHE_CAPACITY)
    assert os.environ[second] == "4096"


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not packing_supported(torch.device("cpu"), torch.float32),
    reason="needs glibc's mallinfo2 and oneDNN-packed linears",
)
def test_start_up_on_cpu_caps_the_kernel_caches_of_its_process(tiny_dir):
    capped = _probe(tiny_dir)
    uncapped = _probe(tiny_dir, **{name: "100000" for name in cpu_memory.KERNEL_CACHE_VARIABLES})
    assert capped["caps"] == [str(cpu_memory.KERNEL_CACHE_CAPACITY)] * 2
    assert uncapped["caps"] == ["100000"] * 2  # the user's setting wins
    # 599 shapes: uncapped, every one stays cached; capped, at most 256 do, so well under half
    assert uncapped["growth_mb"] > 150, uncapped
    assert capped["growth_mb"] < uncapped["growth_mb"] / 2, (capped, uncapped)
