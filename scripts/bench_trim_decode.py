"""Decode step time steady against right after ``freed_memory.release_outsized`` (what the worker
does after an outsized request): the cost of faulting the freed step temporaries in again.

    python scripts/bench_trim_decode.py

A random model with Qwen3-0.6B's shapes (``bench_engine.FULL_SHAPE``), one thread, 8 requests of
199 prompt tokens decoding; six rounds of 10 steady steps, a trim, 10 more steps.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import FULL_SHAPE, ensure_model  # noqa: E402


def main() -> None:
    from qil_worker.cpu_memory import configure_process

    configure_process("cpu")
    import torch

    from qil_worker import Engine
    from qil_worker.freed_memory import release_outsized
    from qil_worker.model import Qwen3

    torch.set_num_threads(1)
    path = ensure_model(Path.home() / ".cache/qil/bench-qwen3-0.6b-shape", FULL_SHAPE)
    engine = Engine(Qwen3.from_directory(path), num_pages=256, page_size=16, token_budget=2048)
    for _ in range(8):
        engine.submit(list(range(1, 200)), max_new_tokens=400, ignore_eos=True)
    for _ in range(10):
        engine.step()  # the prefill, then warm decode steps

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - t0)
        return out

    steady, first, rest = [], [], []
    for _ in range(6):
        steady += steps(10)
        release_outsized()
        after = steps(10)
        first.append(after[0])
        rest += after[1:]
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    print(f"steady median {ms(steady):.1f} ms a step; the first step after a trim median {ms(first):.1f} ms "
          f"(max {max(first) * 1e3:.1f}); the next 9 median {ms(rest):.1f} ms")
    engine.close()


if __name__ == "__main__":
    main()
