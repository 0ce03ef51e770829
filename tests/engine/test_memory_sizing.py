import pytest

from qil_worker import Qwen3
from qil_worker.engine.memory import bytes_per_page, size_pool
from qil_worker.engine.runner.model_runner import scratch_pages


@pytest.fixture(scope="module")
def model(tiny_dir):
    return Qwen3.from_directory(tiny_dir)


def test_page_bytes_match_the_allocated_cache(model):
    from qil_worker import Engine

    engine = Engine(model, num_pages=10, page_size=4)
    assert engine.runner.kv.nbytes == 10 * bytes_per_page(model, 4)
    # 2 (K,V) x 2 layers x 4 tokens x 2 kv heads x 16 dims x 4 bytes
    assert bytes_per_page(model, 4) == 2 * 2 * 4 * 2 * 16 * 4


def test_sizes_from_a_byte_budget(model):
    size = size_pool(model, page_size=4, memory_bytes=10 * 2048 + 100)
    assert size.num_pages == 10 and size.num_tokens == 40
    assert "10 pages" in size.summary() and "budget" in size.summary()
    assert size_pool(model, 4, num_pages=7).num_pages == 7


def test_a_budget_covers_the_decode_graphs_scratch_page(model):
    """Decode graphs (on CUDA by default) allocate a scratch page beside the pool; the KV
    tensors, scratch included, stay within the budget, and the summary counts it."""
    from qil_worker import Engine

    budget = 10 * bytes_per_page(model, 4)
    reserved = scratch_pages(model, cuda_graphs=True)
    size = size_pool(model, 4, memory_bytes=budget, reserved_pages=reserved)
    engine = Engine(model, num_pages=size.num_pages, page_size=4, cuda_graphs=True)
    assert reserved == 1 and size.num_pages == 9
    assert engine.runner.kv.nbytes == size.total_bytes == budget
    assert "9 pages x 4 tokens = 36 tokens + 1 scratch page" in size.summary()
    assert scratch_pages(model) == 0  # the CPU default: no graphs, no scratch page
    with pytest.raises(ValueError, match="plus a scratch page"):
        size_pool(model, 4, memory_bytes=bytes_per_page(model, 4), reserved_pages=1)


def test_rejects_impossible_sizing(model):
    with pytest.raises(ValueError, match="below one page"):
        size_pool(model, 4, memory_bytes=100)
    with pytest.raises(ValueError, match="exactly one"):
        size_pool(model, 4, num_pages=3, memory_bytes=10_000)
    with pytest.raises(ValueError, match="CUDA"):
        size_pool(model, 4, memory_fraction=0.5)


def test_format_bytes_picks_a_readable_unit():
    from qil_worker.engine.memory import format_bytes

    assert [format_bytes(n) for n in (512, 65536, 3 * 2**20, 5 * 2**30)] == [
        "512 B", "64.0 KiB", "3.0 MiB", "5.0 GiB"]
