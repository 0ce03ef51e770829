"""Paged KV memory: the page pool, per-request page tables and the KV tensors."""

from qil_worker.kv.cache import KVCache
from qil_worker.kv.page_pool import PagePool
from qil_worker.kv.page_table import PageTable, pages_for

__all__ = ["KVCache", "PagePool", "PageTable", "pages_for"]
