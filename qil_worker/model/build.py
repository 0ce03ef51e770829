"""A Hugging Face Qwen3 directory → a ready ``Qwen3``: config, dtype, strict weights, then the
load-time policy (FP8 kept or dequantized, AWQ/GPTQ int4, int8/int4 quantization, oneDNN
packing) and its log lines.

``Qwen3.from_directory`` is the entry point and hands its class to ``build_model`` (so this
module needs no import of the model's). config.json's ``model_type`` decides the architecture:
dense Qwen3, or Qwen3-MoE (the same ``Qwen3`` class with ``moe.SparseMoeBlock`` MLPs in its
sparse layers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from qil_worker.config import AwqQuantization, Fp8Quantization, GptqQuantization, Qwen3Config
from qil_worker.errors import ConfigError
from qil_worker.model.dtypes import resolve_device, resolve_dtype
from qil_worker.model.linear import deferred_weights
from qil_worker.parallel import SINGLE, ParallelState, check_tp_size
from qil_worker.quantization import resolve_quantize

# The model's start-up lines keep the logger they have always had (tests and log filters read it).
log = logging.getLogger("qil_worker.model.qwen3")


def build_model(
    model_class: Callable[..., nn.Module],
    path: str | Path,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    pack_weights: bool = True,
    fused_projections: bool | None = None,
    fp8: str = "auto",
    quantize: str | None = None,
    parallel: ParallelState = SINGLE,
    embedding: bool = False,
    compile: bool = True,
) -> nn.Module:
    """Load a Hugging Face Qwen3 or Qwen3-MoE directory strictly (see ``loader.load_weights``)
    into a new ``model_class`` (``Qwen3``).

    ``device`` defaults to CPU; ``dtype`` to bfloat16 on CUDA and float32 elsewhere
    (``"auto"`` takes the checkpoint's own dtype). ``pack_weights``: on CPU, pack the
    weights for oneDNN after loading (``pack_model``); False keeps the plain parameters.
    ``fused_projections``: see ``Qwen3`` (True also runs MoE experts through the grouped
    kernel, as on CUDA). ``fp8`` (FP8 checkpoints only): ``"auto"`` keeps the FP8 weights and
    runs block-scaled FP8 matmuls where the device runs them right (``fp8_linear.py``; dense
    projections only, experts are always dequantized), else dequantizes to ``dtype`` at load;
    ``"dequantize"`` always does. ``quantize``: None (or "none") keeps the weights in the compute
    dtype; "int8" quantizes them at load (``Qwen3.quantize_weights``), before packing — an FP8
    checkpoint is then dequantized first, whatever ``fp8`` says. An AWQ or GPTQ checkpoint's
    projections load as int4 (``int4_checkpoint.py``), and any ``quantize`` with it is a
    ``ConfigError``. ``parallel``: this rank's place in a tensor-parallel group; the model is
    refused (``ConfigError`` naming the fields and the sizes that work) unless its shapes split
    over ``parallel.world_size``, and the rank loads only its slices of the weights. ``embedding``: the caller serves it as an embedding model, so a
    headless checkpoint (``embedding_checkpoint.detect``) loads without an LM head; otherwise
    a missing head is an error like any missing tensor. ``compile``: on CPU, compile the kernels
    that measure faster compiled (``Qwen3.compile_cpu_kernels``: int8 experts' decode steps),
    falling back to eager with one log line where compiling fails.
    """
    from qil_worker.model import fp8_linear
    from qil_worker.model.embedding_checkpoint import has_lm_head
    from qil_worker.model.loader import load_weights, stored_dtype

    if fp8 not in ("auto", "dequantize"):
        raise ConfigError(f"fp8: expected 'auto' or 'dequantize', got {fp8!r}")

    config = Qwen3Config.from_directory(path)
    if embedding and not has_lm_head(Path(path), config):
        config = dataclasses.replace(config, headless=True)
    check_tp_size(config, parallel.world_size)
    quantize = resolve_quantize(quantize)
    int4 = isinstance(config.quantization, (AwqQuantization, GptqQuantization))
    method = "AWQ" if isinstance(config.quantization, AwqQuantization) else "GPTQ"
    if int4 and quantize is not None:
        article = "an" if method == "AWQ" else "a"
        raise ConfigError(
            f"quantize: {quantize!r} cannot be applied to {article} {method} checkpoint, whose projections "
            f"load as int4 already (quantization_config.quant_method {method.lower()!r}); leave quantize "
            "unset ('none')"
        )
    device = resolve_device(device)
    checkpoint_dtype = config.torch_dtype
    if dtype == "auto" and checkpoint_dtype is None:  # as transformers: the stored tensors'
        checkpoint_dtype = stored_dtype(Path(path))
    with deferred_weights() if int4 else contextlib.nullcontext():  # int4 projections, not dense ones
        model = model_class(
            config, device=device, dtype=resolve_dtype(dtype, device, checkpoint_dtype),
            fused_projections=fused_projections, parallel=parallel,
        )
    is_fp8 = isinstance(config.quantization, Fp8Quantization)
    keep_fp8 = is_fp8 and fp8 == "auto" and quantize is None
    kernels = fp8_linear.cuda_kernels(device) if keep_fp8 else []
    kept: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = {} if kernels else None
    load_weights(model, Path(path), keep_fp8=kept)
    summary = fp8_linear.use_fp8(model, kept, kernels) if kept is not None else None
    if quantize is not None:
        model.quantize_weights(quantize)
    if pack_weights:
        model.pack_weights()
    if compile:
        model.compile_cpu_kernels()
    if is_fp8:
        log.info("%s", fp8_linear.describe(model, summary))
    elif int4:
        formats, size = model.weight_summary()
        log.info("%s checkpoint: %s; weights in memory %.1f MiB", method, formats, size / 2**20)
    if config.is_moe:
        log.info("%s", config.describe())
    return model.eval()
