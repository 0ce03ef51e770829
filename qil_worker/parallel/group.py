"""Joining this process to a tensor-parallel group: gloo on CPU, NCCL on CUDA, with a timeout so
that no rank waits forever in a collective when another has died; and the ranks' start-up
exchange of what each loaded (``gather_ints``)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from qil_worker.parallel.state import ParallelState, collective

DEFAULT_TIMEOUT_S = 60.0
# Followers wait for rank 0's next step on the control group for as long as the server idles; a
# rank that dies still ends that wait at once (its connections close).
CONTROL_TIMEOUT = datetime.timedelta(days=7)


def backend_for(device: torch.device | str) -> str:
    """The collective library for tensors on ``device``."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: torch.device | str, rank: int) -> torch.device:
    """The device rank ``rank`` runs on: ``device`` as given, except that a CUDA device without
    an index means this rank's own GPU (``rank`` modulo the GPUs this process sees: a node's
    ranks are consecutive, so each gets a different one while they are no more than its GPUs)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


def join_group(
    rank: int, world_size: int, init_method: str, device: torch.device | str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None,
) -> ParallelState:
    """Initialise the default process group as rank ``rank`` of ``world_size`` (all ranks call
    it with the same ``init_method``: ``tcp://host:port`` or ``file:///path``) → its state,
    with a gloo control group beside it (``ParallelState.control_group``). A forward's
    collective that has not completed after ``timeout_s`` raises instead of hanging. On CUDA the
    rank's GPU (``rank_device``) becomes the current device, so that ``"cuda"`` means it from
    then on. ``backend``: the forward's collective library instead of ``backend_for(device)`` —
    ``"gloo"`` lets several ranks share one GPU, which NCCL refuses (gloo's all-reduce, gather
    and broadcast take CUDA tensors, through host copies: for tests, not for speed)."""
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend or backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return ParallelState(rank, world_size, None, control)


def gather_ints(parallel: ParallelState, value: int) -> list[int]:
    """Every rank's ``value``, in rank order (each rank calls it at the same point of its
    start-up; over the host control group, so device tensors play no part)."""
    if not parallel.sharded:
        return [value]
    values = [torch.zeros(1, dtype=torch.long) for _ in range(parallel.world_size)]
    collective(dist.all_gather, values, torch.tensor([value], dtype=torch.long), group=parallel.control_group)
    return [int(v.item()) for v in values]


def leave_group() -> None:
    """Destroy the default process group (once the ranks are done with it)."""
    if dist.is_initialized():
        dist.destroy_process_group()
