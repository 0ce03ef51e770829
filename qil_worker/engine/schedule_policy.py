"""Admission policies of the scheduler: which waiting request starts next.

Torch-free, so the gRPC front can offer the choice on its command line (``qil_worker.engine``
imports its torch modules only on first use).

- ``fcfs``: arrival order (the default; what most users expect of a queue).
- ``shortest-first``: the request with the fewest tokens left to compute after the prefix the
  cache already holds. When many requests wait at once, finishing short prefills first lowers the
  mean time to first token; with a prefix cache the gain is largest, because a long prompt that
  shares a cached system prefix is short work. Long prompts wait longer, but never forever: a
  request overtaken ``MAX_BYPASS`` times goes next regardless.
"""

from __future__ import annotations

SCHEDULE_POLICIES = ("fcfs", "shortest-first")
SHORTEST_FIRST_WINDOW = 64  # waiting requests ranked per step (each costs a cache lookup)
MAX_BYPASS = 32  # admissions that may overtake one waiting request under shortest-first
