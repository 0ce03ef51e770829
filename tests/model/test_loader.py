import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import load_reference, make_checkpoint, rewrite_checkpoint
from qil_worker import Qwen3
from qil_worker.errors import ConfigError, WeightError




def test_loads_every_tensor(tiny_dir):
    model = Qwen3.from_directory(tiny_dir, pack_weights=False)  # keep the parameters to inspect
    ref = load_reference(tiny_dir).state_dict()
    layer = model.layers[1]
    assert torch.equal(model.embed, ref["model.embed_tokens.weight"])
    assert torch.equal(layer.qk_proj.weight[:64], ref["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(layer.v_proj.weight, ref["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(layer.mlp.up_proj.weight, ref["model.layers.1.mlp.up_proj.weight"])
    assert model.lm_head is None


def test_sharded_untied(tiny_untied_sharded_dir):
    index = json.loads((tiny_untied_sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "fixture should be sharded"
    model = Qwen3.from_directory(tiny_untied_sharded_dir, pack_weights=False)
    ref = load_reference(tiny_untied_sharded_dir).state_dict()
    assert torch.equal(model.lm_head, ref["lm_head.weight"])
    assert not torch.equal(model.lm_head, model.embed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, "bfloat16"])
def test_converts_dtype_while_loading(tiny_dir, dtype):
    model = Qwen3.from_directory(tiny_dir, dtype=dtype)
    want = torch.bfloat16 if dtype == "bfloat16" else dtype
    assert all(p.dtype == want for p in model.parameters())
    assert model.dtype == want


def test_rejects_unknown_dtype(tiny_dir):
    with pytest.raises(ConfigError, match="dtype"):
        Qwen3.from_directory(tiny_dir, dtype="int8")


def test_reports_every_problem_at_once(tiny_dir, tmp_path):
    def mutate(t):
        del t["model.layers.0.mlp.up_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.9.extra.weight"] = torch.zeros(3)
        t["model.layers.1.self_attn.k_norm.weight"] = torch.zeros(17)

    bad = rewrite_checkpoint(tiny_dir, tmp_path / "bad", mutate)
    with pytest.raises(WeightError) as info:
        Qwen3.from_directory(bad)
    msg = str(info.value)
    assert "4 problem(s)" in msg
    assert "missing: model.layers.0.mlp.up_proj.weight (expected shape (96, 64))" in msg
    assert "missing: model.norm.weight" in msg
    assert "unknown: model.layers.9.extra.weight" in msg
    assert "mis-shaped: model.layers.1.self_attn.k_norm.weight expected (16,), got (17,)" in msg


def test_untied_head_required_tied_head_optional(tiny_dir, tmp_path):
    untied = make_checkpoint(tmp_path / "untied", seed=3, tie_word_embeddings=False)

    def drop_head(t):
        del t["lm_head.weight"]

    bad = rewrite_checkpoint(untied, tmp_path / "nohead", drop_head)
    with pytest.raises(WeightError, match="missing: lm_head.weight"):
        Qwen3.from_directory(bad)

    def add_head(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    tied_with_copy = rewrite_checkpoint(tiny_dir, tmp_path / "tiedcopy", add_head)
    assert Qwen3.from_directory(tied_with_copy).lm_head is None

    def add_other_head(t):  # transformers would use this head, untied
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 0.5

    tied_with_other = rewrite_checkpoint(tiny_dir, tmp_path / "tiedother", add_other_head)
    with pytest.raises(WeightError, match="lm_head.weight differs from model.embed_tokens.weight"):
        Qwen3.from_directory(tied_with_other)


def test_missing_files_and_shards(tiny_untied_sharded_dir, tmp_path):
    with pytest.raises(WeightError, match="neither model.safetensors"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "config.json").write_text(
            (tiny_untied_sharded_dir / "config.json").read_text()
        )
        Qwen3.from_directory(tmp_path / "empty")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_untied_sharded_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    first_shard = sorted(broken.glob("model-*.safetensors"))[0]
    first_shard.unlink()
    with pytest.raises(WeightError, match="not found"):
        Qwen3.from_directory(broken)


def test_single_file_wins_over_an_index_as_in_transformers(tiny_dir, tiny_untied_sharded_dir, tmp_path):
    both = tmp_path / "both"
    both.mkdir()
    for f in tiny_untied_sharded_dir.iterdir():  # an untied, sharded checkpoint ...
        (both / f.name).write_bytes(f.read_bytes())
    config = json.loads((both / "config.json").read_text())
    tied = {k: v for k, v in load_file(tiny_dir / "model.safetensors").items()}
    # ... beside a single file holding other weights of the same shapes, plus an untied head
    tied["lm_head.weight"] = tied["model.embed_tokens.weight"] * 0.5
    save_file(tied, both / "model.safetensors")
    model = Qwen3.from_directory(both, pack_weights=False)
    ref = load_reference(both).state_dict()
    assert config["tie_word_embeddings"] is False
    assert torch.equal(model.embed, ref["model.embed_tokens.weight"])
    assert torch.equal(model.embed, tied["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head, ref["lm_head.weight"])


def test_bin_checkpoint_is_explained(tiny_dir, tmp_path):
    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    (bin_only / "config.json").write_text((tiny_dir / "config.json").read_text())
    torch.save(load_file(tiny_dir / "model.safetensors"), bin_only / "pytorch_model.bin")
    with pytest.raises(WeightError, match="PyTorch .bin weights"):
        Qwen3.from_directory(bin_only)


def _strip_prefix(t):
    for name in list(t):
        t[name.removeprefix("model.")] = t.pop(name)


def test_a_base_model_layout_loads_as_the_causal_lm(tiny_dir, tmp_path):
    """Qwen3-Embedding's files hold a base Qwen3Model (no ``model.`` prefix, no LM head): with a
    tied config they are the same weights, and load as such."""
    base = rewrite_checkpoint(tiny_dir, tmp_path / "base", _strip_prefix)
    assert not any(k.startswith("model.") for k in load_file(base / "model.safetensors"))
    plain = Qwen3.from_directory(tiny_dir, dtype="float32", pack_weights=False)
    model = Qwen3.from_directory(base, dtype="float32", pack_weights=False)
    assert model.weight_targets().keys() == plain.weight_targets().keys()
    for name, tensor in plain.weight_targets().items():
        assert torch.equal(model.weight_targets()[name], tensor), name


def test_a_base_model_layout_of_an_untied_config_names_the_missing_head(tmp_path):
    untied = make_checkpoint(tmp_path / "untied", seed=1, tie_word_embeddings=False)

    def headless(t):
        t.pop("lm_head.weight")
        _strip_prefix(t)

    with pytest.raises(WeightError, match="missing: lm_head.weight"):
        Qwen3.from_directory(rewrite_checkpoint(untied, tmp_path / "base", headless))


def test_auto_dtype_follows_the_stored_tensors_when_config_is_silent(tiny_dir, tmp_path):
    def to_bf16(t):
        for name in t:
            t[name] = t[name].to(torch.bfloat16)

    ckpt = rewrite_checkpoint(tiny_dir, tmp_path / "bf16", to_bf16)
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (ckpt / "config.json").write_text(json.dumps(config))
    assert Qwen3.from_directory(ckpt, dtype="auto").dtype == torch.bfloat16
    config["dtype"] = "float32"  # what config.json states wins, as in transformers
    (ckpt / "config.json").write_text(json.dumps(config))
    assert Qwen3.from_directory(ckpt, dtype="auto").dtype == torch.float32
