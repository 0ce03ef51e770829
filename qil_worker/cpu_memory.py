"""CPU memory habits for memory-bound inference (Linux): huge pages, no page-fault churn, and
bounded kernel caches.

**Huge pages.** A CPU decode step streams every weight once (2.4 GB for Qwen3-0.6B in float32), so its speed is
memory bandwidth. With 4 KiB pages the hardware prefetchers stop at every page boundary and the
TLB misses constantly; with 2 MiB pages the same matmul streams much faster (measured on the
team's 2-vCPU Xeon: the 0.6B LM head, [8, 1024] x [1024, 151936] float32, 69-71 ms with 4 KiB
pages, 49-50 ms with huge pages). Kernels commonly grant huge pages only where a mapping asks
for them (``transparent_hugepage=madvise``), so the region is advised *before* it is first
touched. Elsewhere (other systems, CUDA, small tensors) this is plain ``torch.empty``.

**Keeping freed memory.** A forward allocates temporaries of several MB (gathered keys, scores,
MLP activations). glibc serves large ones with fresh mappings and returns freed memory to the
system, so every step pays page faults again — measured at 2x the decode step time at 16
requests of ~770 tokens. ``keep_freed_memory`` tells glibc to serve them from its heap and keep
what is freed: the process holds its peak working set instead of faulting it in every step.

**Bounded kernel caches.** oneDNN (the packed linears, bf16 matmuls) compiles a kernel for every
new input shape and keeps it in an LRU cache, and torch's ideep layer keeps another; each holds
1,024 entries by default, at up to ~0.5 MB an entry. A serving engine sees a new shape almost
every step (the number of tokens in a step, the key lengths of attention), so a worker's memory
grew by ~1.1 GB over minutes of serving before those caches filled — indistinguishable from
a leak. ``bound_kernel_caches`` caps both (read once, at a process's first oneDNN call).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import sys

import torch

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit; larger blocks are always mapped
_TOP_PAD = 64 << 20


@functools.lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


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
# prefill steps bring new shapes whatever the size. Measured (0.6B shape, bf16, a serving-like
# mix with preemption): malloc in use +196 MB after 100 s at 256, flat from 2 to 11 minutes
# (+200 MB); at the default 1,024, +360 MB after 100 s and still climbing (+1.0 GB in 7 minutes
# of a load test). Throughput within noise (55 tok/s both; 128 entries measured ~2% slower).
KERNEL_CACHE_CAPACITY = 256
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Cap oneDNN's and ideep's kernel caches at ``capacity`` entries each, unless the
    environment already sets them. Takes effect only before the process's first oneDNN call
    (both are read then, once): ``Qwen3`` calls it when built on CPU, before packing weights."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


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
