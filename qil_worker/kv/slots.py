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
