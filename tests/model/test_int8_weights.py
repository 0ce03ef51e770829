"""int8 weight-only serving: the quantization math exactly, every kernel against the dequantized
weight, a quantized model against its unquantized self, the engine, a real server and the flags."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from checkpoints import make_checkpoint
from engine_helpers import assert_pool_free, run_to_completion
from qil_worker import Engine, Qwen3
from qil_worker.engine.probe import ForwardProbe
from qil_worker.errors import ConfigError
from qil_worker.model.int8_linear import (
    KERNELS, ROW_BUCKETS, Int8Linear, _fastest, available_kernels, dequantize, describe_kernels,
    quantize_per_channel,
)
from qil_worker.model.linear import Linear
from qil_worker.quantization import QUANTIZE_CHOICES

# Kernels against float64 x @ dequant(W).T, elementwise, relative to sum_k |x_k| |W_ik| (the
# size of the dot product's terms): float32 accumulation, plus in bfloat16 the rounding of the
# result (2^-9) and, for the dequantizing kernel, of the dequantized weight (2^-9).
KERNEL_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
# A quantized tiny model's logits against the unquantized model's (float32; logits up to ~4-5
# there): max abs error, and the share of positions whose argmax agrees (teacher-forced).
LOGIT_ATOL = 0.25
MIN_GREEDY_AGREEMENT = 0.95


# ---------------------------------------------------------------------------------------------
# the quantize / dequantize math
# ---------------------------------------------------------------------------------------------


def test_quantize_hand_computed_rows():
    w = torch.tensor([
        [127.0, -63.5, 0.5, 1.5],  # scale 1; ties -63.5 → -64, 0.5 → 0, 1.5 → 2 (half to even)
        [0.0, 0.0, 0.0, 0.0],  # a zero row: scale 0, codes 0
        [254.0, 3.0, 5.0, -7.0],  # scale 2; 1.5 → 2, 2.5 → 2, -3.5 → -4
        [-254.0, 1.0, -1.0, 127.0],  # the largest magnitude negative: code -127; ±0.5 → 0
    ])
    codes, scales = quantize_per_channel(w, torch.float32)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert codes.tolist() == [[127, -64, 0, 2], [0, 0, 0, 0], [127, 2, 2, -4], [-127, 0, 0, 64]]
    assert scales.tolist() == [1.0, 0.0, 2.0, 2.0]
    assert dequantize(codes, scales).tolist() == [
        [127.0, -64.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0], [254.0, 4.0, 4.0, -8.0], [-254.0, 0.0, 0.0, 128.0]]


def test_codes_use_the_stored_scale_and_never_leave_the_symmetric_range():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g) * torch.rand(300, 1, generator=g) * 3
    w[7] = 0.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        codes, scales = quantize_per_channel(w, dtype)
        assert scales.dtype == dtype
        stored = scales.float()
        torch.testing.assert_close(stored, (w.abs().amax(1) / 127).to(dtype).float(), atol=0, rtol=0)
        assert codes.abs().max() <= 127
        divisor = torch.where(stored > 0, stored, torch.ones_like(stored))
        want = torch.round(w / divisor[:, None]).clamp(-127, 127).to(torch.int8)
        assert torch.equal(codes, want)
        assert codes[7].eq(0).all() and stored[7] == 0
        # each weight within half a step of its code, or clipped where the rounded scale is short
        error = (dequantize(codes, scales) - w).abs()
        clipped = (w.abs() - 127 * stored[:, None]).clamp(min=0)
        assert (error <= stored[:, None] / 2 + clipped + 1e-7).all()


def test_quantizing_in_row_chunks_is_the_same_as_at_once():
    from qil_worker.model import int8_linear

    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 32, generator=g)
    whole = quantize_per_channel(w, torch.float32)
    saved = int8_linear._QUANTIZE_ROWS
    int8_linear._QUANTIZE_ROWS = 7
    try:
        chunked = quantize_per_channel(w, torch.float32)
    finally:
        int8_linear._QUANTIZE_ROWS = saved
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_a_weight_that_is_not_a_matrix_is_refused():
    with pytest.raises(ValueError, match=r"\[out, in\] weight"):
        quantize_per_channel(torch.ones(4), torch.float32)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


def _linear(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0) -> Linear:
    lin = Linear(out_features, in_features, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    lin.weight.data.copy_((torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype))
    lin.weight.data[3] = 0  # a zero row
    return lin


def _check_against_dequantized(layer: Int8Linear, x: torch.Tensor) -> None:
    w = dequantize(layer.weight, layer.scales).double()
    want = x.double() @ w.T
    bound = x.double().abs() @ w.abs().T
    got = layer(x)
    assert got.dtype == x.dtype and got.shape == want.shape
    error = (got.double() - want).abs()
    assert (error <= KERNEL_TOLERANCE[x.dtype] * bound + 1e-12).all(), (error / (bound + 1e-30)).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("in_features", [64, 96, 40], ids=["in64", "in96", "in40"])
def test_every_kernel_matches_the_dequantized_weight(dtype, in_features):
    cpu = torch.device("cpu")
    kernels = available_kernels(in_features, cpu, dtype)
    # torch's int8 kernel reads 16 inputs at a time: only where in_features is a multiple of 16
    assert ("int8pack" in kernels) == (in_features % 16 == 0) and "dequantize" in kernels
    g = torch.Generator().manual_seed(2)
    for kernel in kernels:
        layer = Int8Linear.from_linear(_linear(72, in_features, dtype), kernel)
        assert layer.kernels == (kernel,) * 3 and layer.dtype == dtype
        for rows in (1, ROW_BUCKETS[0], ROW_BUCKETS[0] + 1, 16, ROW_BUCKETS[1] + 1, 70):
            _check_against_dequantized(layer, torch.randn(rows, in_features, generator=g).to(dtype))


def test_each_step_size_takes_its_own_kernel():
    layer = Int8Linear.from_linear(_linear(40, 64, torch.bfloat16), ("int8pack", "dequantize", "int8pack"))
    small, medium = ROW_BUCKETS
    for rows, kernel in ((1, "int8pack"), (small, "int8pack"), (small + 1, "dequantize"), (medium, "dequantize"),
                         (medium + 1, "int8pack")):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(layer(x), getattr(layer, "_" + kernel)(x)), rows
    assert layer.weight_format == ("int8 per-channel (weight-only, _weight_int8pack_mm up to 4 rows, "
                                   "dequantized per call up to 32 rows, _weight_int8pack_mm above)")
    assert describe_kernels(("int8pack", "int8pack", "dequantize")) == (
        "_weight_int8pack_mm up to 32 rows, dequantized per call above")
    assert describe_kernels(("dequantize",) * 3) == "dequantized per call"


def test_unaligned_and_strided_activations_are_safe_for_the_int8_kernel():
    """torch's kernel loads 32-byte vectors: a row view off that alignment must not reach it."""
    layer = Int8Linear.from_linear(_linear(48, 64, torch.bfloat16), "int8pack")
    flat = torch.randn(64 * 3 + 8).bfloat16()
    misaligned = flat[8 : 8 + 64].view(1, 64)  # contiguous, 16 bytes off the allocation
    assert misaligned.data_ptr() % 32
    strided = torch.randn(3, 128).bfloat16()[:, ::2]
    batched = torch.randn(2, 3, 64).bfloat16()  # leading dimensions are kept
    for x in (misaligned, strided):
        _check_against_dequantized(layer, x)
    out = layer(batched)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out, layer(batched.reshape(6, 64)).view(2, 3, 48), atol=0, rtol=0)


def test_the_preferred_kernel_stays_unless_another_is_clearly_faster():
    assert _fastest({"int8pack": 1.0, "dequantize": 0.9}) == "int8pack"
    assert _fastest({"int8pack": 1.0, "dequantize": 0.5}) == "dequantize"
    assert _fastest({"dequantize": 1.0}) == "dequantize"
    assert KERNELS[0] == "int8pack"


def test_formats_and_bytes_of_each_projection_kind():
    plain = _linear(40, 64, torch.float32)
    assert plain.weight_format == "float32" and plain.weight_bytes() == 40 * 64 * 4
    packed = _linear(40, 64, torch.bfloat16)
    if packed.pack():
        assert packed.weight_format == "bfloat16 (oneDNN packed)"
        assert packed.weight_bytes() == 40 * 64 * 2
    layer = Int8Linear.from_linear(_linear(40, 64, torch.bfloat16), "int8pack")
    assert layer.weight_format == "int8 per-channel (weight-only, _weight_int8pack_mm)"
    assert layer.weight_bytes() == 40 * 64 + 40 * 2  # codes + bfloat16 scales
    with pytest.raises(ValueError, match="quantize before packing"):
        Int8Linear.from_linear(packed if packed.packed else _packed_stand_in())
    with pytest.raises(ValueError, match="unknown int8 kernels"):
        layer.use_kernels(("int8pack", "int4", "int8pack"))
    with pytest.raises(ValueError, match="unknown int8 kernels"):
        layer.use_kernels(("int8pack", "dequantize"))


def _packed_stand_in() -> Linear:
    lin = _linear(8, 16, torch.float32)
    lin.packed = True
    return lin


# ---------------------------------------------------------------------------------------------
# a quantized model
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("int8"), seed=3)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("int8-untied"), seed=4, tie_word_embeddings=False)


def _int8_count(summary: str) -> int:
    """How many projections a ``weight_summary`` format says are int8 ("<n>x <format>, ...")."""
    counts = re.findall(r"(\d+)x int8 per-channel \(weight-only, [^()]*\)", summary)
    return sum(int(n) for n in counts)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill_logits(model: Qwen3, ids: list[int]) -> torch.Tensor:
    probe = ForwardProbe(model, num_pages=32, page_size=8)
    (logits,) = probe.forward([(probe.sequence(ids), len(ids))])
    return logits.float()


def _decode_logits(model: Qwen3, ids: list[int]) -> torch.Tensor:
    """One token per forward: the few-rows kernels, as decode runs them."""
    probe = ForwardProbe(model, num_pages=32, page_size=4)
    seq = probe.sequence(ids)
    return torch.cat([probe.forward([(seq, 1)])[0] for _ in ids]).float()


@pytest.mark.parametrize("checkpoint", ["tiny_dir", "untied_dir"])
def test_quantized_logits_stay_close_to_the_unquantized_model(request, checkpoint):
    path = request.getfixturevalue(checkpoint)
    full = Qwen3.from_directory(path, dtype="float32")
    int8 = Qwen3.from_directory(path, dtype="float32", quantize="int8")
    assert all(isinstance(m, Int8Linear) for layer in int8.layers for m in (layer.qk_proj, layer.v_proj, layer.o_proj))
    assert isinstance(int8.head, Int8Linear)
    ids = _prompt(40, 7)
    want = _prefill_logits(full, ids)
    for got in (_prefill_logits(int8, ids), _decode_logits(int8, ids)):
        assert (got - want).abs().max() <= LOGIT_ATOL
        agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
        assert agreement >= MIN_GREEDY_AGREEMENT
    # the quantization is what changes them: the error is not zero
    assert (_prefill_logits(int8, ids) - want).abs().max() > 0


def test_the_lm_head_can_stay_unquantized(tiny_dir):
    model = Qwen3.from_directory(tiny_dir, dtype="bfloat16", pack_weights=False)
    assert model.quantize_weights("int8", head=False) == 2 * 6
    assert type(model.head) is Linear and isinstance(model.layers[0].mlp.down_proj, Int8Linear)
    model.pack_weights()  # packs the head alone; the quantized layers are left as they are
    assert isinstance(model.layers[1].qk_proj, Int8Linear)
    fmt, _ = model.weight_summary()
    assert _int8_count(fmt) == 12 and "1x bfloat16 (oneDNN packed)" in fmt
    assert fmt.endswith("embedding and norms bfloat16")


def test_weight_bytes_int8_about_half_of_bfloat16(tiny_dir):
    bf16 = Qwen3.from_directory(tiny_dir, dtype="bfloat16")
    int8 = Qwen3.from_directory(tiny_dir, dtype="bfloat16", quantize="int8")
    c = int8.config
    embed = c.vocab_size * c.hidden_size
    norms = c.num_hidden_layers * (2 * c.hidden_size + 2 * c.head_dim) + c.hidden_size
    codes = sum(m.weight.numel() for m in int8.modules() if isinstance(m, Int8Linear))
    rows = sum(m.weight.shape[0] for m in int8.modules() if isinstance(m, Int8Linear))
    # the embedding and norms stay bfloat16; every projection and the (copied, tied) head int8
    assert int8.weight_summary()[1] == 2 * (embed + norms) + codes + 2 * rows
    bf16_fmt, bf16_bytes = bf16.weight_summary()
    if "oneDNN packed" in bf16_fmt:  # the packed head is a copy too
        assert bf16_bytes == 2 * (embed + norms + codes)
    # nothing else holds the unquantized projections
    assert not [n for n, p in int8.named_parameters() if p.dim() == 2 and n != "embed"]


def test_unknown_quantization_is_a_config_error(tiny_dir):
    with pytest.raises(ConfigError, match="quantize: 'int3' is not supported"):
        Qwen3.from_directory(tiny_dir, quantize="int3")
    assert Qwen3.from_directory(tiny_dir, quantize="none").weight_summary()[0].startswith("13x float32")


def test_engine_generate_on_an_int8_model_frees_every_page(tiny_dir):
    model = Qwen3.from_directory(tiny_dir, dtype="bfloat16", quantize="int8")
    engine = Engine(model, num_pages=64, page_size=4, token_budget=32, prefill_chunk=16, max_active=4)
    for seed in range(5):
        engine.submit(_prompt(10 + 3 * seed, seed), max_new_tokens=12, ignore_eos=True)
    events = run_to_completion(engine)
    assert sum(e.token_id is not None for e in events) == 5 * 12
    assert_pool_free(engine)
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_runs_int8_where_torch_has_the_kernel_or_refuses_naming_the_flag(tiny_dir):
    try:
        model = Qwen3.from_directory(tiny_dir, device="cuda", dtype="bfloat16", quantize="int8")
    except ConfigError as err:
        assert "--quantize int8" in str(err)
        return
    ids = _prompt(20, 1)
    full = Qwen3.from_directory(tiny_dir, device="cuda", dtype="bfloat16")
    assert (_prefill_logits(model, ids) - _prefill_logits(full, ids)).abs().max() <= 2 * LOGIT_ATOL


# ---------------------------------------------------------------------------------------------
# the service and the command lines
# ---------------------------------------------------------------------------------------------


def test_a_server_with_int8_reports_its_weights_in_get_info(tiny_dir):
    from service_fixtures import start_server

    from qil_client import Client

    expected = Qwen3.from_directory(tiny_dir, dtype="bfloat16", quantize="int8").weight_summary()
    with start_server(tiny_dir, dtype="bfloat16", quantize="int8") as srv:
        with Client(srv.target) as client:
            model = client.info().model
            result = client.generate(_prompt(8, 2), max_new_tokens=4)
    assert _int8_count(model.weight_format) == 13  # the kernels chosen may differ per shape
    assert model.weight_format.endswith("embedding and norms bfloat16")
    assert model.weight_bytes == expected[1]
    assert len(result.token_ids) == 4


@pytest.mark.parametrize("command", [["serve"], ["generate", "--token-ids", "[1]"]])
def test_a_bad_quantize_value_is_refused_by_the_flag(command):
    proc = subprocess.run([sys.executable, "-m", "qil_worker", *command, "--quantize", "int3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "argument --quantize: invalid choice: 'int3'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_runs_with_int8(tiny_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "qil_worker", "generate", "--model", str(tiny_dir), "--token-ids", "[1, 2, 3]",
         "--max-new-tokens", "3", "--quantize", "int8", "--dtype", "bfloat16", "--json"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["output_token_ids"]) == 3


def test_the_flag_offers_the_worker_choices():
    assert QUANTIZE_CHOICES == ("none", "int8", "int4", "int4-g32")


# ---------------------------------------------------------------------------------------------
# the scripts that measure it (their --quick sizes)
# ---------------------------------------------------------------------------------------------


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / name
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300)


def test_decode_step_benchmark_compares_int8_with_the_model_as_loaded(tmp_path):
    proc = _script("bench_decode_step.py", "--quick", "--batch", "1", "3", "--steps", "2", "--prompt-len", "5",
                   "--dtype", "bfloat16", "--quantize", "int8", "--model-dir", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [int(row[0]) for row in rows] == [1, 3]
    assert "as-loaded ms" in proc.stdout and "int8 ms" in proc.stdout


def test_accuracy_script_reports_both_variants(tmp_path):
    proc = _script("int8_accuracy.py", "--quick", "--prompts", "2", "--prompt-len", "8", "--new-tokens", "4",
                   "--threads", "1", "--model-dir", str(tmp_path / "model"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {line[:28].strip(): line[28:].split() for line in proc.stdout.splitlines() if line.startswith("int8")
            and "accuracy" not in line}
    assert set(rows) == {"int8", "int8, LM head unquantized"}
    for path, error, scale, agreement, *_ in rows.values():
        assert path == "prefill" and 0 < float(error) < float(scale) and 0 <= float(agreement) <= 1


def test_engine_benchmark_runs_qil_quantized(tmp_path):
    report = tmp_path / "engine.json"
    proc = _script("bench_engine.py", "--quick", "--dtype", "bfloat16", "--quantize", "int8", "--threads", "1",
                   "--batch", "2", "--model-dir", str(tmp_path / "model"), "--json", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(report.read_text())
    assert result["config"]["engine"]["quantize"] == "int8"
    assert result["results"][0]["dtype"] == "bfloat16+int8"
    assert result["results"][0]["single"]["qil"]["decode_tok_s"] > 0


def test_an_fp8_checkpoint_quantizes_to_int8_from_its_dequantized_weights(tmp_path):
    """``quantize="int8"`` on an FP8 checkpoint: dequantized at load (whatever ``fp8`` says),
    then quantized — the same codes and scales as quantizing the dequantized model."""
    from checkpoints import make_fp8_checkpoint

    path = make_fp8_checkpoint(tmp_path / "fp8")
    dequantized = Qwen3.from_directory(path, dtype="float32", pack_weights=False)
    dequantized.quantize_weights("int8")
    int8 = Qwen3.from_directory(path, dtype="float32", quantize="int8", fp8="auto")
    pairs = [(getattr(a, name), getattr(b, name)) for a, b in zip(dequantized.layers, int8.layers)
             for name in ("qk_proj", "v_proj", "o_proj")]
    assert pairs and all(isinstance(m, Int8Linear) for pair in pairs for m in pair)
    for want, got in pairs:
        assert torch.equal(got.weight, want.weight) and torch.equal(got.scales, want.scales)
    ids = _prompt(24, 3)
    assert 0 < (_prefill_logits(int8, ids) - _prefill_logits(Qwen3.from_directory(path, dtype="float32"), ids)).abs().max() <= LOGIT_ATOL
