"""Attention over the paged KV cache: one interface and its backends.

A backend (``backend.AttentionBackend``) builds a step's attention metadata — from the
scheduled chunks (``batch.py``) or, for captured decode graphs, from static buffers — and that
metadata (``backend.StepAttention``) attends one layer's queries. The backends:

- ``cpu``: keys gathered in whole pages, shared prefixes read once, matmul kernels in chunks;
- ``sdpa``: keys gathered by slot, padded per group of similar requests, SDPA (what CUDA runs);
- ``varlen``: torch's varlen flash attention, paged (block table) or packed (keys back to back);
- ``reference``: a plain-torch stand-in for the varlen kernel, so its wiring runs anywhere.

``choice.choose_backend`` picks one per engine. This package's ``__init__`` and ``names`` import
no torch: the front's CLI reads the backend names from ``names``.
"""

from qil_worker.attention.names import ATTENTION_CHOICES, PACKED, PAGED, SDPA

__all__ = ["ATTENTION_CHOICES", "PACKED", "PAGED", "SDPA"]
