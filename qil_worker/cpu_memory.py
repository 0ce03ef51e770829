"""CPU memory habits for memory-bound inference (Linux): huge pages, no page-fault churn, and
bounded kernel caches. ``configure_process`` makes the process-wide ones, once at start-up.

**Huge pages.** A CPU decode step streams every weight once, so its speed is memory bandwidth.
With 4 KiB pages the hardware prefetchers stop at every page boundary and the TLB misses
constantly; with 2 MiB pages the same matmul streams much faster. Kernels commonly grant huge
pages only where a mapping asks for them (``transparent_hugepage=madvise``), so the region is
advised *before* it is first touched. Elsewhere (other systems, CUDA, small tensors) this is
plain ``torch.empty``.

**Keeping freed memory.** A forward allocates temporaries of several MB (gathered keys, scores,
MLP activations). glibc serves large ones with fresh mappings and returns freed memory to the
system, so every step pays page faults again, which can cost more than the step's compute.
``keep_freed_memory`` tells glibc to serve them from its heap and keep what is freed: the process
holds its peak working set instead of faulting it in every step. After an outsized request (a
prompt of megabytes) the worker gives what it freed back (``freed_memory.release_freed_memory``).

**Bounded kernel caches.** oneDNN (the packed linears, bf16 matmuls) compiles a kernel for every
new input shape and keeps it in an LRU cache, and torch's ideep layer keeps another; each holds
1,024 entries by default, at up to ~0.5 MB an entry. A serving engine sees a new shape almost
every step (the number of tokens in a step, the key lengths of attention), so a worker's memory
grows by about a GB before those caches fill — indistinguishable from a leak.
``bound_kernel_caches`` caps both (read once, at a process's first oneDNN call).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch

from qil_worker.freed_memory import libc as _libc

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit; larger blocks are always mapped
_TOP_PAD = 64 << 20


def resident_bytes() -> int:
    """This process's resident memory now (Linux ``/proc``; elsewhere its peak, or 0)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except Exception:  # noqa: BLE001
            return 0


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Once per process: glibc keeps freed heap memory and serves blocks up to 32 MiB from it.

    Returns whether it applied (False off glibc).
    """
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(
        mallopt(option, value) == 1
        for option, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX),
            (_M_TRIM_THRESHOLD, 2**31 - 1),  # an int: at most 2 GiB of free heap kept
            (_M_TOP_PAD, _TOP_PAD),
        )
    )


# Entries per cache. Decode steps repeat a few shapes (the running batch size) and stay cached;
# prefill steps bring new shapes whatever the size: 256 keeps the memory flat under a
# serving-like load at unchanged throughput (see docs/cpu.md), where fewer start to cost speed.
KERNEL_CACHE_CAPACITY = 256
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Cap oneDNN's and ideep's kernel caches at ``capacity`` entries each, unless the
    environment already sets them. Takes effect only before the process's first oneDNN call
    (both are read then, once): see ``configure_process``."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


def configure_process(device: torch.device | str | None = None) -> None:
    """Process-wide settings for serving on ``device`` (None: CPU), made once at process start-up
    (worker, CLI, benchmarks) before a model is built: on CPU, capped kernel caches (before the
    first oneDNN call, which packing the weights makes) and glibc keeping freed memory."""
    try:
        if torch.device(device if device is not None else "cpu").type != "cpu":
            return
    except RuntimeError:  # not a device at all: loading the model reports it
        return
    bound_kernel_caches()
    keep_freed_memory()


@functools.lru_cache(maxsize=1)
def _madvise():
    fn = getattr(_libc(), "madvise", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised tensor; on Linux CPU and at least 2 MiB, in memory advised for huge pages."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    madvise = _madvise() if device.type == "cpu" else None
    if madvise is None or nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    length = (raw.numel() - offset) // 4096 * 4096  # the tensor and the slack after it, no further
    madvise(raw.data_ptr() + offset, length, _MADV_HUGEPAGE)  # advisory: failure only costs speed
    return raw[offset : offset + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return empty(shape, dtype, device).zero_()
