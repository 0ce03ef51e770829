"""The Qwen3 model: forward, layers, projections, strict loader."""

from qil_worker.model.qwen3 import Qwen3

__all__ = ["Qwen3"]
