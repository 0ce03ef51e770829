"""Keep the garbage collector's full passes short in the long-running processes.

A process that has loaded its modules (torch, transformers' tokenizer, gRPC, the model's
wrappers) holds hundreds of thousands of long-lived objects that Python's cyclic collector
walks on every full (generation 2) collection — a pause long enough to show in whatever step
or event it interrupts (docs/performance.md has the figures). ``gc.freeze()`` after start-up
moves those objects out of the collector's reach, while what serving creates is still collected.

Called by the process entry points only (the worker after its warm-up, the front's ``serve``),
never by library code, whose heap belongs to its embedder.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then exempt every surviving object from future collections.

    Returns how many objects are frozen (for the start-up log).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
