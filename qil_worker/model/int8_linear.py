"""``y = x Wᵀ`` over a weight stored as per-output-channel symmetric int8 (weight-only).

Decoding reads every weight once per step, so bytes per weight decide its speed: int8 weights are
half of bfloat16's. Each output row ``W[i]`` is stored as ``q[i] = round(W[i] / s[i])`` clamped to
[-127, 127] with ``s[i] = max|W[i]| / 127`` (a zero row has scale 0 and codes 0), so that
``W ≈ q * s[:, None]``. Activations stay in the compute dtype: only the weight is quantized.

Kernels (``KERNELS``), chosen per shape at load by timing each candidate on that shape
(``choose_kernels``), for each size of step (``ROW_BUCKETS``: decode, large batches, prefill):

- ``int8pack``: ``torch._weight_int8pack_mm`` (CPU: AVX-512/AVX2 dot products over the int8 rows,
  float32 accumulation; CUDA where the torch build has it). It needs ``in_features % 16 == 0``
  and 32-byte-aligned contiguous activation rows (its vector loads read past the end or fault
  otherwise), which ``forward`` ensures.
- ``dequantize``: the weight dequantized to the compute dtype on every call, then ``F.linear``:
  the reference semantics, and what runs where ``int8pack`` cannot.

``Int8Linear.from_linear`` turns a plain ``Linear`` (before oneDNN packing) into one of these;
``Qwen3.quantize_weights`` swaps them in after loading.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker import cpu_memory
from qil_worker.errors import ConfigError

log = logging.getLogger(__name__)

KERNELS = ("int8pack", "dequantize")
KERNEL_NAMES = {"int8pack": "_weight_int8pack_mm", "dequantize": "dequantized per call"}
# Steps of up to ROW_BUCKETS[i] rows take the kernel chosen for bucket i, larger ones the last
# bucket's; each bucket's choice is timed at TIMED_ROWS[i] rows. torch's int8 kernel converts
# the weights again for every 4 rows, so it wins at decode sizes and loses badly at prefill
# sizes, where dequantizing the weight once per call and one GEMM win.
ROW_BUCKETS = (4, 32)
TIMED_ROWS = (1, 16, 128)
# A kernel later in ``KERNELS`` (the order of preference) is chosen only when it measures this
# much faster than the preferred one: timings on a shared machine move by tens of percent.
MARGIN = 1.25
# Rows quantized at a time: bounds the float32 temporaries (an LM head is 151,936 rows).
_QUANTIZE_ROWS = 8192
_ALIGN = 64


def quantize_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] → (int8 codes [out, in], scales [out] in ``scale_dtype``).

    The scale is rounded to ``scale_dtype`` first and the codes are computed against the stored
    scale, so ``dequantize`` is the best int8 approximation with the scale that is kept. Codes
    round half to even (``torch.round``); a row of zeros gets scale 0 and codes 0.
    """
    if weight.dim() != 2:
        raise ValueError(f"int8 quantization expects a [out, in] weight, got shape {tuple(weight.shape)}")
    out_features = weight.shape[0]
    codes = cpu_memory.empty(tuple(weight.shape), torch.int8, weight.device)
    scales = torch.empty(out_features, dtype=scale_dtype, device=weight.device)
    for start in range(0, out_features, _QUANTIZE_ROWS):
        rows = weight[start : start + _QUANTIZE_ROWS].float()
        scale = (rows.abs().amax(dim=1) / 127).to(scale_dtype)
        stored = scale.float()
        divisor = torch.where(stored > 0, stored, torch.ones_like(stored))
        codes[start : start + _QUANTIZE_ROWS] = torch.round(rows / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
        scales[start : start + _QUANTIZE_ROWS] = scale
    return codes, scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scales[:, None]`` computed in float32, returned in ``dtype``."""
    return (codes.float() * scales.float()[:, None]).to(dtype)


def int8pack_supported(in_features: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._weight_int8pack_mm`` can run this shape and dtype on ``device``."""
    if in_features % 16 or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    try:
        x = torch.zeros(1, 16, dtype=dtype, device=device)
        torch._weight_int8pack_mm(x, torch.zeros(1, 16, dtype=torch.int8, device=device),
                                  torch.ones(1, dtype=dtype, device=device))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


def available_kernels(in_features: int, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The kernels that can run this projection: ``dequantize`` everywhere on CPU; on CUDA only
    a real int8 kernel (a dequantizing fallback there would read more bytes than bf16)."""
    kernels = ["int8pack"] if int8pack_supported(in_features, device, dtype) else []
    if device.type == "cpu":
        kernels.append("dequantize")
    return kernels


class Int8Linear(nn.Module):
    """One projection's weight as int8 codes [out, in] and per-row scales [out] (compute dtype)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, kernels: str | tuple[str, ...] = "dequantize") -> None:
        """``kernels``: one kernel for every step size, or one per ``TIMED_ROWS`` bucket."""
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2 or scales.shape != codes.shape[:1]:
            raise ValueError(f"Int8Linear needs int8 codes [out, in] and scales [out], got "
                             f"{codes.dtype} {tuple(codes.shape)} and {tuple(scales.shape)}")
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)
        self.use_kernels(kernels)

    @classmethod
    def from_linear(cls, linear: nn.Module, kernels: str | tuple[str, ...] = "dequantize") -> "Int8Linear":
        """Quantize a plain (not oneDNN-packed) ``Linear``'s weight; scales in its dtype."""
        if getattr(linear, "packed", False):
            raise ValueError("int8 quantization needs the plain weight: quantize before packing for oneDNN")
        weight = linear.weight.data
        codes, scales = quantize_per_channel(weight, weight.dtype)
        return cls(codes, scales, kernels)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations and results)."""
        return self.scales.dtype

    def use_kernels(self, kernels: str | tuple[str, ...]) -> None:
        """Run ``kernels[i]`` for steps of the i-th ``ROW_BUCKETS`` size (one name: for all)."""
        kernels = (kernels,) * len(TIMED_ROWS) if isinstance(kernels, str) else tuple(kernels)
        if len(kernels) != len(TIMED_ROWS) or any(k not in KERNELS for k in kernels):
            raise ValueError(f"unknown int8 kernels {kernels!r}; expected {len(TIMED_ROWS)} of {KERNELS}")
        self.kernels = kernels
        self._small, self._medium, self._large = (getattr(self, "_" + k) for k in kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        run = self._small if n <= ROW_BUCKETS[0] else self._medium if n <= ROW_BUCKETS[1] else self._large
        return run(rows).view(*x.shape[:-1], self.out_features)

    # Called several times per layer per step: straight to ``forward``, as ``Linear`` does.
    __call__ = forward

    def _int8pack(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        # the kernel's aligned vector loads would fault; a compiled graph's buffers are aligned
        # (and it cannot read a pointer while it traces)
        if not torch.compiler.is_compiling() and x.data_ptr() % _ALIGN:
            x = x.clone()
        return torch._weight_int8pack_mm(x, self.weight, self.scales)

    def _dequantize(self, x: torch.Tensor) -> torch.Tensor:
        # int8 x compute dtype in one pass: the same products as ``dequantize``'s (the codes are
        # exact in any float dtype; each product is rounded once, to the compute dtype)
        return F.linear(x, self.weight * self.scales[:, None])

    @property
    def weight_format(self) -> str:
        return f"int8 per-channel (weight-only, {describe_kernels(self.kernels)})"

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + self.scales.numel() * self.scales.element_size()


def describe_kernels(kernels: tuple[str, ...]) -> str:
    """"_weight_int8pack_mm", or "_weight_int8pack_mm up to 32 rows, dequantized per call above"."""
    parts: list[str] = []
    for i, kernel in enumerate(kernels):
        name = KERNEL_NAMES[kernel]
        if parts and parts[-1][0] == name:
            parts[-1] = (name, i)
        else:
            parts.append((name, i))
    if len(parts) == 1:
        return parts[0][0]
    shown = [f"{name} up to {ROW_BUCKETS[last]} rows" for name, last in parts[:-1]]
    return ", ".join(shown) + f", {parts[-1][0]} above"


def _time_kernels(linear: Int8Linear, kernels: list[str], rows: int, rounds: int = 5,
                  budget_s: float = 0.3) -> dict[str, float]:
    """kernel → best seconds of one call on ``rows`` rows, over ``rounds`` calls of each taken in
    turn (so that a busy moment of the machine hits every kernel alike), after a warm-up; at
    least two rounds, fewer than ``rounds`` once they have taken ``budget_s`` (a slow kernel on
    an LM head takes a large part of a second per call: start-up should not wait for it)."""
    x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(0)).to(
        device=linear.weight.device, dtype=linear.dtype)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    runs = {kernel: getattr(linear, "_" + kernel) for kernel in kernels}
    for run in runs.values():
        run(x)
    best = dict.fromkeys(kernels, float("inf"))
    started = time.perf_counter()
    for round_ in range(rounds):
        if round_ >= 2 and time.perf_counter() - started > budget_s:
            break
        for kernel, run in runs.items():
            sync()
            start = time.perf_counter()
            run(x)
            sync()
            best[kernel] = min(best[kernel], time.perf_counter() - start)
    return best


def _fastest(times: dict[str, float]) -> str:
    """The preferred kernel (first in ``times``) unless another is ``MARGIN`` times faster."""
    preferred = next(iter(times))
    best = min(times, key=times.get)
    return best if times[best] * MARGIN < times[preferred] else preferred


def choose_kernels(linears: list[Int8Linear]) -> dict[tuple[int, int], tuple[str, ...]]:
    """Time every available kernel once per distinct shape, at each of ``TIMED_ROWS`` rows, and
    give each linear the fastest per step size; → shape → its kernels, one per bucket.

    Raises ``ConfigError`` where no kernel can run a shape (CUDA without an int8 kernel)."""
    chosen: dict[tuple[int, int], tuple[str, ...]] = {}
    for linear in linears:
        shape = (linear.out_features, linear.in_features)
        if shape not in chosen:
            kernels = available_kernels(linear.in_features, linear.weight.device, linear.dtype)
            if not kernels:
                raise ConfigError(
                    f"--quantize int8: this torch build has no int8 weight-only kernel for {linear.dtype} on "
                    f"{linear.weight.device.type} (torch._weight_int8pack_mm); serve without --quantize")
            if len(kernels) == 1:
                chosen[shape] = (kernels[0],) * len(TIMED_ROWS)
                log.info("int8 kernel for %dx%d: %s (the only one available)", *shape, kernels[0])
            else:
                times = {rows: _time_kernels(linear, kernels, rows) for rows in TIMED_ROWS}
                chosen[shape] = tuple(_fastest(times[rows]) for rows in TIMED_ROWS)
                log.info("int8 kernels for %dx%d: %s (%s)", *shape, describe_kernels(chosen[shape]),
                         "; ".join(f"{rows} rows: " + ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in ts.items())
                                   for rows, ts in times.items()))
        linear.use_kernels(chosen[shape])
    return chosen
