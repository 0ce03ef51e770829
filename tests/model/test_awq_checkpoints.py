"""AutoAWQ GEMM checkpoints loaded whole: random Qwen3 models packed to AWQ by the independent
packer (tests/helpers/int4_checkpoints.py), against transformers running the same model on the
dequantized weights; the fused projections, modules_to_not_convert, strictness, the refusals."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import load_reference, rewrite_checkpoint
from engine_helpers import (
    assert_pool_free, decode_logits, prefill_logits, reference_greedy, reference_logits, seeded_prompt,
)
from int4_checkpoints import make_awq_checkpoint
from qil_worker import Engine, Qwen3
from qil_worker.config import AwqQuantization, Qwen3Config
from qil_worker.errors import ConfigError, WeightError
from qil_worker.model.int4_linear import Int4Linear
from qil_worker.model.linear import Linear

ATOL = 2e-4
# hidden and intermediate sizes multiples of 128: AWQ's usual group size
G128 = dict(hidden_size=128, intermediate_size=256, head_dim=32, tie_word_embeddings=False, vocab_size=160)


@pytest.fixture(scope="module")
def g128(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq128")
    return make_awq_checkpoint(root / "awq", root / "ref", seed=21, group_size=128, **G128), root / "ref"


@pytest.fixture(scope="module")
def g32(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq32")  # the tiny tied model: hidden 64, intermediate 96
    return make_awq_checkpoint(root / "awq", root / "ref", seed=22, group_size=32), root / "ref"


@pytest.mark.parametrize("fixture", ["g128", "g32"])
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_logits_match_transformers_on_the_dequantized_weights(request, fixture, fused):
    path, ref = request.getfixturevalue(fixture)
    model = Qwen3.from_directory(path, dtype="float32", fused_projections=fused)
    layer = model.layers[0]
    fused_parts = [layer.qkv_proj, layer.mlp.gate_up_proj] if fused else \
        [layer.qk_proj, layer.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj]
    for proj in (*fused_parts, layer.o_proj, layer.mlp.down_proj):
        assert type(proj) is Int4Linear and proj.label == "awq int4", proj
        assert proj.group_size == model.config.quantization.group_size
    assert type(model.head) is Linear and model.embed.dtype == torch.float32  # not quantized
    config = model.config
    kv = config.num_key_value_heads * config.head_dim
    assert (layer.qkv_proj if fused else layer.qk_proj).out_features == \
        config.num_attention_heads * config.head_dim + (2 if fused else 1) * kv
    ids = seeded_prompt(33, 5, config.vocab_size)
    want = reference_logits(ref, ids)
    torch.testing.assert_close(prefill_logits(model, ids), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(decode_logits(model, ids), want, atol=ATOL, rtol=0)


def test_engine_greedy_tokens_equal_transformers_and_every_page_is_freed(g128):
    path, ref = g128
    reference = load_reference(ref)
    prompts = [seeded_prompt(n, 30 + n, 160) for n in (1, 6, 21)]
    expected = [reference_greedy(reference, p, 10) for p in prompts]
    engine = Engine(Qwen3.from_directory(path, dtype="float32"), num_pages=64, page_size=8, debug=True)
    assert [r.output_token_ids for r in engine.generate(prompts, max_new_tokens=10)] == expected
    assert_pool_free(engine)
    engine.close()


def test_bfloat16_runs_the_int4_kernel_close_to_the_reference(g128):
    path, ref = g128
    model = Qwen3.from_directory(path, dtype="bfloat16")
    assert model.layers[0].qk_proj.kernel == "int4pack"  # the CPU kernel runs these shapes
    ids = seeded_prompt(20, 6, 160)
    got, want = prefill_logits(model, ids), reference_logits(ref, ids)
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_the_log_and_the_weight_summary_say_awq_int4(g128, caplog):
    path, _ = g128
    with caplog.at_level(logging.INFO, logger="qil_worker.model.qwen3"):
        model = Qwen3.from_directory(path, dtype="float32")
    formats, size = model.weight_summary()
    assert formats.startswith("12x awq int4 asymmetric group 128 (weight-only, _weight_int4pack_mm)"), formats
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("AWQ checkpoint"))
    assert line == f"AWQ checkpoint: {formats}; weights in memory {size / 2**20:.1f} MiB"


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_modules_to_not_convert_stay_dense_and_mixed_projections_are_dequantized(tmp_path, fused):
    path = make_awq_checkpoint(tmp_path / "awq", tmp_path / "ref", seed=23, group_size=128,
                               modules_to_not_convert=["k_proj", "down_proj"], **G128)
    assert "model.layers.0.mlp.down_proj.weight" in load_file(path / "model.safetensors")
    model = Qwen3.from_directory(path, dtype="float32", fused_projections=fused, pack_weights=False)
    layer = model.layers[1]
    assert type(layer.mlp.down_proj) is Linear
    # q and k share a projection (with v when fused): k dense, so the whole projection is
    assert type(layer.qkv_proj if fused else layer.qk_proj) is Linear
    if not fused:
        assert type(layer.v_proj) is Int4Linear
    ids = seeded_prompt(17, 7, 160)
    torch.testing.assert_close(prefill_logits(model, ids), reference_logits(tmp_path / "ref", ids), atol=ATOL, rtol=0)




def test_every_layout_problem_in_one_error_naming_each_tensor(g32, tmp_path):
    path, _ = g32
    l0, l1 = "model.layers.0.", "model.layers.1."

    def mutate(t):
        del t[l0 + "self_attn.k_proj.qzeros"]                                          # missing
        t[l0 + "mlp.up_proj.scales"] = t[l0 + "mlp.up_proj.scales"][:1]                # (2, 96) → (1, 96)
        t[l1 + "self_attn.o_proj.qweight"] = t[l1 + "self_attn.o_proj.qweight"].float()  # not int32
        t[l1 + "mlp.gate_proj.weight"] = torch.zeros(96, 64, dtype=torch.float16)      # dense beside AWQ
        t["lm_head.qweight"] = torch.zeros(64, 12, dtype=torch.int32)                  # the head is not AWQ

    with pytest.raises(WeightError) as info:
        Qwen3.from_directory(rewrite_checkpoint(path, tmp_path / "bad", mutate))
    msg = str(info.value)
    assert "5 problem(s)" in msg, msg
    assert f"missing: {l0}self_attn.k_proj.qzeros (expected shape (2, 4) int32)" in msg
    assert f"mis-shaped: {l0}mlp.up_proj.scales expected (2, 96), got (1, 96)" in msg
    assert f"bad dtype: {l1}self_attn.o_proj.qweight is F32; expected int32 (I32)" in msg
    assert f"unknown: {l1}mlp.gate_proj.weight (shape (96, 64))" in msg
    assert "unknown: lm_head.qweight (shape (64, 12))" in msg


def test_a_shape_awq_cannot_pack_is_refused_by_name(tmp_path):
    # head_dim 10: v_proj has 2 x 10 outputs, which AWQ's eight per int32 cannot pack
    path = make_awq_checkpoint(tmp_path / "awq", seed=24, group_size=32, head_dim=10,
                               modules_to_not_convert=["k_proj", "v_proj", "q_proj", "o_proj"])
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["modules_to_not_convert"] = ["k_proj", "q_proj", "o_proj"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(WeightError, match=r"not awq int4-packable: model.layers.0.self_attn.v_proj \[20, 64\] needs "
                                          r"outputs a multiple of 8"):
        Qwen3.from_directory(path)


def _awq(**changes):
    raw = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm", **changes}
    return {"model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 160, "quantization_config": raw}


def test_config_reads_the_awq_quantization():
    config = Qwen3Config.from_dict(_awq(modules_to_not_convert=["mlp.down_proj"], version="GEMM"))
    assert config.quantization == AwqQuantization(group_size=128, modules_to_not_convert=("mlp.down_proj",))
    # transformers 5 spells the packing ``format``; zero_point defaults to true
    raw = _awq(group_size=32, format="gemm")
    del raw["quantization_config"]["version"], raw["quantization_config"]["zero_point"]
    assert Qwen3Config.from_dict(raw).quantization == AwqQuantization(group_size=32)


@pytest.mark.parametrize("changes, key", [
    ({"bits": 8}, "bits"), ({"bits": 3}, "bits"), ({"zero_point": False}, "zero_point"),
    ({"version": "gemv"}, "version"), ({"version": "exllama"}, "version"), ({"version": None, "format": "gemv"}, "format"),
    ({"format": "gemv"}, "format"), ({"group_size": -1}, "group_size"), ({"group_size": "128"}, "group_size"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert"),
])
def test_config_refuses_awq_it_does_not_compute_naming_the_key(changes, key):
    with pytest.raises(ConfigError, match=rf"^quantization_config\.{key}: "):
        Qwen3Config.from_dict(_awq(**changes))


def test_config_refuses_other_methods():
    with pytest.raises(ConfigError, match=r"quantization_config.quant_method: 'bitsandbytes' is not supported"):
        Qwen3Config.from_dict(_awq(quant_method="bitsandbytes"))


@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_a_moe_checkpoint_loads_its_experts_as_int4_and_matches_transformers(tmp_path, fused):
    from checkpoints import load_moe_reference

    from qil_worker.model.int4_experts import Int4ExpertLinear

    path = make_awq_checkpoint(tmp_path / "awq", tmp_path / "ref", seed=25, group_size=32, moe=True)
    model = Qwen3.from_directory(path, dtype="float32", fused_projections=fused)
    mlp = model.layers[1].mlp
    assert type(mlp.gate_up) is Int4ExpertLinear and type(mlp.down) is Int4ExpertLinear
    assert mlp.gate_up.num_experts == 8 and mlp.gate_up.out_features == 2 * 32  # gate and up, fused
    assert type(mlp.gate).__name__ == "Router"  # the router stays dense
    assert "awq int4 experts asymmetric group 32" in model.weight_summary()[0]
    ids = seeded_prompt(21, 8, 97)
    with torch.no_grad():
        want = load_moe_reference(tmp_path / "ref")(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(decode_logits(model, ids), want, atol=ATOL, rtol=0)


def test_moe_experts_are_never_allocated_dense_and_the_engine_matches_transformers(tmp_path, monkeypatch):
    from checkpoints import load_moe_reference

    from qil_worker import cpu_memory

    path = make_awq_checkpoint(tmp_path / "awq", tmp_path / "ref", seed=26, group_size=32, moe=True)
    shapes = []
    empty = cpu_memory.empty
    monkeypatch.setattr(cpu_memory, "empty", lambda shape, *a, **k: shapes.append(tuple(shape)) or empty(shape, *a, **k))
    model = Qwen3.from_directory(path, dtype="float32")
    assert (8, 64) in shapes and not {(8, 64, 64), (8, 64, 32)} & set(shapes), shapes  # routers dense, experts not
    reference = load_moe_reference(tmp_path / "ref")
    prompts = [seeded_prompt(n, 50 + n, 97) for n in (3, 11)]
    expected = [reference_greedy(reference, p, 8) for p in prompts]
    engine = Engine(model, num_pages=64, page_size=8, debug=True)
    assert [r.output_token_ids for r in engine.generate(prompts, max_new_tokens=8)] == expected
    assert_pool_free(engine)
    engine.close()


def test_quantize_on_an_awq_checkpoint_is_refused(g32):
    path, _ = g32
    with pytest.raises(ConfigError, match=r"quantize: 'int8' cannot be applied to an AWQ checkpoint"):
        Qwen3.from_directory(path, quantize="int8")
    assert Qwen3.from_directory(path, quantize="none").layers[0].o_proj.label == "awq int4"
    proc = subprocess.run(
        [sys.executable, "-m", "qil_worker", "generate", "--model", str(path), "--token-ids", "[1, 2]",
         "--max-new-tokens", "2", "--quantize", "int4"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "quantize: 'int4' cannot be applied to an AWQ checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_server_reports_awq_int4_in_get_info(g32):
    from service_fixtures import start_server

    from qil_client import Client

    expected = Qwen3.from_directory(g32[0], dtype="bfloat16").weight_summary()
    with start_server(g32[0], dtype="bfloat16") as srv:
        with Client(srv.target) as client:
            info = client.info().model
            result = client.generate(seeded_prompt(8, 2, 97), max_new_tokens=4)
    assert info.weight_format == expected[0] and info.weight_format.startswith("12x awq int4 asymmetric group 32")
    assert info.weight_bytes == expected[1]
    assert len(result.token_ids) == 4


def test_projections_loaded_as_int4_are_never_allocated_dense(g128, monkeypatch):
    from qil_worker import cpu_memory

    shapes = []
    empty = cpu_memory.empty
    monkeypatch.setattr(cpu_memory, "empty", lambda shape, *a, **k: shapes.append(tuple(shape)) or empty(shape, *a, **k))
    model = Qwen3.from_directory(g128[0], dtype="float32", pack_weights=False)
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert (160, 128) in shapes  # the untied LM head, a dense Linear
    projection_shapes = {(128 + 64, 128), (64, 128), (128, 128), (256, 128), (128, 256)}
    assert not projection_shapes & set(shapes), shapes


def test_tensor_parallelism_is_refused_for_int4_checkpoints():
    from qil_worker.parallel import check_tp_size

    with pytest.raises(ConfigError, match=r"tensor_parallel_size: int4 checkpoints \(quantization_config: AWQ, GPTQ\) are not split across ranks"):
        check_tp_size(Qwen3Config.from_dict(_awq()), 2)
    check_tp_size(Qwen3Config.from_dict(_awq()), 1)
