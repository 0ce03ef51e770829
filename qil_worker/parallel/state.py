"""One rank's place in a tensor-parallel group, and the two collectives the forward needs.

The model holds a ``ParallelState``; at world size 1 (``SINGLE``) it never calls a collective
(the model checks ``sharded`` once per call site), so the single-device path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


# torch 2.13 renamed all_gather_into_tensor (which now warns on each call)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class RankFailedError(RuntimeError):
    """A collective of the tensor-parallel group failed (a rank died, or one timed out): no
    later step of the group can succeed, so the engine treats it as a lost device."""


def collective(call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, a ``torch.distributed`` collective; its failure raised as
    ``RankFailedError``."""
    try:
        return call(*args, **kwargs)
    except RuntimeError as exc:
        raise RankFailedError(f"tensor-parallel group failed: {exc}") from exc


@dataclass(frozen=True)
class ParallelState:
    """``rank`` of ``world_size`` ranks joined in ``group`` (a ``torch.distributed`` process
    group for the forward's collectives; None: the default group, or no group at world size 1).
    ``control_group``: a host (gloo) group of the same ranks for rank 0's step messages, whose
    long timeout lets followers wait through an idle server (``step_broadcast``)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    control_group: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")

    @property
    def sharded(self) -> bool:
        """Whether weights are split across more than one rank (collectives needed)."""
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the partial outputs of a row-parallel projection)."""
        collective(dist.all_reduce, x, group=self.group)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[L, n] on each rank → [L, world_size * n], rank r's columns r*n:(r+1)*n (the
        vocab-parallel LM head's logits)."""
        rows, cols = x.shape
        if rows == 0:
            # a step with no logit row (only pooled prompts, or prompt chunks that end none):
            # every rank has the step's row count from rank 0's message, so all skip the gather
            return x.new_empty((0, self.world_size * cols))
        gathered = x.new_empty((self.world_size * rows, cols))
        collective(_all_gather, gathered, x.contiguous(), group=self.group)
        return gathered.view(self.world_size, rows, cols).permute(1, 0, 2).reshape(rows, -1)


SINGLE = ParallelState()
