"""AutoAWQ GEMM tensors (packed by tests/helpers/int4_checkpoints.py from the format's
definition) unpacked into ``Int4Linear``: the same weight, both kernels; the config checked."""

from __future__ import annotations

import pytest
import torch

from int4_checkpoints import awq_quantize, pack_awq_columns
from qil_worker.errors import ConfigError
from qil_worker.model import awq
from qil_worker.model.int4_linear import Int4Linear, dequantize


def test_unpacking_inverts_autoawq_packing_order():
    values = torch.randint(0, 16, (3, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(awq.unpack_columns(pack_awq_columns(values)).long(), values)
    one = torch.zeros(1, 8, dtype=torch.long)
    one[0, 1] = 5  # output 1 sits in nibble 4 (bits 16..19)
    assert pack_awq_columns(one).item() == 5 << 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_an_awq_linear_runs_as_its_dequantized_weight(dtype):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    tensors, want = awq_quantize(weight, 128)
    codes, scales, mins = awq.unpack(tensors["qweight"], tensors["qzeros"], tensors["scales"], 128, torch.float32)
    torch.testing.assert_close(dequantize(codes, scales, mins), want, atol=1e-5, rtol=0)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    codes, scales, mins = awq.unpack(tensors["qweight"], tensors["qzeros"], tensors["scales"], 128, dtype)
    ref = x.double() @ want.double().t()
    size = x.double().abs() @ want.double().abs().t()
    for kernel in ("int4pack", "dequantize"):
        got = Int4Linear(codes, scales, mins, kernel)(x).double()
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7
        assert ((got - ref).abs() <= tolerance * size + 1e-5).all(), kernel


def test_a_tensor_of_the_wrong_layout_is_refused_by_name():
    tensors, _ = awq_quantize(torch.randn(16, 256), 128)
    with pytest.raises(ValueError, match=r"layers.0.q_proj.qzeros: expected shape \[2, 2\] int32"):
        awq.unpack(tensors["qweight"], tensors["qzeros"][:1], tensors["scales"], 128, torch.float32,
                   "layers.0.q_proj")


@pytest.mark.parametrize("key, value", [("bits", 8), ("zero_point", False), ("version", "gemv"), ("group_size", 0)])
def test_unsupported_awq_configs_name_their_key(key, value):
    raw = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm", key: value}
    with pytest.raises(ConfigError, match=f"quantization_config.{key}: "):
        awq.check_config(raw)
    assert awq.check_config({**raw, key: {"bits": 4, "zero_point": True, "version": "GEMM", "group_size": 32}[key]}) \
        in (128, 32)
