"""Paged KV memory: the page pool, per-request page tables and the KV tensors."""

from qil_worker.kv.cache import KVCache
from qil_worker.kv.page_pool import PagePool
from qil_worker.kv.page_table import PageTable, pages_for
from qil_worker.kv.prefix_cache import PrefixCache, page_hashes

__all__ = ["KVCache", "PagePool", "PageTable", "PrefixCache", "page_hashes", "pages_for"]
