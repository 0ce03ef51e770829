"""The KV slot of a token: where its keys and values live in the cache's flat slot axis."""

from __future__ import annotations

import torch


def kv_slots(
    tables: torch.Tensor, positions: torch.Tensor, page_size: int, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Slot ``page * page_size + offset`` of each position through the page ``tables`` [R, P].

    ``rows`` None: ``positions`` [L] for every row → [R, L]. Else ``rows`` and ``positions`` give
    one (row, position) pair per element → their shape. Runs on the tables' device, graph-safe.
    """
    pages = tables[:, positions // page_size] if rows is None else tables[rows, positions // page_size]
    return pages * page_size + positions % page_size


def range_slots(tables: torch.Tensor, first_page: int, length: int, page_size: int) -> torch.Tensor:
    """``kv_slots(tables, arange(first_page * page_size, first_page * page_size + length))``: the
    slots of ``length`` consecutive positions from a page boundary, in every row, [R, length] —
    from the tables' pages broadcast against the offsets in a page, without indexing R x length
    positions one by one."""
    pages = tables[:, first_page : first_page + -(-length // page_size)]
    offsets = torch.arange(page_size, device=tables.device)
    slots = (pages[:, :, None] * page_size + offsets).reshape(tables.shape[0], -1)
    return slots if slots.shape[1] == length else slots[:, :length]
