"""``auto``'s start-up timing of the attention backends (``attention.measure``, ``choice.fastest_on``).

What runs here is the wiring: the synthetic decode step is the same attention for every
backend, the fastest is the one the timer says, a failed timing keeps the preference order.
Which backend a GPU picks is in the device check's log.
"""

import torch

from varlen_helpers import use_reference_varlen
from qil_worker.attention import PACKED, PAGED, SDPA, choice, measure
from qil_worker.attention.reference import reference_backend
from qil_worker.attention.sdpa import GatherSdpa

CPU = torch.device("cpu")


def _work(**kwargs):
    return measure.decode_workload(CPU, torch.float32, 4, 4, 2, 8, rows=5, contexts=(3, 40), **kwargs)


def test_the_synthetic_step_is_the_same_attention_for_every_backend():
    work = _work()
    outputs = []
    for backend in (reference_backend(PAGED), reference_backend(PACKED), GatherSdpa()):
        keys = int(work.positions.sum()) + work.positions.numel()
        meta = backend.decode_metadata(work.tables, work.positions, work.page_size, work.context, work.query_groups,
                                       keys=keys, scratch_slot=work.kv.scratch_page * work.page_size)
        outputs.append(meta.attend(work.q, work.kv, 0))
    assert outputs[0].shape == (5, 4 * 8)
    for other in outputs[1:]:
        torch.testing.assert_close(other, outputs[0], rtol=1e-5, atol=1e-5)
    # rows own distinct pages, and each row's table covers its keys
    pages = work.tables[work.tables != work.kv.scratch_page]
    assert pages.unique().numel() == pages.numel()
    assert bool(((work.tables != work.kv.scratch_page).sum(1) * 4 >= work.positions + 1).all())


def test_the_fastest_is_the_one_the_timer_says():
    backends = [reference_backend(PAGED), reference_backend(PACKED), GatherSdpa()]
    said = iter([3e-3, 1e-3, 2e-3])
    calls = []

    def timer(fn):
        fn()  # the real step runs: a backend that cannot run the workload fails here
        calls.append(1)
        return next(said)

    best, seconds = measure.fastest_backend(backends, _work(), timer)
    assert best is backends[1] and len(calls) == 3
    assert seconds == {PAGED: 3e-3, PACKED: 1e-3, SDPA: 2e-3}


def test_the_device_timer_takes_the_median_after_a_warm_up():
    calls = []
    seconds = measure.device_timer(CPU, repeats=3)(lambda: calls.append(1))
    assert len(calls) == 4 and 0 <= seconds < 1
    assert measure.graph_replay(lambda: None, CPU) is None  # no graph here: the calls themselves are timed


def test_fastest_on_times_every_working_backend_once_per_shape(monkeypatch):
    use_reference_varlen(monkeypatch, (PAGED, PACKED))
    monkeypatch.setattr(measure, "ROWS", 4)
    monkeypatch.setattr(measure, "CONTEXTS", (3, 30))
    choice.fastest_on.cache_clear()
    timed = []
    real = measure.fastest_backend
    monkeypatch.setattr(measure, "fastest_backend", lambda *a: timed.append(1) or real(*a))
    try:
        best, timings = choice.fastest_on(CPU, torch.float32, 4, 4, 2, 8, (PAGED, PACKED))
        assert best in (PAGED, PACKED, SDPA)
        assert all(f"{name} " in timings for name in (PAGED, PACKED, SDPA)), timings
        assert choice.fastest_on(CPU, torch.float32, 4, 4, 2, 8, (PAGED, PACKED)) == (best, timings)
        assert timed == [1], "measured once per process and shape"
    finally:
        choice.fastest_on.cache_clear()


def test_a_failed_timing_keeps_the_preference_order(monkeypatch):
    use_reference_varlen(monkeypatch, (PAGED, PACKED))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no room for the synthetic step")

    monkeypatch.setattr(measure, "decode_workload", out_of_memory)
    choice.fastest_on.cache_clear()
    try:
        assert choice.fastest_on(CPU, torch.float32, 4, 4, 2, 8, (PACKED,)) == (PACKED, "not measured")
    finally:
        choice.fastest_on.cache_clear()
