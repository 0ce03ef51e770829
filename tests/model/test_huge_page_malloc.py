"""Huge pages for what oneDNN allocates: the packed weights live in malloc'd memory, which glibc
advises for transparent huge pages only when the process starts with ``glibc.malloc.hugetlb=1``
(``serve`` starts its worker so)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qil_worker.huge_page_malloc import with_huge_page_malloc

ROOT = Path(__file__).resolve().parents[2]


def test_the_tunable_is_added_for_the_cpu_only_and_never_overrides_the_operator():
    assert with_huge_page_malloc({}, "cpu")["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert "GLIBC_TUNABLES" not in with_huge_page_malloc({}, "cuda:0")
    kept = with_huge_page_malloc({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}, "cpu")
    assert kept == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "PATH": "/bin"}
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert with_huge_page_malloc(chosen, "cpu") == chosen


# 24 oneDNN-packed bf16 weights of 6 MiB (an expert's gate/up at Qwen3-30B-A3B's shape), then
# the process's anonymous memory in huge pages, in MiB
_PROBE = """
import re, torch
from qil_worker.model.linear import packing_supported
if not packing_supported(torch.device("cpu"), torch.bfloat16):
    print("unsupported"); raise SystemExit
weights = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(1536, 2048).bfloat16(), 1) for _ in range(24)]
text = open("/proc/self/smaps_rollup").read()
print(int(re.search(r"AnonHugePages:\\s+(\\d+) kB", text).group(1)) // 1024)
"""


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else None


def _huge_mib(env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always") or platform.libc_ver()[0] != "glibc"
                    or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 35),
                    reason="needs Linux transparent huge pages and glibc >= 2.35 (glibc.malloc.hugetlb)")
def test_packed_weights_land_in_huge_pages_with_the_tunable():
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    advised = _huge_mib(with_huge_page_malloc(base, "cpu"))
    if advised == "unsupported":
        pytest.skip("no oneDNN bf16 packing on this CPU")
    assert int(advised) >= 24 * 6 // 2  # most of the 144 MiB of packed weights
    if _thp_mode() == "madvise":  # without the advice, malloc's mappings get 4 KiB pages
        assert int(_huge_mib(base)) < int(advised) // 2
