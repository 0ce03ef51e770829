"""Pre-quantized 4-bit checkpoints (AutoAWQ GEMM: ``awq.py``; GPTQ: ``gptq.py``) mapped onto
qil's projections: the tensors a model expects, their layout checked from the shards' headers,
and the ``Int4Linear`` each projection becomes.

qil fuses projections (q and k, or q, k and v; gate and up: ``DecoderLayer``, ``GatedMLP``),
where the checkpoint stores each linear on its own (``<module>.qweight``, ``.qzeros``,
``.scales``, ...). A projection whose parts are all quantized becomes one ``Int4Linear``: each
part unpacked to codes [N_i, K] and scales and minimums [N_i, K/G], concatenated along the
outputs in the projection's row order. The parts share K and the group size, so their groups
line up, and the fused projection stays one matmul. A Qwen3-MoE expert stack (gate/up, down)
becomes an ``Int4ExpertLinear`` of one such ``Int4Linear`` per expert. A projection of which
``modules_to_not_convert`` keeps only some parts in a float dtype stays a dense ``Linear``: its
quantized parts are dequantized into it. The LM head, embedding and norms are never quantized.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from safetensors import safe_open
from torch import nn

from qil_worker.config import AwqQuantization, GptqQuantization
from qil_worker.errors import WeightError
from qil_worker.model import awq, fp8, gptq
from qil_worker.model.expert_linear import ExpertLinear
from qil_worker.model.fp8 import TensorHeader
from qil_worker.model.int4_experts import Int4ExpertLinear
from qil_worker.model.int4_linear import Int4Linear, dequantize
from qil_worker.model.linear import Linear

Int4Quantization = AwqQuantization | GptqQuantization
# the format module of each quantization_config: LABEL, SUFFIXES, layout, unpackable, unpack_tensors
FORMATS: dict[type, ModuleType] = {AwqQuantization: awq, GptqQuantization: gptq}
DTYPES = {"int32": ("I32",), "float": ("F16", "BF16", "F32")}


@dataclass(frozen=True)
class Part:
    """One checkpoint linear inside a projection: ``module`` [out_features, in_features]."""

    module: str
    out_features: int
    in_features: int

    @property
    def weight(self) -> str:
        """The dense weight's name, which a quantized checkpoint does not have."""
        return self.module + ".weight"


@dataclass
class Projection:
    """A projection (``parent.attr``) with quantized parts, in its row order (expert by expert
    for a stack of ``experts``, 0: a plain projection); ``dense``: some part is not quantized,
    so the projection stays as it is and its quantized parts are dequantized into it."""

    parent: nn.Module
    attr: str
    parts: list[Part]
    dense: bool
    experts: int = 0


@dataclass
class Int4Plan:
    """Every quantized linear of a model, by projection, and their format."""

    format: ModuleType
    group_size: int
    projections: list[Projection]

    @property
    def parts(self) -> list[Part]:
        return [part for projection in self.projections for part in projection.parts]

    def weights(self) -> set[str]:
        """The dense weight names the quantized tensors stand in for."""
        return {part.weight for part in self.parts}

    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Checkpoint name → (shape, kind: "int32" or "float") of every quantized tensor."""
        return {f"{part.module}.{suffix}": spec for part in self.parts
                for suffix, spec in self.format.layout(part.out_features, part.in_features, self.group_size).items()}


def _storage(tensor: torch.Tensor) -> int:
    """Which allocation ``tensor`` views; meta tensors too (they have no data pointer)."""
    return tensor.untyped_storage()._cdata


def plan(model: nn.Module, quantization: Int4Quantization) -> Int4Plan:
    """Which of ``model``'s projections (every plain ``Linear`` but the LM head) hold which
    quantized linears: the decoder's q/k/v/o and gate/up/down not kept by
    ``modules_to_not_convert``. Shapes only: the weights may be deferred
    (``linear.deferred_weights``)."""
    targets = model.weight_targets()
    by_storage: dict[int, list[str]] = {}
    for name, view in targets.items():
        by_storage.setdefault(_storage(view), []).append(name)
    projections: list[Projection] = []
    for parent in list(model.modules()):
        for attr, child in parent.named_children():
            plain = type(child) is Linear and child is not getattr(model, "head", None)
            if not plain and type(child) is not ExpertLinear:
                continue
            # a stack's parts come expert by expert (gate then up within each): storage order
            names = sorted(by_storage.get(_storage(child.weight), []), key=lambda n: targets[n].storage_offset())
            quantized = [n for n in names if fp8.QUANTIZED_LINEAR.fullmatch(n)
                         and not fp8.skips_module(n.removesuffix(".weight"), quantization.modules_to_not_convert)]
            if not quantized:
                continue
            dense = len(quantized) != len(names)
            parts = [Part(n.removesuffix(".weight"), *targets[n].shape) for n in quantized]
            projections.append(Projection(parent, attr, parts, dense, 0 if plain else child.num_experts))
    return Int4Plan(FORMATS[type(quantization)], quantization.group_size, projections)


def materialize_dense(model: nn.Module, int4_plan: Int4Plan) -> None:
    """Allocate every deferred ``Linear`` weight the checkpoint fills densely: all but those of
    the projections that become ``Int4Linear``s."""
    swapped = {id(getattr(p.parent, p.attr)) for p in int4_plan.projections if not p.dense}
    for module in model.modules():
        if isinstance(module, (Linear, ExpertLinear)) and id(module) not in swapped:
            module.materialize()


def check_layout(int4_plan: Int4Plan, found: dict[str, TensorHeader]) -> list[str]:
    """Every layout problem, each naming its tensor: a linear whose shape the format cannot
    pack, a missing, mis-shaped or wrongly typed packed tensor. A dense weight where a
    quantized linear belongs, or a packed tensor of a module that is not one, is the generic
    check's (``loader.check_weights``: unknown)."""
    fmt, g = int4_plan.format, int4_plan.group_size
    problems = [f"not {fmt.LABEL}-packable: {part.module} [{part.out_features}, {part.in_features}] {why}"
                for part in int4_plan.parts
                if (why := fmt.unpackable(part.out_features, part.in_features, g)) is not None]
    if problems:
        return problems
    for name, (shape, kind) in int4_plan.tensors().items():
        header = found.get(name)
        if header is None:
            problems.append(f"missing: {name} (expected shape {shape} {kind})")
        elif header.shape != shape:
            problems.append(f"mis-shaped: {name} expected {shape}, got {header.shape}")
        elif header.dtype not in DTYPES[kind]:
            problems.append(f"bad dtype: {name} is {header.dtype}; expected {kind} ({'/'.join(DTYPES[kind])})")
    return problems


def load(int4_plan: Int4Plan, found: dict[str, TensorHeader], stored: dict[str, str],
         targets: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> int:
    """Read every quantized linear (the layout already checked) and put each projection in
    place: an ``Int4Linear`` in ``dtype`` swapped in for it, or (``dense``) its parts
    dequantized into their ``targets`` (the model's weight views, by dense name). ``stored``: a
    name's own in the file, where it differs. A value the headers cannot show wrong (GPTQ's
    ``g_idx``) is a ``WeightError`` naming the tensor. → how many ``Int4Linear``s."""
    fmt, swapped = int4_plan.format, 0
    with contextlib.ExitStack() as files:
        handles: dict[Path, object] = {}

        def read(name: str) -> torch.Tensor:
            path = found[name].path
            if path not in handles:
                handles[path] = files.enter_context(safe_open(str(path), framework="pt"))
            return handles[path].get_tensor(stored.get(name, name)).to(device)

        with torch.no_grad():
            for projection in int4_plan.projections:
                scale_dtype = torch.float32 if projection.dense else dtype
                try:
                    unpacked = [fmt.unpack_tensors({s: read(f"{part.module}.{s}") for s in fmt.SUFFIXES},
                                                   int4_plan.group_size, scale_dtype, part.module)
                                for part in projection.parts]
                except ValueError as exc:
                    raise WeightError(str(exc)) from None
                if projection.dense:
                    for part, (codes, scales, mins) in zip(projection.parts, unpacked):
                        targets[part.weight].copy_(dequantize(codes, scales, mins))
                    continue
                setattr(projection.parent, projection.attr, _int4(projection, unpacked, fmt.LABEL))
                swapped += 1
    return swapped


def _int4(projection: Projection, unpacked: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
          label: str) -> nn.Module:
    """The ``Int4Linear`` (an ``Int4ExpertLinear`` of one per expert, for a stack) of a
    projection's unpacked parts, each expert's parts concatenated along the outputs."""
    def fused(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> Int4Linear:
        codes, scales, mins = (torch.cat(t) if len(parts) > 1 else t[0] for t in zip(*parts))
        return Int4Linear(codes, scales, mins, label=label)

    if not projection.experts:
        return fused(unpacked)
    per = len(unpacked) // projection.experts
    return Int4ExpertLinear([fused(unpacked[e * per : (e + 1) * per]) for e in range(projection.experts)])
