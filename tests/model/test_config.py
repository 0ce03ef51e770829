import json

import pytest

from qil_worker.config import Qwen3Config
from qil_worker.errors import ConfigError


def _raw(tiny_dir):
    return json.loads((tiny_dir / "config.json").read_text())


def test_reads_transformers_config(tiny_dir):
    c = Qwen3Config.from_directory(tiny_dir)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    assert c.head_dim == 16 and c.num_query_groups == 2
    assert c.rope_theta == 10000.0 and c.tie_word_embeddings is True
    assert c.eos_token_ids == ()


def test_transformers_4_spelling_and_eos_list(tiny_dir):
    raw = _raw(tiny_dir)
    raw.pop("rope_parameters")
    raw.update(rope_theta=1e6, rope_scaling=None, eos_token_id=[5, 7], torch_dtype="bfloat16")
    c = Qwen3Config.from_dict(raw)
    assert c.rope_theta == 1e6 and c.eos_token_ids == (5, 7) and c.torch_dtype == "bfloat16"
    assert Qwen3Config.from_dict({**raw, "eos_token_id": 3}).eos_token_ids == (3,)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"attention_bias": True}, "attention_bias"),
        ({"eos_token_id": "x"}, "eos_token_id"),
    ],
)
def test_rejects_unsupported(tiny_dir, change, field):
    with pytest.raises(ConfigError, match=field):
        Qwen3Config.from_dict({**_raw(tiny_dir), **change})


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        Qwen3Config.from_directory(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Qwen3Config.from_directory(tmp_path)


def test_eos_ids_of_generation_config_are_added(tiny_dir, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**_raw(tiny_dir), "eos_token_id": 90}))
    generation = tmp_path / "generation_config.json"
    generation.write_text(json.dumps({"eos_token_id": [90, 44]}))
    assert Qwen3Config.from_directory(tmp_path).eos_token_ids == (90, 44)
    generation.write_text(json.dumps({"eos_token_id": 7, "temperature": 0.6}))
    assert Qwen3Config.from_directory(tmp_path).eos_token_ids == (90, 7)
    generation.write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id"):
        Qwen3Config.from_directory(tmp_path)
    generation.write_text("{not json")
    with pytest.raises(ConfigError, match="generation_config.json: not valid JSON"):
        Qwen3Config.from_directory(tmp_path)
    generation.unlink()
    assert Qwen3Config.from_directory(tmp_path).eos_token_ids == (90,)


def test_silent_fields_default_as_in_transformers(tiny_dir):
    """Where config.json says nothing, the weights mean what transformers' Qwen3Config says."""
    from transformers import Qwen3Config as Reference

    raw = {k: v for k, v in _raw(tiny_dir).items() if k not in ("rope_parameters", "rope_theta", "head_dim")}
    ours, theirs = Qwen3Config.from_dict(raw), Reference.from_dict(raw)
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 10000.0
    assert ours.head_dim == theirs.head_dim == 128


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}, "rope_theta": 1e4},
        {"rope_scaling": {"type": "default"}, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
        {"rope_parameters": {"rope_type": "default"}, "rope_theta": 5e5},
        {"rope_parameters": {}, "rope_theta": 2e5},
        {"rope_scaling": None, "rope_theta": 1e6},
    ],
)
def test_rope_base_is_read_where_transformers_reads_it(tiny_dir, rope):
    from transformers import Qwen3Config as Reference

    raw = {k: v for k, v in _raw(tiny_dir).items() if k not in ("rope_parameters", "rope_theta")}
    raw.update(rope)
    assert Qwen3Config.from_dict(raw).rope_theta == Reference.from_dict(raw).rope_parameters["rope_theta"]


@pytest.mark.parametrize(
    "change, field",
    [
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5}}}, "rope_parameters"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"max_position_embeddings": None}, "max_position_embeddings"),
        ({"max_position_embeddings": -5}, "max_position_embeddings"),
        ({"rope_parameters": None, "rope_theta": None}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": "abc"}}, "rope_theta"),
    ],
)
def test_rejects_malformed_values_with_the_field_named(tiny_dir, change, field):
    with pytest.raises(ConfigError, match=field):
        Qwen3Config.from_dict({**_raw(tiny_dir), **change})
