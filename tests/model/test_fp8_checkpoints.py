"""Official-layout FP8 checkpoints: strict loading, the block dequantization, the FP8 matmul path.

Checkpoints come from small random Qwen3 models quantized as transformers' ``Fp8Quantize`` does
(``checkpoints.make_fp8_checkpoint``), both with every dimension a multiple of 128 ("aligned")
and with ragged blocks ("ragged": hidden 200, intermediate 264, GQA rows of 100).

Oracles: transformers' own dequantization (``Fp8Dequantize``) of the same checkpoint, run by its
``Qwen3ForCausalLM``; and transformers loading the FP8 checkpoint itself where it can on a CPU
(it needs ``accelerate``, then dequantizes at load). transformers' CPU dequantization derives the
block size from the grid (rows / grid rows), which is the 128 of its own ``FP8Linear`` only when
each dimension is a multiple of 128 or fits one block; for the ragged checkpoint the oracle is
transformers running weights dequantized by the ceil-grid rule its FP8 kernels use.

Tolerances: float32 logits to 1e-4 absolute, as every float32 comparison with the reference
(the dequantized weights are bit-identical, so only summation order differs); bfloat16 to 5% of
the largest logit, as the unquantized bfloat16 test. The FP8 matmul path quantizes activations
to e4m3 (3 mantissa bits: ~2.5% RMS error per matmul); over the 8 matmuls of these 2-layer random
models its logits stay within 15% of the largest logit (12% relative RMS, cosine > 0.99) of the
dequantized model's — measured 9.8% and 9.5% — which is too coarse to assert greedy tokens on.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import load_reference, make_checkpoint, make_fp8_checkpoint, quantize_fp8_blocks
from engine_helpers import assert_pool_free, reference_greedy
from qil_worker import Engine, Qwen3
from qil_worker.config import Qwen3Config
from qil_worker.engine.probe import ForwardProbe
from qil_worker.errors import ConfigError, WeightError
from qil_worker.model import fp8, fp8_linear
from qil_worker.model.fp8_linear import Fp8Linear
from qil_worker.model.linear import Linear
from qil_worker.model.loader import load_weights

ATOL = 1e-4
ALIGNED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
RAGGED = dict(hidden_size=200, intermediate_size=264, num_attention_heads=4, num_key_value_heads=2, head_dim=50)
BLOCK = (128, 128)


@pytest.fixture(scope="module")
def aligned_dir(tmp_path_factory):
    return make_fp8_checkpoint(tmp_path_factory.mktemp("fp8_aligned"), seed=11, **ALIGNED)


@pytest.fixture(scope="module")
def ragged_dir(tmp_path_factory):
    return make_fp8_checkpoint(
        tmp_path_factory.mktemp("fp8_ragged"), seed=12, tie_word_embeddings=False, **RAGGED
    )


def _tensors(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _hand_dequantize(weight, scale_inv):
    """The ceil-grid rule, element by element through the block index: W[r, c] = fp8[r, c] *
    scale_inv[r // 128, c // 128], in float32."""
    rows, cols = weight.shape
    r = torch.arange(rows)[:, None] // 128
    c = torch.arange(cols)[None, :] // 128
    return weight.to(torch.float32) * scale_inv[r, c]


def _dequantized_checkpoint(src, dst, dequantize):
    """``src`` with every FP8 weight replaced by ``dequantize(weight, scale)`` in float32 and no
    quantization_config: what transformers runs as the oracle."""
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    config["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config))
    tensors = _tensors(src)
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(fp8.SCALE_SUFFIX):
            continue
        scale = tensors.get(fp8.scale_name(name))
        out[name] = tensor.float() if scale is None else dequantize(tensor, scale).float()
    save_file(out, dst / "model.safetensors")
    return dst


def _transformers_dequantize(weight, scale):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.float32)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def _logits(model, ids):
    probe = ForwardProbe(model, num_pages=16, page_size=8)
    (got,) = probe.forward([(probe.sequence(ids), len(ids))])
    return got


def _reference_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0]


# --- the dequantization math ---------------------------------------------------------------------


def test_dequantize_is_the_block_product_by_hand():
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(130, 260, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 3, generator=g) + 0.01
    got = fp8.dequantize(weight, scale_inv, torch.float32)
    assert torch.equal(got, _hand_dequantize(weight, scale_inv))
    # corners of blocks, the ragged ones included, one product each
    for r, c, (br, bc) in [(0, 0, (0, 0)), (127, 128, (0, 1)), (128, 127, (1, 0)), (129, 259, (1, 2))]:
        assert got[r, c] == weight[r, c].float() * scale_inv[br, bc]  # one float32 product
    # bfloat16: the float32 product rounded once, as transformers' Fp8Dequantize
    assert torch.equal(fp8.dequantize(weight, scale_inv, torch.bfloat16), got.to(torch.bfloat16))


def test_dequantize_in_chunks_and_into_views(monkeypatch):
    monkeypatch.setattr(fp8, "_CHUNK_ELEMENTS", 1)  # one block row at a time
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 140, generator=g).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(3, 2, generator=g)
    fused = torch.zeros(310, 140)
    fp8.dequantize_into(fused[10:], weight, scale_inv)
    assert torch.equal(fused[10:], _hand_dequantize(weight, scale_inv))
    assert torch.equal(fused[:10], torch.zeros(10, 140))
    with pytest.raises(ValueError, match="scale grid"):
        fp8.dequantize_into(fused[10:], weight, scale_inv[:, :1])


def test_dequantize_agrees_with_transformers_on_aligned_blocks():
    g = torch.Generator().manual_seed(2)
    weight, scale_inv = quantize_fp8_blocks(torch.randn(256, 384, generator=g))
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    for dtype in (torch.float32, torch.bfloat16):
        want = Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=dtype)
        assert torch.equal(fp8.dequantize(weight, scale_inv, dtype), want)


def test_quantize_blocks_round_trips_within_e4m3_precision():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 264, generator=g)
    q, s = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3) and s.dtype == torch.float32
    back = fp8.dequantize(q, s, torch.float32)
    assert ((back - w).abs() <= w.abs() / 16 + s.max() * 2**-9).all()  # 3 mantissa bits
    # each block's largest magnitude maps to 448
    assert q[:128, :128].float().abs().max().item() == 448.0
    assert q[128:, 256:].float().abs().max().item() == 448.0


# --- config ----------------------------------------------------------------------------------------


def _config(**quantization):
    from checkpoints import TINY_CONFIG

    raw = {**TINY_CONFIG, "model_type": "qwen3"}
    raw["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        **quantization,
    }
    return raw


def test_config_reads_the_fp8_quantization():
    config = Qwen3Config.from_dict(_config(modules_to_not_convert=["lm_head", "mlp.down_proj"]))
    assert config.quantization.block_size == (128, 128)
    assert config.quantization.modules_to_not_convert == ("lm_head", "mlp.down_proj")
    bare = Qwen3Config.from_dict({**_config(), "quantization_config": {"quant_method": "fp8"}})
    assert bare.quantization.block_size == (128, 128)  # transformers' defaults where silent
    assert Qwen3Config.from_dict({k: v for k, v in _config().items() if k != "quantization_config"}).quantization is None


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("quant_method", "bitsandbytes", "quantization_config.quant_method: 'bitsandbytes' is not supported"),
        ("fmt", "e5m2", "quantization_config.fmt: 'e5m2' is not supported"),
        ("activation_scheme", "static", "quantization_config.activation_scheme: 'static' is not supported"),
        ("weight_block_size", [64, 64], r"quantization_config.weight_block_size: \[64, 64\] is not supported"),
        ("weight_block_size", None, "quantization_config.weight_block_size: None is not supported"),
        ("scale_fmt", "ue8m0", "quantization_config.scale_fmt: 'ue8m0' is not supported"),
        ("modules_to_convert", ["embed_tokens"], "quantization_config.modules_to_convert"),
        ("modules_to_not_convert", "lm_head", "quantization_config.modules_to_not_convert: expected a list"),
        ("modules_to_not_convert", ["mlp.(down"], r"quantization_config.modules_to_not_convert: 'mlp.\(down'"),
    ],
)
def test_config_refuses_what_qil_does_not_compute(field, value, message):
    with pytest.raises(ConfigError, match=message):
        Qwen3Config.from_dict(_config(**{field: value}))


def test_config_refuses_a_quantization_config_that_is_not_an_object():
    with pytest.raises(ConfigError, match="quantization_config: expected an object"):
        Qwen3Config.from_dict({**_config(), "quantization_config": "fp8"})


# --- strict loading --------------------------------------------------------------------------------


def _rewrite(src, dst, mutate, config=None):
    """A single-file copy of ``src`` with ``mutate(tensors)`` applied (and ``config(raw)``)."""
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    if config is not None:
        config(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = _tensors(src)
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_every_layout_problem_in_one_error_naming_each_tensor(aligned_dir, tmp_path):
    layer0, layer1 = "model.layers.0.", "model.layers.1."

    def mutate(t):
        del t[layer0 + "self_attn.q_proj.weight_scale_inv"]                       # missing scale
        t[layer0 + "mlp.up_proj.weight_scale_inv"] = torch.ones(2, 2)              # wrong grid (3, 2)
        t[layer1 + "self_attn.o_proj.weight"] = t[layer1 + "self_attn.o_proj.weight"].to(torch.bfloat16)
        t["lm_head.weight_scale_inv"] = torch.ones(1, 2)                           # scale, no FP8 head
        t[layer1 + "post_attention_layernorm.weight_scale_inv"] = torch.ones(1)    # scale of a norm
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)
        t[layer1 + "mlp.gate_proj.weight_scale_inv"] = torch.ones(3, 2, dtype=torch.int32)

    bad = _rewrite(aligned_dir, tmp_path / "bad", mutate)
    with pytest.raises(WeightError) as info:
        Qwen3.from_directory(bad)
    msg = str(info.value)
    assert "7 problem(s)" in msg, msg
    assert f"missing: {layer0}self_attn.q_proj.weight_scale_inv (expected shape (2, 2)" in msg
    assert f"mis-shaped: {layer0}mlp.up_proj.weight_scale_inv expected (3, 2)" in msg
    assert f"got (2, 2)" in msg
    assert f"not FP8: {layer1}self_attn.o_proj.weight is stored as BF16" in msg
    assert "unexpected scale: lm_head.weight_scale_inv (lm_head.weight is not one of the decoder's linear" in msg
    assert f"unexpected scale: {layer1}post_attention_layernorm.weight_scale_inv" in msg
    assert "unexpected FP8: model.embed_tokens.weight is stored as F8_E4M3" in msg
    assert f"bad dtype: {layer1}mlp.gate_proj.weight_scale_inv is I32" in msg


def test_a_scale_without_a_quantization_config_is_refused(tiny_dir, tmp_path):
    def mutate(t):
        t["model.layers.0.mlp.down_proj.weight_scale_inv"] = torch.ones(1, 1)
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)

    bad = _rewrite(tiny_dir, tmp_path / "bad", mutate)
    with pytest.raises(WeightError) as info:
        Qwen3.from_directory(bad)
    msg = str(info.value)
    assert "2 problem(s)" in msg
    assert ("unexpected scale: model.layers.0.mlp.down_proj.weight_scale_inv "
            "(config.json has no FP8 quantization_config)") in msg
    assert "unexpected FP8: model.layers.0.mlp.up_proj.weight is stored as F8_E4M3" in msg


def test_modules_to_not_convert_stay_unquantized_and_may_not_carry_scales(tmp_path):
    path = make_fp8_checkpoint(tmp_path / "skip", seed=13, modules_to_not_convert=["mlp.down_proj"], **ALIGNED)
    tensors = _tensors(path)
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    model = Qwen3.from_directory(path, pack_weights=False)
    assert torch.equal(model.layers[0].mlp.down_proj.weight, tensors["model.layers.0.mlp.down_proj.weight"].float())

    def add_scale(t):
        t["model.layers.1.mlp.down_proj.weight_scale_inv"] = torch.ones(2, 3)

    with pytest.raises(WeightError, match=r"unexpected scale: model.layers.1.mlp.down_proj.weight_scale_inv "
                                          r"\(model.layers.1.mlp.down_proj is listed in modules_to_not_convert\)"):
        Qwen3.from_directory(_rewrite(path, tmp_path / "bad", add_scale))

    def unskip(raw):
        raw["quantization_config"]["modules_to_not_convert"] = ["lm_head"]

    with pytest.raises(WeightError, match="not FP8: model.layers.0.mlp.down_proj.weight is stored as BF16"):
        Qwen3.from_directory(_rewrite(path, tmp_path / "unskipped", lambda t: None, config=unskip))


def test_a_sharded_checkpoint_with_scales_apart_from_their_weights(aligned_dir, tmp_path):
    sharded = make_fp8_checkpoint(tmp_path / "sharded", seed=11, shards=3, **ALIGNED)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert index[name] != index[fp8.scale_name(name)], "fixture should split a weight from its scale"
    one = Qwen3.from_directory(aligned_dir, pack_weights=False)
    many = Qwen3.from_directory(sharded, pack_weights=False)
    for a, b in zip(one.parameters(), many.parameters()):
        assert torch.equal(a, b)


# --- loaded weights and logits against transformers ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_directory_dequantizes_into_the_compute_dtype(ragged_dir, dtype):
    model = Qwen3.from_directory(ragged_dir, dtype=dtype, pack_weights=False)
    assert model.dtype == dtype and all(p.dtype == dtype for p in model.parameters())
    tensors = _tensors(ragged_dir)
    layer = model.layers[1]
    q, k, v = (tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    qs, ks, vs = (tensors[f"model.layers.1.self_attn.{p}_proj.weight_scale_inv"] for p in "qkv")
    assert torch.equal(layer.qk_proj.weight[:200], _hand_dequantize(q, qs).to(dtype))
    assert torch.equal(layer.qk_proj.weight[200:], _hand_dequantize(k, ks).to(dtype))
    assert torch.equal(layer.v_proj.weight, _hand_dequantize(v, vs).to(dtype))
    assert torch.equal(model.lm_head, tensors["lm_head.weight"].to(dtype))  # stored bfloat16
    # every projection is a plain Linear over compute-dtype weights: what a later int8
    # quantization (or oneDNN packing) takes as input
    assert all(type(m) is not Fp8Linear for m in model.modules())


def test_fused_projections_dequantize_into_their_parts(ragged_dir):
    model = Qwen3.from_directory(ragged_dir, pack_weights=False, fused_projections=True)
    tensors = _tensors(ragged_dir)
    gate = _hand_dequantize(tensors["model.layers.0.mlp.gate_proj.weight"], tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"])
    v = _hand_dequantize(tensors["model.layers.0.self_attn.v_proj.weight"], tensors["model.layers.0.self_attn.v_proj.weight_scale_inv"])
    assert torch.equal(model.layers[0].mlp.gate_up_proj.weight[:264], gate)
    assert torch.equal(model.layers[0].qkv_proj.weight[300:], v)


def test_logits_match_transformers_own_dequantization(aligned_dir, tmp_path):
    reference = load_reference(_dequantized_checkpoint(aligned_dir, tmp_path / "ref", _transformers_dequantize))
    model = Qwen3.from_directory(aligned_dir, dtype="float32")
    ids = _prompt(30, 1)
    torch.testing.assert_close(_logits(model, ids), _reference_logits(reference, ids), atol=ATOL, rtol=0)


def test_logits_match_transformers_loading_the_fp8_checkpoint(aligned_dir):
    pytest.importorskip("accelerate", reason="transformers loads FP8 checkpoints only with accelerate")
    reference = load_reference(aligned_dir)  # on a CPU it dequantizes at load
    model = Qwen3.from_directory(aligned_dir, dtype="float32")
    ids = _prompt(30, 2)
    torch.testing.assert_close(_logits(model, ids), _reference_logits(reference, ids), atol=ATOL, rtol=0)


def test_ragged_blocks_match_transformers_on_the_ceil_grid_dequantization(ragged_dir, tmp_path):
    reference = load_reference(_dequantized_checkpoint(ragged_dir, tmp_path / "ref", _hand_dequantize))
    model = Qwen3.from_directory(ragged_dir, dtype="float32")
    ids = _prompt(30, 3)
    torch.testing.assert_close(_logits(model, ids), _reference_logits(reference, ids), atol=ATOL, rtol=0)


def test_bfloat16_close_to_reference(ragged_dir, tmp_path):
    reference = load_reference(_dequantized_checkpoint(ragged_dir, tmp_path / "ref", _hand_dequantize), torch.bfloat16)
    model = Qwen3.from_directory(ragged_dir, dtype=torch.bfloat16)
    ids = _prompt(24, 4)
    got, want = _logits(model, ids).float(), _reference_logits(reference, ids).float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_engine_generates_transformers_greedy_tokens(aligned_dir, ragged_dir, tmp_path):
    prompts = [_prompt(n, 10 + n) for n in (1, 5, 19)]
    for i, path in enumerate((aligned_dir, ragged_dir)):
        reference = load_reference(_dequantized_checkpoint(path, tmp_path / f"ref{i}", _hand_dequantize))
        expected = [reference_greedy(reference, p, 10) for p in prompts]
        engine = Engine(Qwen3.from_directory(path, dtype="float32"), num_pages=64, page_size=8, debug=True)
        assert [r.output_token_ids for r in engine.generate(prompts, max_new_tokens=10)] == expected
        assert_pool_free(engine)


def test_the_log_names_the_path_and_the_weight_bytes(aligned_dir, caplog):
    with caplog.at_level(logging.INFO, logger="qil_worker.model.qwen3"):
        model = Qwen3.from_directory(aligned_dir, dtype=torch.bfloat16, pack_weights=False)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("FP8 checkpoint"))
    mib = sum(p.nbytes for p in model.parameters()) / 2**20  # the tied head counted once
    assert line == f"FP8 checkpoint: dequantized to bfloat16 at load; weights in memory {mib:.1f} MiB"


# --- the FP8 matmul path: activation quantization, scale layouts, the self-check ------------------


def test_activation_quantization_per_token_and_group_of_128():
    x = torch.zeros(3, 200)
    x[0, :128] = torch.linspace(-2.0, 1.0, 128)   # group 0 amax 2
    x[0, 128:] = 0.5                               # ragged group 1 (72 columns) amax 0.5
    x[1] = torch.randn(200, generator=torch.Generator().manual_seed(4)) * 7
    q, scales = fp8_linear.quantize_activations(x)     # row 2 is all zeros
    assert q.shape == (3, 200) and q.dtype == torch.float8_e4m3fn and scales.shape == (3, 2)
    assert torch.equal(scales[0], torch.tensor([2.0, 0.5]) / 448)
    assert scales[1, 0].item() == pytest.approx(x[1, :128].abs().max().item() / 448)
    assert q[0, 0].float().item() == -448.0 and (q[0, 128:].float() == 448.0).all()
    assert torch.equal(q[2].float(), torch.zeros(200)) and torch.isfinite(scales[2]).all()
    # by hand: x / scale rounded to e4m3, group by group
    want = (x[1, :128] / scales[1, 0]).to(torch.float8_e4m3fn)
    assert torch.equal(q[1, :128].view(torch.uint8), want.view(torch.uint8))
    back = q.float() * scales.repeat_interleave(128, dim=1)[:, :200]
    assert ((back - x).abs() <= x.abs() / 16 + 1e-6).all()


def test_scale_layouts_are_the_ones_cublas_reads():
    grid = torch.arange(6.0).view(3, 2)            # [N/128, K/128] as in the checkpoint
    b = fp8_linear.weight_scales_layout(grid)
    assert b.shape == (4, 3) and b.stride() == (1, 4)   # [L4, N/128], K-major, L padded to 4
    assert torch.equal(b[:2], grid.t()) and torch.equal(b[2:], torch.zeros(2, 3))
    a = fp8_linear.activation_scales_layout(torch.arange(10.0).view(5, 2))
    assert a.shape == (5, 2) and a.stride() == (1, 5)   # outer-dim-major
    assert torch.equal(a, torch.arange(10.0).view(5, 2))


def test_emulated_scaled_mm_is_the_dequantized_product():
    weight, scale_inv = fp8_linear.probe_weight(200, 264, torch.device("cpu"))
    x = torch.randn(8, 264, generator=torch.Generator().manual_seed(5))
    q, s = fp8_linear.quantize_activations(x)
    got = fp8_linear.emulated_scaled_mm(q, weight.t(), fp8_linear.activation_scales_layout(s),
                                        fp8_linear.weight_scales_layout(scale_inv), torch.float32)
    activations = q.float() * s.repeat_interleave(128, dim=1)[:, :264]  # per row and group
    want = activations @ _hand_dequantize(weight, scale_inv).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _transposed_scales_kernel(a, b, scale_a, scale_b, out_dtype):
    """Reads the weight scales' memory as row-major: a plausible layout mistake."""
    misread = scale_b.t().contiguous().view(scale_b.shape)
    return fp8_linear.emulated_scaled_mm(a, b, scale_a, misread, out_dtype)


def _refusing_kernel(a, b, scale_a, scale_b, out_dtype):
    raise RuntimeError("Invalid scaling configuration")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_self_check_accepts_a_right_kernel_and_refuses_wrong_ones(dtype):
    cpu = torch.device("cpu")
    assert fp8_linear.self_check(fp8_linear.emulated_scaled_mm, 384, 256, cpu, dtype)
    assert not fp8_linear.self_check(_transposed_scales_kernel, 384, 256, cpu, dtype)
    assert not fp8_linear.self_check(_refusing_kernel, 384, 256, cpu, dtype)
    assert fp8_linear.cuda_kernels(cpu) == []


def _load_kept(path, kernels, dtype=torch.float32):
    """``from_directory``'s steps with the kernel list given (on a CPU there is none)."""
    model = Qwen3(Qwen3Config.from_directory(path), dtype=dtype, fused_projections=True)
    kept = {}
    load_weights(model, path, keep_fp8=kept)
    assert len(kept) == 7 * model.config.num_hidden_layers and all(w.dtype == torch.float8_e4m3fn for w, _ in kept.values())
    summary = fp8_linear.use_fp8(model, kept, kernels)
    assert kept == {}
    return model.eval(), summary


def test_a_failing_kernel_falls_back_to_the_dequantized_weights(aligned_dir):
    model, summary = _load_kept(aligned_dir, [("refusing", _refusing_kernel), ("transposed", _transposed_scales_kernel)])
    assert summary == {"fp8": 0, "dequantized": 8, "kernels": []}
    assert all(type(m) is not Fp8Linear for m in model.modules())
    want = Qwen3.from_directory(aligned_dir, dtype="float32", pack_weights=False, fused_projections=True)
    for a, b in zip(model.parameters(), want.parameters()):
        assert torch.equal(a, b)
    assert fp8_linear.describe(model, summary).startswith("FP8 checkpoint: dequantized to float32 at load")


def test_fp8_projections_close_to_the_dequantized_model(aligned_dir):
    """The FP8 path with the emulated kernel on a CPU: every projection an Fp8Linear holding
    the checkpoint's own FP8 bytes; logits within the activations' e4m3 rounding."""
    model, summary = _load_kept(aligned_dir, [("emulated", fp8_linear.emulated_scaled_mm)])
    assert summary == {"fp8": 8, "dequantized": 0, "kernels": ["emulated"]}
    layer = model.layers[1]
    tensors = _tensors(aligned_dir)
    assert isinstance(layer.qkv_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert torch.equal(layer.qkv_proj.weight[256:384].view(torch.uint8),
                       tensors["model.layers.1.self_attn.k_proj.weight"].view(torch.uint8))
    assert layer.qkv_proj.weight_format == "float8_e4m3fn block 128x128 (scaled_mm)"
    assert layer.qkv_proj.weight_bytes() == 512 * 256 + 4 * 4 * 4   # FP8 + the [L4=4, 4] scales
    dequantized = Qwen3.from_directory(aligned_dir, dtype="float32", pack_weights=False, fused_projections=True)
    assert torch.equal(layer.mlp.gate_up_proj.dequantized(), dequantized.layers[1].mlp.gate_up_proj.weight)
    ids = _prompt(20, 6)
    got, want = _logits(model, ids), _logits(dequantized, ids)
    error = got - want
    assert error.abs().max() < 0.15 * want.abs().max()
    assert error.pow(2).mean().sqrt() < 0.12 * want.pow(2).mean().sqrt()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
    assert fp8_linear.describe(model, summary).startswith(
        "FP8 checkpoint: float8_e4m3fn block 128x128 via scaled_mm (emulated); weights in memory"
    )


def test_engine_serves_fp8_projections_batched_as_one_by_one(aligned_dir):
    """Activations are quantized per token, so a request's tokens do not depend on what else is
    in the batch."""
    model, _ = _load_kept(aligned_dir, [("emulated", fp8_linear.emulated_scaled_mm)])
    prompts = [_prompt(n, 20 + n) for n in (1, 6, 17)]
    batched = Engine(model, num_pages=64, page_size=8, debug=True).generate(prompts, max_new_tokens=8)
    alone = [Engine(model, num_pages=64, page_size=8, debug=True).generate([p], max_new_tokens=8)[0] for p in prompts]
    assert [r.output_token_ids for r in batched] == [r.output_token_ids for r in alone]
    assert all(len(r.output_token_ids) == 8 for r in batched)


def test_fused_parts_off_the_block_grid_are_dequantized(ragged_dir):
    """q/k/v of 200 + 100 + 100 rows and gate/up of 264 + 264: the second part's blocks would
    straddle the first's, so those projections are dequantized; o_proj and down_proj stay FP8."""
    model, summary = _load_kept(ragged_dir, [("emulated", fp8_linear.emulated_scaled_mm)])
    assert summary["fp8"] == 4 and summary["dequantized"] == 4
    layer = model.layers[0]
    assert type(layer.qkv_proj) is Linear and type(layer.mlp.gate_up_proj) is Linear
    assert isinstance(layer.o_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    tensors = _tensors(ragged_dir)
    k = _hand_dequantize(tensors["model.layers.0.self_attn.k_proj.weight"], tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"])
    assert torch.equal(layer.qkv_proj.weight[200:300], k)


def test_fp8_linear_pads_rows_and_keeps_leading_dims():
    weight, scale_inv = fp8_linear.probe_weight(256, 200, torch.device("cpu"))
    linear = Fp8Linear(weight, scale_inv, torch.float32, fp8_linear.emulated_scaled_mm)
    x = torch.randn(2, 3, 200, generator=torch.Generator().manual_seed(7))
    y = linear(x)
    assert y.shape == (2, 3, 256)
    torch.testing.assert_close(y[1, 2], linear(x[1, 2:3])[0])  # rows do not affect each other
    assert linear.packed_weight() is None
    with pytest.raises(ValueError, match="not a 128x128 block-scaled FP8 weight"):
        Fp8Linear(weight, scale_inv[:, :1], torch.float32, fp8_linear.emulated_scaled_mm)


def test_fp8_argument_is_checked(aligned_dir):
    with pytest.raises(ConfigError, match="fp8: expected 'auto' or 'dequantize'"):
        Qwen3.from_directory(aligned_dir, fp8="scaled_mm")


# --- CUDA ------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cublas_blockwise_expected() -> bool:
    """Where torch's cuBLAS block-scaled FP8 matmul (1x128 x 128x128) exists: sm90, CUDA 12.9+
    (the gate of torch's own tests of it)."""
    version = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability() == (9, 0) and version >= (12, 9)


@cuda
@pytest.mark.parametrize("shape", [(256, 256), (384, 256), (512, 384), (200, 264), (256, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_match_the_emulation_or_are_not_chosen(shape, dtype):
    device = torch.device("cuda")
    weight, scale_inv = fp8_linear.probe_weight(*shape, device, seed=3)
    reference = Fp8Linear(weight.cpu(), scale_inv.cpu(), torch.float32, fp8_linear.emulated_scaled_mm)
    passed = []
    for name, kernel in fp8_linear.cuda_kernels(device):
        if not fp8_linear.self_check(kernel, *shape, device, dtype):
            continue
        passed.append(name)
        linear = Fp8Linear(weight, scale_inv, dtype, kernel, name)
        x = torch.randn(3, shape[1], device=device, dtype=dtype)
        want = reference(x.cpu().float())
        assert (linear(x).float().cpu() - want).abs().max() <= 2e-2 * want.abs().max(), name
    if _cublas_blockwise_expected() and shape[0] % 128 == 0 and shape[1] % 128 == 0:
        assert passed, f"no block-scaled FP8 entry point passed on {shape}: scale layouts wrong?"


@cuda
def test_cuda_fp8_checkpoint_close_to_the_cpu_dequantized_model(aligned_dir, ragged_dir):
    for path in (aligned_dir, ragged_dir):
        model = Qwen3.from_directory(path, device="cuda", dtype=torch.bfloat16)
        fp8_projections = sum(isinstance(m, Fp8Linear) for m in model.modules())
        if path == aligned_dir and _cublas_blockwise_expected():
            assert fp8_projections == 4 * model.config.num_hidden_layers
        want_model = Qwen3.from_directory(path, dtype=torch.float32)
        ids = _prompt(20, 8)
        got, want = _logits(model, ids).float().cpu(), _logits(want_model, ids)
        error = got - want
        assert error.abs().max() < 0.15 * want.abs().max(), fp8_projections
        assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99
        dequantized = Qwen3.from_directory(path, device="cuda", dtype=torch.bfloat16, fp8="dequantize")
        assert all(type(m) is not Fp8Linear for m in dequantized.modules())
        engine = Engine(model, num_pages=64, page_size=8, debug=True)
        assert all(len(r.output_token_ids) == 6 for r in engine.generate([ids, ids[:3]], max_new_tokens=6))
        assert_pool_free(engine)
