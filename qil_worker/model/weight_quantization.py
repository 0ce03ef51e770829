"""Quantizing a loaded model's projections, and what its weights run in (formats and bytes).

``quantize_projections`` swaps every plain ``Linear`` for its quantized variant
(``int8_linear.Int8Linear``) and every stacked expert projection for
``int8_experts.Int8ExpertLinear`` (a MoE router stays as it is: see ``moe.Router``), chooses the
kernels per shape once, and logs the choice; ``weight_summary`` is what the start-up log and
GetInfo report.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch
from torch import nn

from qil_worker.model.expert_linear import ExpertLinear
from qil_worker.model.int4_experts import Int4ExpertLinear
from qil_worker.model.int4_linear import GROUP_SIZES, Int4Linear, group_size_fits
from qil_worker.model.int8_experts import Int8ExpertLinear
from qil_worker.model.int8_linear import Int8Linear, choose_kernels
from qil_worker.model.linear import Linear
from qil_worker.quantization import resolve_quantize

log = logging.getLogger(__name__)

# The LM head is quantized too by default: on the 0.6B shape it is a sixth of the weights read
# per decode step, and quantizing it adds almost nothing to the projections' logit error
# (docs/performance.md#int8-weight-only-2026-12-02).
QUANTIZE_HEAD = True


def projection_modules(module: nn.Module) -> list[nn.Module]:
    """The projection modules under ``module``: every module with ``weight_bytes``."""
    return [m for m in module.modules() if callable(getattr(m, "weight_bytes", None))]


def quantize_projections(model: nn.Module, method: str, head: bool | None = None) -> int:
    """Replace each plain ``Linear`` of ``model`` (the LM head ``model.head`` unless ``head`` is
    False) by its ``method`` variant; → how many were replaced. The replaced modules' weights
    are dropped with them (a tied head's is the embedding, which stays)."""
    method = resolve_quantize(method)
    if method is None:
        return 0
    head = QUANTIZE_HEAD if head is None else head
    start = time.perf_counter()
    group_size = GROUP_SIZES.get(method)
    int4 = 0
    swapped: list[Int8Linear] = []
    experts: list[Int8ExpertLinear] = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is ExpertLinear and group_size and group_size_fits(child.weight.shape[2], group_size):
                setattr(parent, name, Int4ExpertLinear.from_experts(child, group_size))
                int4 += 1
            elif type(child) is ExpertLinear:
                stacked = Int8ExpertLinear.from_experts(child)
                setattr(parent, name, stacked)
                experts.append(stacked)
            if type(child) is not Linear or (child is getattr(model, "head", None) and not head):
                continue
            if group_size and group_size_fits(child.weight.shape[1], group_size):
                setattr(parent, name, Int4Linear.from_linear(child, group_size))
                int4 += 1
                continue
            if group_size:  # int4 needs whole groups along the input: this one stays int8
                log.info("%s: in_features %d is not a multiple of %d, quantized to int8 instead",
                         name, child.weight.shape[1], group_size)
            quantized = Int8Linear.from_linear(child)
            setattr(parent, name, quantized)
            swapped.append(quantized)
    with torch.inference_mode():
        # one expert stands for all of its stack (same shape): timed with the projections
        choose_kernels(swapped + [stack.probe() for stack in experts])
    for stack in experts:
        stack.use_kernels(stack.probe().kernels)
    log.info("weights quantized to %s: %s%d int8 projections%s (LM head %s) in %.1f s", method,
             f"{int4} int4 projections or expert stacks, " if group_size else "",
             len(swapped), f", {len(experts)} int8 stacked expert projections" if experts else "",
             "yes" if head else "no", time.perf_counter() - start)
    return int4 + len(swapped) + len(experts)


def weight_summary(model: nn.Module) -> tuple[str, int]:
    """("<count>x <format>, ..." over the projections, then the other weights' dtypes; bytes of
    every weight held, a tensor shared by two places (a tied, unpacked head) counted once)."""
    seen: set[int] = set()
    total = 0
    formats: Counter[str] = Counter()
    for proj in projection_modules(model):
        formats[proj.weight_format] += 1
        # recursing: packed experts keep their weights in a ParameterList child
        own = [id(t) for t in (*proj.parameters(), *proj.buffers())]
        if not any(i in seen for i in own):
            total += proj.weight_bytes()
        seen.update(own)
    others: Counter[str] = Counter()
    for tensor in model.parameters():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
            others[str(tensor.dtype).removeprefix("torch.")] += 1
    parts = [f"{n}x {fmt}" for fmt, n in formats.most_common()]
    if others:
        parts.append("embedding and norms " + "/".join(others))
    return ", ".join(parts), total
