"""Headless (Qwen3-Embedding-4B/8B-style) and sentence-transformers checkpoints: detected from
their files, loaded without an LM head only as embedding models, and their hidden states equal
transformers' ``Qwen3Model``."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from checkpoints import make_checkpoint
from qil_worker import Engine, Qwen3
from qil_worker.errors import ConfigError, WeightError
from qil_worker.model.embedding_checkpoint import detect


def _headless(src, dst, strip_prefix):
    """``src`` without its LM head (and, with ``strip_prefix``, saved as a base Qwen3Model)."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    del tensors["lm_head.weight"]
    if strip_prefix:
        tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("untied") / "m", seed=4, tie_word_embeddings=False)


@pytest.mark.parametrize("strip_prefix", [False, True])
def test_headless_loads_only_as_an_embedding_model(untied, tmp_path, strip_prefix):
    from transformers import Qwen3Model

    path = _headless(untied, tmp_path / "headless", strip_prefix)
    assert detect(path) is not None and detect(path).headless
    assert detect(untied) is None
    with pytest.raises(WeightError, match=r"(?s)missing: lm_head.weight.*embedding=True"):
        Qwen3.from_directory(path)
    model = Qwen3.from_directory(path, dtype="float32", pack_weights=False, embedding=True)
    assert model.config.headless and model.lm_head is None and "lm_head.weight" not in model.weight_targets()
    reference = Qwen3Model.from_pretrained(path).eval()
    prompts = [[5, 17, 42, 8, 90], [3], list(range(1, 30))]
    engine = Engine(model, num_pages=32, page_size=4, token_budget=32, prefill_chunk=8, max_active=4)
    for got, prompt in zip(engine.embed(prompts), prompts):
        with torch.no_grad():
            want = F.normalize(reference(torch.tensor([prompt])).last_hidden_state[0, -1], dim=-1)
        assert F.cosine_similarity(torch.tensor(got), want, dim=0).item() >= 0.99999


def test_a_headless_checkpoint_still_names_any_other_missing_tensor(untied, tmp_path):
    path = _headless(untied, tmp_path / "headless", strip_prefix=True)
    tensors = load_file(path / "model.safetensors")
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(WeightError, match="missing: model.layers.0.mlp.up_proj.weight") as info:
        Qwen3.from_directory(path, embedding=True)
    assert "lm_head" not in str(info.value)


def _sentence_transformers(path, pooling: dict, normalize: bool = True):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **pooling}))


def test_a_last_token_sentence_transformers_directory_is_an_embedding_model(tmp_path):
    path = make_checkpoint(tmp_path / "st", seed=2)
    _sentence_transformers(path, {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False})
    found = detect(path)
    assert found is not None and found.sentence_transformers and found.normalize and not found.headless
    _sentence_transformers(path, {"pooling_mode_lasttoken": True}, normalize=False)
    assert not detect(path).normalize


@pytest.mark.parametrize("key", ["pooling_mode_mean_tokens", "pooling_mode_cls_token"])
def test_a_pooling_mode_we_do_not_compute_is_refused_naming_file_and_key(tmp_path, key):
    path = make_checkpoint(tmp_path / "st", seed=2)
    _sentence_transformers(path, {"pooling_mode_lasttoken": False, key: True})
    with pytest.raises(ConfigError, match=rf"1_Pooling/config.json: {key}: true"):
        detect(path)
