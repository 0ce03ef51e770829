"""glibc's malloc in huge pages, for a worker that serves on the CPU.

``cpu_memory.empty`` advises the tensors qil allocates itself for transparent huge pages, but
the oneDNN-packed weights (every dense projection and every expert once packed) are allocated
by oneDNN through malloc, which kernels in ``transparent_hugepage=madvise`` mode back with
4 KiB pages. glibc advises huge pages for what malloc maps when its ``glibc.malloc.hugetlb``
tunable is 1; tunables are read once at process start, so the worker must be started with it
in its environment. ``serve`` sets it before the front spawns the worker (and the worker its
tensor-parallel ranks); an in-process ``Engine`` gets it by starting Python with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``. Torch-free: the front imports it.
"""

from __future__ import annotations

from collections.abc import Mapping

TUNABLES = "GLIBC_TUNABLES"
HUGETLB = "glibc.malloc.hugetlb"


def with_huge_page_malloc(environ: Mapping[str, str], device: str) -> dict[str, str]:
    """``environ`` plus ``glibc.malloc.hugetlb=1`` in ``GLIBC_TUNABLES`` when ``device`` is the
    CPU; unchanged for other devices and where the variable already sets that tunable (the
    operator's choice wins). Other tunables in the variable are kept."""
    env = dict(environ)
    if not device.startswith("cpu"):
        return env
    current = env.get(TUNABLES, "")
    if any(item.split("=", 1)[0] == HUGETLB for item in current.split(":") if item):
        return env
    env[TUNABLES] = f"{current}:{HUGETLB}=1" if current else f"{HUGETLB}=1"
    return env
