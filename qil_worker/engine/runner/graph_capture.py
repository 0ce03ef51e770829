"""Capturing a step's body into a CUDA graph, shared by every graph runner of an engine.

The decode graphs and the mixed-step graphs (``decode_graphs``, ``step_graphs``) capture their
bodies through one ``GraphCapture``: one memory pool, so that graphs — which never run at the
same time — reuse each other's intermediate buffers, and one capture stream, because the
allocator reuses a pool's blocks only on the stream they were captured on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


class GraphCapture:
    """Captures bodies on one device into graphs that share one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cuda"  # False after a failed capture: eager from then on
        self._pool = torch.cuda.graph_pool_handle() if self.enabled else None
        self._stream = torch.cuda.Stream(device) if self.enabled else None
        self.seconds = 0.0  # spent capturing, all graphs together
        self.count = 0

    def capture(self, body: Callable[[], torch.Tensor], what: str) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """(graph, its output) of ``body`` run once eagerly (lazy initialisation, workspace sizes)
        and then captured; None when capture fails here, after which ``enabled`` is False and the
        callers run their bodies eagerly. ``what`` names the graph in the log."""
        if not self.enabled:
            return None
        t0 = time.perf_counter()
        try:
            # On the model's device even when it is not the current one (cuda:1): kernels go to
            # the current stream of their tensors' device, and only that stream's work is captured.
            with torch.cuda.device(self.device):
                side = self._stream
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    body()
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, stream=side):
                    output = body()
        except Exception:  # noqa: BLE001 - a build that cannot capture still serves, eagerly
            log.warning("CUDA graph capture failed (%s); those steps run eagerly from now on", what, exc_info=True)
            self.enabled = False
            return None
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        self.count += 1
        log.info("captured CUDA graph: %s, in %.0f ms (%d graphs, %.1f s total)", what, 1000 * seconds,
                 self.count, self.seconds)
        return graph, output
