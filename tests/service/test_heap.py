"""The process entry points freeze their start-up heap; what serving creates is still collected."""

from __future__ import annotations

import gc
import weakref

from qil_worker.service.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_freeze_exempts_the_startup_heap_and_later_garbage_is_still_collected():
    before = _Node()
    before_ref = weakref.ref(before)
    try:
        frozen = freeze_startup_heap()
        assert frozen > 1000 and gc.get_freeze_count() > 1000
        del before
        gc.collect()
        assert before_ref() is not None, "a frozen cycle must not be collected"
        after = _Node()
        after_ref = weakref.ref(after)
        del after
        gc.collect()
        assert after_ref() is None, "cycles created after the freeze must still be collected"
    finally:
        gc.unfreeze()
