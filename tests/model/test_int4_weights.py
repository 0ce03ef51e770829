"""int4 weight-only serving: the group-wise quantization math, both kernels against the
dequantized weight, a quantized model against the same model run on its dequantized weights
(exactly, to float32 rounding) and against full precision (a bound), MoE experts, the flags."""

from __future__ import annotations

import pytest
import torch

from checkpoints import make_checkpoint, make_moe_checkpoint
from engine_helpers import assert_pool_free, run_to_completion
from qil_worker import Engine, Qwen3
from qil_worker.engine.probe import ForwardProbe
from qil_worker.model.expert_linear import ExpertLinear
from qil_worker.model.int4_experts import Int4ExpertLinear
from qil_worker.model.int4_linear import (
    Int4Linear, dequantize, int4pack_supported, pack_nibbles, quantize_groupwise, to_kernel_zeros, unpack_nibbles,
)
from qil_worker.model.int8_linear import Int8Linear
from qil_worker.model.linear import Linear

# A 4-bit model's logits against the full-precision one: a sanity bound only (the exact check
# is against the dequantized weights). These tiny models' Gaussian weights (no outlier-free
# trained structure, logits of 97-160 tokens within a few units) lose ~40% of the max logit and
# about half of the argmaxes to 16 levels per group, against ~5% and none for int8; a wrong
# zero or scale convention loses all of them (agreement near 1/vocab).
MAX_RELATIVE_LOGIT_ERROR = 0.5
MIN_GREEDY_AGREEMENT = 0.4


def test_quantize_hand_computed_group():
    w = torch.tensor([[0.0, 1.5, 3.0, 30.0, -1.0, -1.0, -1.0, -1.0]])
    codes, scales, mins = quantize_groupwise(w, 4, torch.float32)
    # group 0: min 0, scale 30 / 15 = 2; group 1 constant: scale 0, codes 0, min kept
    assert scales.tolist() == [[2.0, 0.0]] and mins.tolist() == [[0.0, -1.0]]
    assert codes.tolist() == [[0, 1, 2, 15, 0, 0, 0, 0]]  # 1.5/2 = .75 → 1; 3/2 = 1.5 → 2
    assert dequantize(codes, scales, mins).tolist() == [[0.0, 2.0, 4.0, 30.0, -1.0, -1.0, -1.0, -1.0]]


def test_codes_stay_in_range_and_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=g) * 3
    for dtype in (torch.float32, torch.bfloat16):
        codes, scales, mins = quantize_groupwise(w, 32, dtype)
        assert codes.max() <= 15 and scales.shape == (48, 8) and scales.dtype == dtype
        error = (dequantize(codes, scales, mins) - w).abs().view(48, 8, 32)
        # half a step, plus the rounding of the stored min and scale (bf16: 2^-8 relative)
        slack = 0 if dtype == torch.float32 else 2**-8 * (w.abs().amax() * 2)
        assert (error <= scales.float()[..., None] / 2 + 1e-5 + slack).all()


def test_nibbles_round_trip_and_kernel_zeros_follow_torch_convention():
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    scales, mins = torch.rand(16, 2), torch.randn(16, 2)
    sz = to_kernel_zeros(scales, mins)
    assert sz.shape == (2, 16, 2)
    # torch's kernels compute (q - 8)·s + z: the same weight as q·s + m
    q = codes.float().view(16, 2, 32)
    torch_form = (q - 8) * sz[..., 0].t()[..., None] + sz[..., 1].t()[..., None]
    torch.testing.assert_close(torch_form.view(16, 64), dequantize(codes, scales, mins))


def test_a_group_size_that_does_not_divide_the_inputs_is_refused():
    with pytest.raises(ValueError, match="in_features 40 is not a multiple of the group size 32"):
        quantize_groupwise(torch.randn(16, 40), 32, torch.float32)


def _linear(out_features: int, in_features: int, dtype: torch.dtype) -> Linear:
    layer = Linear(out_features, in_features, dtype, torch.device("cpu"))
    layer.weight.data.copy_(torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(2)))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(48, 256, 128), (32, 96, 32), (40, 64, 32)], ids=["g128", "g32", "out40"])
def test_both_kernels_match_the_dequantized_weight(dtype, shape):
    out_features, in_features, group = shape
    plain = _linear(out_features, in_features, dtype)
    codes, scales, mins = quantize_groupwise(plain.weight.data, group, dtype)
    weight = dequantize(codes, scales, mins).double()
    x = torch.randn(5, 3, in_features, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = x.double() @ weight.t()
    size = x.double().abs() @ weight.abs().t()
    kernels = ["dequantize"] + (["int4pack"] if int4pack_supported(out_features, in_features, group,
                                                                    torch.device("cpu"), dtype) else [])
    assert ("int4pack" in kernels) == (out_features % 16 == 0)  # the CPU kernel runs every such shape here
    for kernel in kernels:
        layer = Int4Linear(codes, scales, mins, kernel)
        got = layer(x)
        assert got.shape == (5, 3, out_features) and got.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2**-7
        assert ((got.double() - want).abs() <= tolerance * size + 1e-6).all(), kernel
        for rows in (1, 2, 15):  # decode-sized and larger steps alike
            part = layer(x.view(-1, in_features)[:rows]).double()
            assert ((part - want.view(-1, out_features)[:rows]).abs()
                    <= tolerance * size.view(-1, out_features)[:rows] + 1e-6).all(), (kernel, rows)
    chosen = Int4Linear.from_linear(plain, group)
    assert chosen.kernel == kernels[-1]
    assert f"int4 asymmetric group {group}" in chosen.weight_format


def test_int4_bytes_are_about_a_quarter_of_bfloat16():
    layer = Int4Linear.from_linear(_linear(256, 1024, torch.bfloat16), 128)
    assert layer.kernel == "int4pack"
    # half a byte per weight, plus a bf16 scale and zero per 128 weights
    assert layer.weight_bytes() == 256 * 1024 // 2 + 256 * 8 * 2 * 2


# ---------------------------------------------------------------------------------------------
# a quantized model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def g128_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("int4"), seed=5, hidden_size=128, intermediate_size=256,
                           head_dim=32, tie_word_embeddings=False, vocab_size=160)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("int4-tiny"), seed=3)


def _prompt(n: int, seed: int, vocab: int = 97) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_logits(model: Qwen3, ids: list[int]) -> torch.Tensor:
    probe = ForwardProbe(model, num_pages=32, page_size=8)
    (logits,) = probe.forward([(probe.sequence(ids), len(ids))])
    return logits.float()


def _decode_logits(model: Qwen3, ids: list[int]) -> torch.Tensor:
    probe = ForwardProbe(model, num_pages=32, page_size=4)
    seq = probe.sequence(ids)
    return torch.cat([probe.forward([(seq, 1)])[0] for _ in ids]).float()


def _dequantized_model(path, group: int) -> Qwen3:
    """The model with each projection's weight replaced by its int4 dequantization: the
    reference the int4 kernels must reproduce."""
    model = Qwen3.from_directory(path, dtype="float32", pack_weights=False)
    for module in model.modules():
        if type(module) is Linear and module.weight.shape[1] % group == 0:
            module.weight = torch.nn.Parameter(dequantize(*quantize_groupwise(module.weight.data, group, torch.float32)),
                                               requires_grad=False)
        elif type(module) is ExpertLinear:
            w = module.weight.data
            for e in range(w.shape[0]):
                w[e] = dequantize(*quantize_groupwise(w[e], group, torch.float32))
    return model


@pytest.mark.parametrize("method, group, fixture", [("int4", 128, "g128_dir"), ("int4-g32", 32, "tiny_dir")])
def test_int4_model_matches_its_dequantized_weights_and_stays_near_full_precision(request, method, group, fixture):
    path = request.getfixturevalue(fixture)
    int4 = Qwen3.from_directory(path, dtype="float32", quantize=method)
    layer = int4.layers[0]
    assert all(isinstance(m, Int4Linear) for m in (layer.qk_proj, layer.v_proj, layer.o_proj))
    assert isinstance(int4.head, Int4Linear) and int4.head.group_size == group
    vocab = int4.config.vocab_size
    ids = _prompt(40, 7, vocab)
    reference = _prefill_logits(_dequantized_model(path, group), ids)
    full = _prefill_logits(Qwen3.from_directory(path, dtype="float32"), ids)
    for got in (_prefill_logits(int4, ids), _decode_logits(int4, ids)):
        torch.testing.assert_close(got, reference, atol=2e-4, rtol=1e-4)
        assert (got - full).abs().max() <= MAX_RELATIVE_LOGIT_ERROR * full.abs().max()
        assert (got.argmax(-1) == full.argmax(-1)).float().mean().item() >= MIN_GREEDY_AGREEMENT
    assert (reference - full).abs().max() > 0  # the quantization is what changes them
    fmt, _ = int4.weight_summary()
    assert f"int4 asymmetric group {group} (weight-only, _weight_int4pack_mm)" in fmt


def test_layers_whose_inputs_are_not_whole_groups_stay_int8(tiny_dir):
    model = Qwen3.from_directory(tiny_dir, dtype="float32", quantize="int4")  # hidden 64 < 128
    assert isinstance(model.layers[0].qk_proj, Int8Linear) and isinstance(model.head, Int8Linear)
    assert "int8 per-channel" in model.weight_summary()[0] and "int4" not in model.weight_summary()[0]


def test_engine_generate_on_an_int4_model_frees_every_page(tiny_dir):
    model = Qwen3.from_directory(tiny_dir, dtype="bfloat16", quantize="int4-g32")
    engine = Engine(model, num_pages=64, page_size=4, token_budget=32, prefill_chunk=16, max_active=4)
    for seed in range(4):
        engine.submit(_prompt(10 + 3 * seed, seed), max_new_tokens=8, ignore_eos=True)
    events = run_to_completion(engine)
    assert sum(e.token_id is not None for e in events) == 4 * 8
    assert_pool_free(engine)
    engine.close()


def test_moe_experts_quantize_to_int4_and_match_their_dequantized_weights(tmp_path):
    path = make_moe_checkpoint(tmp_path / "moe", seed=2)
    int4 = Qwen3.from_directory(path, dtype="float32", quantize="int4-g32")
    stacks = [m for m in int4.modules() if isinstance(m, Int4ExpertLinear)]
    assert stacks and all(e.kernel in ("int4pack", "dequantize") for s in stacks for e in s.experts)
    ids = _prompt(24, 3, int4.config.vocab_size)
    reference = _prefill_logits(_dequantized_model(path, 32), ids)
    for got in (_prefill_logits(int4, ids), _decode_logits(int4, ids)):
        torch.testing.assert_close(got, reference, atol=2e-4, rtol=1e-4)
    assert "int4 experts asymmetric group 32" in int4.weight_summary()[0]


# ---------------------------------------------------------------------------------------------
# the scripts that measure it (their --quick sizes)
# ---------------------------------------------------------------------------------------------


def _script(name: str, *args: str):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / name
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)


def test_accuracy_script_reports_the_int4_variants(tmp_path):
    proc = _script("int8_accuracy.py", "--quick", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "4",
                   "--threads", "1", "--variants", "int4", "int4-g32", "--model-dir", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:28].strip(): line[28:].split() for line in proc.stdout.splitlines() if line.startswith("int4")
            and "accuracy" not in line}
    assert set(rows) == {"int4", "int4-g32"}
    for path, error, scale, agreement, *_ in rows.values():
        assert path == "prefill" and 0 < float(error) < float(scale) and 0 <= float(agreement) <= 1


def test_decode_step_benchmark_compares_int4_with_the_model_as_loaded(tmp_path):
    proc = _script("bench_decode_step.py", "--quick", "--batch", "1", "--steps", "2", "--prompt-len", "5",
                   "--dtype", "bfloat16", "--quantize", "int4-g32", "--model-dir", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "as-loaded ms" in proc.stdout and "int4-g32 ms" in proc.stdout
