"""The Qwen3 model (dense and MoE): forward, layers, projections, strict loader."""

from qil_worker.model.qwen3 import Qwen3

# The one loading entry point under a plain name (``Qwen3.from_directory``).
load_model = Qwen3.from_directory

__all__ = ["Qwen3", "load_model"]
