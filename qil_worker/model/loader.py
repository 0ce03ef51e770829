"""Strict SafeTensors loading: every expected tensor present, nothing unknown, shapes exact.

All problems are collected first (from the shards' headers, without reading tensor data) and
raised as one ``WeightError``. Tensors are then read one at a time, shard by shard, and copied
(with dtype conversion) straight into the model's parameters, so at most one tensor exists twice.

FP8 checkpoints (``quantization_config``, see ``fp8.py``) are checked the same way — each
quantized weight F8_E4M3 with a scale grid of its shape, no scale or FP8 tensor elsewhere — and
their weights dequantized into the parameters as they are read (block rows at a time), unless the
caller keeps them in FP8 (``keep_fp8``: the CUDA scaled-mm path, ``fp8_linear.py``).

AWQ and GPTQ checkpoints (``int4_checkpoint.py``) are checked in the same pass — each quantized
linear's packed tensors (qweight, qzeros, scales, GPTQ's g_idx) present, of their shapes and
dtypes, and no dense weight in their place — and their projections replaced by ``Int4Linear``s
after the dense tensors are read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from qil_worker.config import Fp8Quantization
from qil_worker.errors import WeightError
from qil_worker.model import fp8, int4_checkpoint
from qil_worker.model.fp8 import TensorHeader
from qil_worker.model.int4_checkpoint import Int4Quantization
from qil_worker.parallel.shards import Shard

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TIED_HEAD = "lm_head.weight"


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the single file, else the index's shards (the
    order transformers looks in, so both load the same weights when a directory has both)."""
    single = directory / SINGLE_FILE
    if single.exists():
        return [single]
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightError(f"{index}: not a valid safetensors index ({exc})") from None
        files = sorted({directory / name for name in weight_map.values()})
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise WeightError(f"{index}: shard file(s) listed but not found: {', '.join(missing)}")
        return files
    hint = ""
    if any(directory.glob("pytorch_model*.bin")):
        hint = (
            "; it has PyTorch .bin weights, which qil does not load (they are pickles): convert "
            "them to safetensors, e.g. save_pretrained(..., safe_serialization=True)"
        )
    raise WeightError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found{hint}")


STORED_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def stored_dtype(directory: Path) -> str | None:
    """The dtype the checkpoint's floating-point tensors are stored in (the first one's, read
    from a header), as ``torch_dtype`` spells it; None when it cannot be told."""
    try:
        files = shard_files(directory)
        with safe_open(str(files[0]), framework="pt") as f:
            for name in f.keys():
                found = STORED_DTYPES.get(f.get_slice(name).get_dtype())
                if found is not None:
                    return found
    except Exception:  # noqa: BLE001 - a broken checkpoint: loading reports the real problem
        return None
    return None


def read_headers(files: list[Path]) -> dict[str, TensorHeader]:
    """Tensor name → (file, shape, dtype) from the shards' headers; a name in two shards is an
    error."""
    found: dict[str, TensorHeader] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in found:
                    raise WeightError(f"{name}: present in both {found[name][0].name} and {path.name}")
                info = f.get_slice(name)
                found[name] = TensorHeader(path, tuple(info.get_shape()), info.get_dtype())
    return found


MODEL_PREFIX = "model."


def with_model_prefix(found: dict[str, TensorHeader]) -> tuple[dict[str, TensorHeader], dict[str, str]]:
    """A base ``Qwen3Model``'s checkpoint (no tensor name starts with ``model.``, as
    Qwen3-Embedding's are saved) read as a causal LM's: → (the headers under ``model.``-prefixed
    names, each such name's stored name). Another layout is returned as it is."""
    if not found or any(name.startswith(MODEL_PREFIX) or name == TIED_HEAD for name in found):
        return found, {}
    stored = {name: MODEL_PREFIX + name for name in found}
    return {stored[name]: header for name, header in found.items()}, stored


def check_weights(
    targets: dict[str, torch.Tensor], found: dict[str, TensorHeader], tied: bool,
    fp8_problems: Sequence[str] = (), shards: dict[str, Shard] | None = None,
    known: Collection[str] = (),
) -> None:
    """Raise one ``WeightError`` listing every missing, unknown and mis-shaped tensor, and the
    quantized layouts' ``fp8_problems`` (``fp8.check_layout``, which owns every
    ``weight_scale_inv``; ``int4_checkpoint.check_layout``, which owns the ``known`` packed
    int4 tensors).
    ``shards``: the tensors of which a target holds a slice (tensor parallelism), checked
    against their whole shape."""
    problems: list[str] = []
    shards = shards or {}
    for name, target in targets.items():
        shape = tuple(target.shape)
        if name in shards:
            shape = shards[name].full_shape(shape)
        if name not in found:
            problems.append(f"missing: {name} (expected shape {shape})")
        elif found[name][1] != shape:
            problems.append(f"mis-shaped: {name} expected {shape}, got {found[name][1]}")
    for name in sorted(found):
        if name not in targets and name not in known and not (tied and name == TIED_HEAD) \
                and not name.endswith(fp8.SCALE_SUFFIX):
            problems.append(f"unknown: {name} (shape {found[name][1]})")
    problems.extend(fp8_problems)
    if problems:
        hint = ""
        if TIED_HEAD in targets and TIED_HEAD not in found:
            hint = (f"\n(a checkpoint without {TIED_HEAD} loads only as an embedding model: "
                    "from_directory(..., embedding=True))")
        raise WeightError(
            f"checkpoint does not match the config ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems) + hint
        )


def load_weights(
    model: torch.nn.Module, directory: Path,
    keep_fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Fill ``model``'s parameters from ``directory`` (see module docstring).

    ``keep_fp8``: a dict that receives each FP8 weight as (float8_e4m3fn weight, float32 scale
    grid) on the model's device, by checkpoint name, instead of its dequantization; those
    weights' parameters are left unwritten for the caller (``fp8_linear.use_fp8``). MoE experts
    are dequantized all the same: no FP8 kernel runs them.

    Under tensor parallelism (``model.weight_shards()``) only each split tensor's slice is read
    from the file (``get_slice``): no rank reads the whole model."""
    targets = model.weight_targets()
    shards = model.weight_shards()
    files = shard_files(directory)
    found, stored = with_model_prefix(read_headers(files))
    quantization = model.config.quantization
    quantized = fp8.quantized_weights(targets, quantization, shards)
    block = quantization.block_size if isinstance(quantization, Fp8Quantization) else (0, 0)
    problems = fp8.check_layout(quantized, found, block)
    int4_plan = int4_checkpoint.plan(model, quantization) if isinstance(quantization, Int4Quantization) else None
    if int4_plan is not None:  # its linears are read apart, after the dense tensors
        int4_checkpoint.materialize_dense(model, int4_plan)
        int4_targets = model.weight_targets()  # views of the weights just allocated
        targets = {name: t for name, t in int4_targets.items() if name not in int4_plan.weights()}
        problems += int4_checkpoint.check_layout(int4_plan, found)
    check_weights(targets, found, tied=model.config.tie_word_embeddings, fp8_problems=problems, shards=shards,
                  known=int4_plan.tensors() if int4_plan is not None else ())
    own_names = {prefixed: name for name, prefixed in stored.items()}
    scales = fp8.read_scales(found, quantized, own_names)
    with torch.no_grad():
        for i, path in enumerate(files, 1):
            log.info("loading weights: shard %d/%d (%s)", i, len(files), path.name)
            with safe_open(str(path), framework="pt") as f:
                for stored_name in f.keys():
                    name = stored.get(stored_name, stored_name)
                    target = targets.get(name)
                    if target is None:  # a scale, or a tied checkpoint's own lm_head copy
                        continue
                    shard = shards.get(name)
                    if name not in quantized:
                        target.copy_(f.get_tensor(stored_name) if shard is None
                                     else f.get_slice(stored_name)[shard.index()])
                        continue
                    # an FP8 weight (or this rank's slice of it) and the scales of its blocks
                    scale = scales[fp8.scale_name(name)]
                    if shard is None:
                        weight = f.get_tensor(stored_name)
                    else:
                        weight = f.get_slice(stored_name)[shard.index()]
                        scale = scale[fp8.scale_shard(shard, block).index()]
                    if keep_fp8 is not None and not fp8.EXPERT_LINEAR.fullmatch(name):
                        keep_fp8[name] = (weight.to(target.device), scale.to(target.device))
                    else:
                        fp8.dequantize_into(target, weight, scale, block)
    if int4_plan is not None:
        swapped = int4_checkpoint.load(int4_plan, found, own_names, int4_targets, model.dtype, model.device)
        log.info("%s: %d projections int4 (%d checkpoint linears), %d dequantized into dense ones",
                 int4_plan.format.LABEL, swapped, len(int4_plan.parts), len(int4_plan.projections) - swapped)
    if model.config.tie_word_embeddings and TIED_HEAD in found:
        check_tied_copy(found, shards.get(EMBEDDING))


EMBEDDING = "model.embed_tokens.weight"


def check_tied_copy(found: dict[str, TensorHeader], shard: Shard | None = None) -> None:
    """A tied checkpoint may carry its LM head too, but only as a copy of the embedding:
    transformers would use a different one untied, so ignoring it would change every logit.
    ``shard``: compare only this rank's rows (tensor parallelism)."""
    def read(name: str) -> torch.Tensor:
        with safe_open(str(found[name][0]), framework="pt") as f:
            return f.get_tensor(name) if shard is None else f.get_slice(name)[shard.index()]

    if not torch.equal(read(TIED_HEAD), read(EMBEDDING)):
        raise WeightError(
            f"config.json ties the LM head to the embedding (tie_word_embeddings: true), but the "
            f"checkpoint's {TIED_HEAD} differs from {EMBEDDING}; transformers would use it untied. "
            "Set tie_word_embeddings to false if the separate head is meant."
        )
