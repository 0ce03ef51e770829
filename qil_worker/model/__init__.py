"""The Qwen3 model: forward, layers, attention over the paged cache, strict loader."""

from qil_worker.model.attention import AttentionGroup, AttentionMetadata
from qil_worker.model.qwen3 import Qwen3

__all__ = ["AttentionGroup", "AttentionMetadata", "Qwen3"]
