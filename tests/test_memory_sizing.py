import pytest

from qil_worker import Qwen3
from qil_worker.engine.memory import bytes_per_page, size_pool


@pytest.fixture(scope="module")
def model(tiny_dir):
    return Qwen3.from_directory(tiny_dir)


def test_page_bytes_match_the_allocated_cache(model):
    from qil_worker import Engine

    engine = Engine(model, num_pages=10, page_size=4)
    assert engine.kv.nbytes == 10 * bytes_per_page(model, 4)
    # 2 (K,V) x 2 layers x 4 tokens x 2 kv heads x 16 dims x 4 bytes
    assert bytes_per_page(model, 4) == 2 * 2 * 4 * 2 * 16 * 4


def test_sizes_from_a_byte_budget(model):
    size = size_pool(model, page_size=4, memory_bytes=10 * 2048 + 100)
    assert size.num_pages == 10 and size.num_tokens == 40
    assert "10 pages" in size.summary() and "budget" in size.summary()
    assert size_pool(model, 4, num_pages=7).num_pages == 7


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
