"""A node other than node 0 of a several-node tensor-parallel server: its ranks and nothing else.

``serve --nnodes K --node-rank R`` (R > 0) starts ranks ``R·N/K .. (R+1)·N/K − 1`` of the group
that node 0's worker leads, joined at ``--dist-init-addr`` (node 0's first rank hosts the TCP
store). The ranks follow rank 0's steps (``ranks.follower_main``); when the group ends — node
0's worker replaced after a failure, or stopped — they exit, and this node starts them again to
meet the next worker, each start bounded by the group's join timeout. SIGTERM or SIGINT stops
the node (its ranks die with it). Torch is imported by the ranks only.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from qil_worker.service.protocol import WorkerConfig
from qil_worker.service.worker.ranks import init_method_of, node_ranks, start_followers

log = logging.getLogger("qil.worker")

# between two starts of the ranks: long enough that a node whose group keeps failing does not
# spin, short against a worker's restart
REJOIN_DELAY_S = 1.0


def serve_node(config: WorkerConfig, announce: Callable[[str], None] = print) -> int:
    """Run this node's ranks until SIGTERM/SIGINT → the exit status (0 when stopped so)."""
    from qil_worker.model.demo import ensure_demo_model
    from qil_worker.service import logs
    from qil_worker.service.worker.startup import resolve_task

    logs.setup(config.log_level, config.log_format)
    model_dir = config.model if config.model is not None else str(ensure_demo_model())
    embedding = resolve_task(config.task, model_dir) == "embed"
    ranks = node_ranks(config)
    init_method = init_method_of(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    announce(f"qil node {config.node_rank} of {config.nnodes}: ranks {ranks.start}..{ranks.stop - 1} "
             f"of {config.tensor_parallel_size}, meeting at {init_method}")
    starts = 0
    while not stop.is_set():
        procs = start_followers(config, model_dir, config.tensor_parallel_size, init_method, embedding, ranks=ranks)
        starts += 1
        log.info("node %d: ranks started (%d time(s))", config.node_rank, starts)
        while not stop.is_set() and any(p.poll() is None for p in procs):
            stop.wait(0.2)  # a poll of the children: their exit has no event to wait on here
        for p in procs:
            if p.poll() is None:
                p.kill()  # ranks ignore SIGTERM (signals are their leader's to handle)
        for p in procs:
            p.wait()
        if not stop.is_set():
            log.warning("node %d: the group ended (rank exit codes %s); joining the next one",
                        config.node_rank, [p.returncode for p in procs])
            stop.wait(REJOIN_DELAY_S)
    announce(f"qil node {config.node_rank} stopped")
    return 0
