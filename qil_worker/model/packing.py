"""oneDNN packing of a loaded model's plain projections, experts and LM head (CPU)."""

from __future__ import annotations

import logging
import time

from torch import nn

from qil_worker.model.expert_linear import ExpertLinear
from qil_worker.model.linear import Linear, packing_supported
from qil_worker.model.moe import Router
from qil_worker.model.weight_quantization import projection_modules

# The model's start-up lines keep the logger they have always had (tests and log filters read it).
log = logging.getLogger("qil_worker.model.qwen3")

# The projection types packing applies to: quantized and FP8 ones run on their own kernels.
PLAIN_PROJECTIONS = (Linear, Router, ExpertLinear)


def pack_model(model: nn.Module) -> int:
    """Pack every plain projection, every expert and the LM head for oneDNN (CPU; see
    ``linear.py`` and ``expert_linear.py``): each then holds only its packed weight; → how many
    layers were packed (0 where unsupported).

    A tied LM head is packed as a copy (the embedding table stays for lookups) — one more vocab
    x hidden matrix of memory, for a markedly faster LM head at decode sizes.
    """
    if not packing_supported(model.device, model.dtype):
        return 0
    start = time.perf_counter()
    plain = [layer for layer in model.layers
             if all(type(m) in PLAIN_PROJECTIONS for m in projection_modules(layer))]
    packed = sum(layer.pack_weights() for layer in plain)
    head = type(model.head) is Linear and model.head.pack()
    log.info("weights packed for oneDNN: %d/%d layers, LM head %s (%.1f s)",
             packed, len(model.layers), "yes" if head else "no", time.perf_counter() - start)
    return packed
