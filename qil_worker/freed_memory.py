"""Handing freed heap memory back to the system (glibc's ``malloc_trim``), torch-free so that the
front can use it too.

A process that has just handled an outsized request (a prompt of megabytes: the received
message, its text, a tokenizer's buffers) has freed it all, but glibc keeps freed memory in its
heaps and in each thread's arena, and in the worker ``cpu_memory.keep_freed_memory`` tells it to
keep everything: the resident size would stay at its peak for good. ``release_freed_memory``
after such a request returns it (every arena, ``malloc_trim(0)``), at the cost of the next few
steps faulting their temporaries in again; ordinary requests never call it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import sys

# A prompt (or tokenizer call) of at least this many characters is outsized: afterwards the
# process trims its heap. Far above any ordinary prompt and far below the 16 MiB message limit.
OUTSIZED_CHARS = 1 << 20


@functools.lru_cache(maxsize=1)
def libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def release_outsized() -> bool:
    """After an outsized request: collect the reference cycles that may still hold it (a refused
    request's exception, whose traceback holds the frames that held the request; short after
    ``heap.freeze_startup_heap``), then return the freed memory; whether glibc could."""
    gc.collect()
    return release_freed_memory()


def release_freed_memory() -> bool:
    """Return the free memory of every malloc arena to the system; whether glibc could."""
    trim = getattr(libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


_M_MMAP_THRESHOLD = -3
# Blocks from this size on get their own mapping, returned to the system when freed.
MAP_BLOCKS_FROM = 256 << 10


@functools.lru_cache(maxsize=1)
def map_large_blocks() -> bool:
    """Once per process (the front's): blocks of ``MAP_BLOCKS_FROM`` bytes or more are always
    mapped on their own, so freeing a received message of megabytes unmaps it at once. glibc
    otherwise raises its threshold to the largest block freed (up to 32 MiB) and serves later
    big blocks from heaps that fragment and stay resident. Not for the worker, whose step
    temporaries are kept on purpose (``cpu_memory.keep_freed_memory``)."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, MAP_BLOCKS_FROM) == 1
