"""GPTQ (v1, no act-order) checkpoints: the unpacking against tensors packed by the independent
packer (tests/helpers/int4_checkpoints.py), whole random Qwen3 models against transformers on the
dequantized weights, strictness, act-order and the config refusals."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoints import load_reference, rewrite_checkpoint
from engine_helpers import (
    assert_pool_free, decode_logits, prefill_logits, reference_greedy, reference_logits, seeded_prompt,
)
from int4_checkpoints import gptq_quantize, make_gptq_checkpoint, pack_columns, pack_rows
from qil_worker import Engine, Qwen3
from qil_worker.config import GptqQuantization, Qwen3Config
from qil_worker.errors import ConfigError, WeightError
from qil_worker.model import gptq
from qil_worker.model.int4_linear import Int4Linear, dequantize
from qil_worker.model.linear import Linear

ATOL = 2e-4
G128 = dict(hidden_size=128, intermediate_size=256, head_dim=32, tie_word_embeddings=False, vocab_size=160)


def test_unpacking_inverts_the_packing_of_rows_and_columns():
    values = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(gptq.unpack_nibbles(pack_rows(values), 0).long(), values)
    assert torch.equal(gptq.unpack_nibbles(pack_columns(values), 1).long(), values)
    one = torch.zeros(8, 1, dtype=torch.long)
    one[1, 0] = 5  # input 1 sits in nibble 1 (bits 4..7)
    assert pack_rows(one).item() == 5 << 4


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_a_gptq_linear_unpacks_to_its_dequantized_weight(sym):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(1))
    weight[:8, :128] = weight[:8, :128].abs()  # groups with min > 0: zero 0, stored as 15, read as 16
    tensors, want = gptq_quantize(weight, 128, sym)
    codes, scales, mins = gptq.unpack_tensors(tensors, 128, torch.float32, "l")
    torch.testing.assert_close(dequantize(codes, scales, mins), want, atol=1e-5, rtol=0)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    for kernel in ("int4pack", "dequantize"):
        torch.testing.assert_close(Int4Linear(codes, scales, mins, kernel)(x), x @ want.t(), atol=1e-4, rtol=1e-5)


def test_act_order_group_indices_are_refused_by_name():
    tensors, _ = gptq_quantize(torch.randn(16, 256), 128)
    tensors["g_idx"] = tensors["g_idx"].flip(0)
    with pytest.raises(ValueError, match=r"q_proj.g_idx: not k // group_size for every input"):
        gptq.unpack_tensors(tensors, 128, torch.float32, "q_proj")


@pytest.fixture(scope="module")
def g128(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq128")
    return make_gptq_checkpoint(root / "gptq", root / "ref", seed=31, group_size=128, **G128), root / "ref"


@pytest.fixture(scope="module")
def g32_asym(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq32")  # the tiny tied model: hidden 64, intermediate 96
    return make_gptq_checkpoint(root / "gptq", root / "ref", seed=32, group_size=32, sym=False), root / "ref"


@pytest.mark.parametrize("fixture", ["g128", "g32_asym"])
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
def test_logits_match_transformers_on_the_dequantized_weights(request, fixture, fused):
    path, ref = request.getfixturevalue(fixture)
    model = Qwen3.from_directory(path, dtype="float32", fused_projections=fused)
    layer = model.layers[0]
    fused_parts = [layer.qkv_proj, layer.mlp.gate_up_proj] if fused else \
        [layer.qk_proj, layer.v_proj, layer.mlp.gate_proj, layer.mlp.up_proj]
    for proj in (*fused_parts, layer.o_proj, layer.mlp.down_proj):
        assert type(proj) is Int4Linear and proj.label == "gptq int4", proj
    assert type(model.head) is Linear
    ids = seeded_prompt(29, 5, model.config.vocab_size)
    want = reference_logits(ref, ids)
    torch.testing.assert_close(prefill_logits(model, ids), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(decode_logits(model, ids), want, atol=ATOL, rtol=0)


def test_engine_greedy_tokens_equal_transformers_and_every_page_is_freed(g128):
    path, ref = g128
    reference = load_reference(ref)
    prompts = [seeded_prompt(n, 40 + n, 160) for n in (2, 9, 17)]
    expected = [reference_greedy(reference, p, 8) for p in prompts]
    engine = Engine(Qwen3.from_directory(path, dtype="float32"), num_pages=64, page_size=8, debug=True)
    assert [r.output_token_ids for r in engine.generate(prompts, max_new_tokens=8)] == expected
    assert_pool_free(engine)
    engine.close()


def test_the_weight_summary_says_gptq_int4_and_quantize_is_refused(g128):
    path, _ = g128
    formats, _ = Qwen3.from_directory(path, dtype="float32").weight_summary()
    assert formats.startswith("12x gptq int4 asymmetric group 128 (weight-only, _weight_int4pack_mm)"), formats
    with pytest.raises(ConfigError, match=r"quantize: 'int4' cannot be applied to a GPTQ checkpoint"):
        Qwen3.from_directory(path, quantize="int4")


def test_modules_to_not_convert_stay_dense(tmp_path):
    path = make_gptq_checkpoint(tmp_path / "gptq", tmp_path / "ref", seed=33, group_size=128,
                                modules_to_not_convert=["up_proj"], **G128)
    model = Qwen3.from_directory(path, dtype="float32", fused_projections=True, pack_weights=False)
    assert type(model.layers[0].mlp.gate_up_proj) is Linear and type(model.layers[0].qkv_proj) is Int4Linear
    ids = seeded_prompt(13, 7, 160)
    torch.testing.assert_close(prefill_logits(model, ids), reference_logits(tmp_path / "ref", ids), atol=ATOL, rtol=0)




def test_every_layout_problem_in_one_error_naming_each_tensor(g32_asym, tmp_path):
    path, _ = g32_asym
    l0, l1 = "model.layers.0.", "model.layers.1."

    def mutate(t):
        del t[l0 + "self_attn.v_proj.g_idx"]
        t[l1 + "mlp.down_proj.qweight"] = t[l1 + "mlp.down_proj.qweight"][:4]  # (12, 64) → (4, 64)
        t[l1 + "self_attn.q_proj.scales"] = t[l1 + "self_attn.q_proj.scales"].int()

    with pytest.raises(WeightError) as info:
        Qwen3.from_directory(rewrite_checkpoint(path, tmp_path / "bad", mutate))
    msg = str(info.value)
    assert "3 problem(s)" in msg, msg
    assert f"missing: {l0}self_attn.v_proj.g_idx (expected shape (64,) int32)" in msg
    assert f"mis-shaped: {l1}mlp.down_proj.qweight expected (12, 64), got (4, 64)" in msg
    assert f"bad dtype: {l1}self_attn.q_proj.scales is I32; expected float (F16/BF16/F32)" in msg


def test_an_act_order_checkpoint_is_refused_at_load_by_the_tensor(g32_asym, tmp_path):
    path, _ = g32_asym
    name = "model.layers.1.mlp.gate_proj.g_idx"

    def permute(t):
        t[name] = t[name].flip(0)

    with pytest.raises(WeightError, match=rf"{name}: not k // group_size for every input"):
        Qwen3.from_directory(rewrite_checkpoint(path, tmp_path / "act_order", permute))


def _gptq(**changes):
    raw = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
           "checkpoint_format": "gptq", **changes}
    return {"model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 160, "quantization_config": raw}


def test_config_reads_the_gptq_quantization():
    blocks = [["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"], ["self_attn.o_proj"],
              ["mlp.up_proj", "mlp.gate_proj"], ["mlp.down_proj"]]
    config = Qwen3Config.from_dict(_gptq(sym=False, modules_in_block_to_quantize=blocks, format="GPTQ"))
    assert config.quantization == GptqQuantization(group_size=128, sym=False)
    raw = _gptq(group_size=32)
    for key in ("desc_act", "sym", "checkpoint_format"):  # GPTQConfig's defaults where silent
        del raw["quantization_config"][key]
    assert Qwen3Config.from_dict(raw).quantization == GptqQuantization(group_size=32, sym=True)


@pytest.mark.parametrize("changes, key", [
    ({"bits": 8}, "bits"), ({"bits": 3}, "bits"), ({"desc_act": True}, "desc_act"), ({"sym": "yes"}, "sym"),
    ({"group_size": -1}, "group_size"), ({"checkpoint_format": "gptq_v2"}, "checkpoint_format"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format"), ({"format": "bitblas"}, "format"),
    ({"lm_head": True}, "lm_head"), ({"pack_dtype": "int16"}, "pack_dtype"),
    ({"dynamic": {"-:.*down_proj": {}}}, "dynamic"),
    ({"modules_in_block_to_quantize": [["self_attn.q_proj"]]}, "modules_in_block_to_quantize"),
])
def test_config_refuses_gptq_it_does_not_compute_naming_the_key(changes, key):
    with pytest.raises(ConfigError, match=rf"^quantization_config\.{key}: .* is not supported for gptq"):
        Qwen3Config.from_dict(_gptq(**changes))


def test_a_moe_checkpoint_loads_its_experts_as_int4_and_matches_transformers(tmp_path):
    from checkpoints import load_moe_reference

    from qil_worker.model.int4_experts import Int4ExpertLinear

    path = make_gptq_checkpoint(tmp_path / "gptq", tmp_path / "ref", seed=34, group_size=32, moe=True)
    model = Qwen3.from_directory(path, dtype="float32")
    assert type(model.layers[2].mlp.down) is Int4ExpertLinear
    assert "gptq int4 experts asymmetric group 32" in model.weight_summary()[0]
    ids = seeded_prompt(19, 9, 97)
    with torch.no_grad():
        want = load_moe_reference(tmp_path / "ref")(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(decode_logits(model, ids), want, atol=ATOL, rtol=0)


def test_the_config_file_round_trip(g128):
    raw = json.loads((g128[0] / "config.json").read_text())["quantization_config"]
    assert raw["quant_method"] == "gptq" and Qwen3Config.from_directory(g128[0]).quantization.group_size == 128
