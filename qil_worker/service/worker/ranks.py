"""The worker's tensor-parallel ranks: rank 0 is the worker process itself (engine, pipe to the
front); it spawns ranks 1..N-1, which load their shard and follow its steps
(``engine.runner.follower``) until it closes or the group fails.

A follower dies with the group: when rank 0 goes, its next collective fails at once and it
exits; when a follower goes, rank 0's engine fails as on a lost device and the worker exits to
be restarted whole by the supervisor (``service.front.supervisor``).
"""

from __future__ import annotations

import logging
import pickle
import socket
import subprocess
import sys
from typing import Any

log = logging.getLogger("qil.worker")


def local_init_method() -> str:
    """A ``tcp://`` rendezvous on a free local port, for the ranks of one machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def init_method_of(config: Any) -> str:
    """Where the ranks of the worker ``config`` meet: node 0's ``dist_init_addr`` across
    several nodes, else a free local port."""
    if config.nnodes > 1:
        return f"tcp://{config.dist_init_addr}"
    return local_init_method()


def node_ranks(config: Any) -> range:
    """The ranks the node ``config.node_rank`` of ``config.nnodes`` runs (rank 0 on node 0)."""
    per_node = config.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def start_followers(config: Any, model_dir: str, world_size: int, init_method: str,
                    embedding: bool = False, ranks: range | None = None) -> list[subprocess.Popen]:
    """Start ``ranks`` (default 1..``world_size``-1) of the worker ``config`` (a
    ``WorkerConfig``) → their processes; ``embedding``: the worker serves the model as an
    embedding model (its resolved task is embed), so each rank loads a headless checkpoint as
    rank 0 does, without a head. Fresh interpreters (``python -m qil_worker.service.worker.ranks``,
    their arguments pickled on stdin): the worker is a daemon process, which multiprocessing
    lets have no children."""
    procs = []
    for rank in ranks if ranks is not None else range(1, world_size):
        proc = subprocess.Popen([sys.executable, "-m", "qil_worker.service.worker.ranks"], stdin=subprocess.PIPE)
        proc.stdin.write(pickle.dumps((config, model_dir, rank, world_size, init_method, embedding)))
        proc.stdin.close()
        procs.append(proc)
    return procs


def _die_with_parent() -> None:
    """Linux: be killed when the worker that started this rank dies (however it dies)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def follower_main(config: Any, model_dir: str, rank: int, world_size: int, init_method: str,
                  embedding: bool = False) -> None:
    """Process entry point of rank ``rank``: join, load the shard, follow rank 0."""
    import dataclasses
    import signal

    import torch

    from qil_worker.cpu_memory import configure_process
    from qil_worker.engine.runner.follower import follow
    from qil_worker.model import Qwen3
    from qil_worker.parallel.group import gather_ints, join_group, leave_group
    from qil_worker.service import logs
    from qil_worker.service.worker.pool_agreement import agreed_pool

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front owns signals, as for rank 0
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    logs.setup(config.log_level, config.log_format)
    configure_process(config.device)
    if config.threads:
        torch.set_num_threads(config.threads)
    parallel = join_group(rank, world_size, init_method, device=config.device)
    model = Qwen3.from_directory(model_dir, device=config.device, dtype=config.dtype,
                                 quantize=config.quantize, parallel=parallel, embedding=embedding,
                                 compile=config.compile)
    weight_bytes = model.weight_summary()[1]
    gather_ints(parallel, weight_bytes)  # rank 0 reports every rank's weights (``startup.load``)
    pool = agreed_pool(model, config, parallel)  # as rank 0 does, after the same exchange
    log.info("tensor-parallel rank %d/%d: weights %d bytes, %d KV pages", rank, world_size, weight_bytes,
             pool.num_pages)
    steps = follow(model, dataclasses.replace(config.engine, num_pages=pool.num_pages))
    log.info("tensor-parallel rank %d stops after %d steps", rank, steps)
    leave_group()


if __name__ == "__main__":
    follower_main(*pickle.loads(sys.stdin.buffer.read()))
