import pytest
import torch

from qil_worker.kv import KVCache, PagePool, PageTable, pages_for


def test_pool_hands_out_and_reuses_pages():
    pool = PagePool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_used == 3 and pool.num_free == 1
    assert pool.allocate(2) is None and pool.num_free == 1  # all or nothing
    pool.free([a[1]])
    assert pool.allocate(1) == [a[1]]  # freed pages come back first
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([3])


def test_page_table_grows_only_when_needed():
    pool = PagePool(3)
    table = PageTable(page_size=4)
    assert table.grow(4, pool) and len(table.pages) == 1
    assert table.grow(4, pool) and len(table.pages) == 1
    assert table.grow(5, pool) and len(table.pages) == 2
    assert not table.grow(13, pool) and len(table.pages) == 2  # 4 pages needed, 1 free
    held = list(table.pages)
    assert table.release(pool) == held
    assert pool.num_free == 3 and table.pages == []
    assert pages_for(0, 4) == 0 and pages_for(1, 4) == 1 and pages_for(8, 4) == 2


def test_debug_mode_refuses_to_read_unwritten_slots():
    kv = KVCache(1, num_pages=2, page_size=2, num_kv_heads=1, head_dim=2,
                 dtype=torch.float32, device=torch.device("cpu"), debug=True)
    kv.write(0, torch.tensor([0, 1]), torch.ones(2, 1, 2), torch.ones(2, 1, 2))
    kv.check_readable(torch.tensor([[0, 1, 2]]), torch.tensor([2]))  # slot 2 is padding
    with pytest.raises(AssertionError, match="unwritten"):
        kv.check_readable(torch.tensor([[0, 1, 2]]), torch.tensor([3]))
    kv.forget_pages([0])
    with pytest.raises(AssertionError, match="2 unwritten"):
        kv.check_readable(torch.tensor([[0, 1]]), torch.tensor([2]))


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_range_slots_are_kv_slots_of_the_same_positions(page_size):
    from qil_worker.kv.slots import kv_slots, range_slots

    gen = torch.Generator().manual_seed(page_size)
    for width in (1, 3, 9):
        tables = torch.randint(0, 100, (5, width), generator=gen)
        for first_page in range(width):
            for length in range(1, (width - first_page) * page_size + 1):  # aligned and not
                start = first_page * page_size
                want = kv_slots(tables, torch.arange(start, start + length), page_size)
                got = range_slots(tables, first_page, length, page_size)
                assert torch.equal(got, want), (width, first_page, length)
