"""Tensor parallelism over ``torch.distributed``: the ranks' group (``state``), which slice of
each weight a rank holds (``shards``), and starting a group of processes (``group``)."""

from qil_worker.parallel.shards import AttentionHeads, Shard, check_tp_size
from qil_worker.parallel.state import SINGLE, ParallelState

__all__ = ["AttentionHeads", "ParallelState", "SINGLE", "Shard", "check_tp_size"]
