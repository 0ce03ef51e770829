"""The embedded demo model: a small, deterministic, *random* Qwen3 checkpoint.

``python -m qil_worker serve`` without ``--model`` serves it so that the quick start works with
no download. Its outputs are meaningless; logs and GetInfo say "demo". It is written once into
``$QIL_CACHE_DIR/demo-<version>`` (default ``~/.cache/qil``) with torch, safetensors and json only;
a byte-level ``tokenizer.json`` is added when the ``tokenizers`` library is importable.

Torch and safetensors are imported inside the functions that write: finding the cached
directory costs no import.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_VERSION = "v2"  # names the cache directory: a new version when the files written change
DEMO_NAME = "demo"
DEMO_SEED = 20240611
# 256 byte tokens + 3 special tokens, padded to 320.
NUM_BYTE_TOKENS = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = NUM_BYTE_TOKENS + 2  # <|im_end|>
DEMO_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 320,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": NUM_BYTE_TOKENS,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "float32",
    "qil_demo": True,
}


def cache_root() -> Path:
    env = os.environ.get("QIL_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "qil"


def demo_dir() -> Path:
    return cache_root() / f"demo-{DEMO_VERSION}"


def ensure_demo_model(path: Path | None = None) -> Path:
    """Return the demo checkpoint directory, writing it first if it is missing.

    Written into a temporary sibling and renamed, so concurrent servers never see half a model.
    """
    target = Path(path) if path is not None else demo_dir()
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        write_demo_checkpoint(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _tensors(config: dict, seed: int = DEMO_SEED) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def w(*shape: int):
        return torch.randn(*shape, generator=gen) * 0.15

    def norm(n: int):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    out = {"model.embed_tokens.weight": w(config["vocab_size"], h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = norm(h)
        out[p + "post_attention_layernorm.weight"] = norm(h)
        out[p + "self_attn.q_proj.weight"] = w(heads * hd, h)
        out[p + "self_attn.k_proj.weight"] = w(kv * hd, h)
        out[p + "self_attn.v_proj.weight"] = w(kv * hd, h)
        out[p + "self_attn.o_proj.weight"] = w(h, heads * hd)
        out[p + "self_attn.q_norm.weight"] = norm(hd)
        out[p + "self_attn.k_norm.weight"] = norm(hd)
        out[p + "mlp.gate_proj.weight"] = w(i, h)
        out[p + "mlp.up_proj.weight"] = w(i, h)
        out[p + "mlp.down_proj.weight"] = w(h, i)
    out["model.norm.weight"] = norm(h)
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = w(config["vocab_size"], h)
    return {k: v.contiguous() for k, v in out.items()}


def write_random_checkpoint(path: Path, config: dict, seed: int = 0) -> Path:
    """A random Qwen3 checkpoint of any shape (``config``: config.json fields), no transformers."""
    from safetensors.torch import save_file

    full = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
        "attention_bias": False, "use_sliding_window": False, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "torch_dtype": "float32", **config,
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_tensors(full, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(full, indent=2) + "\n")
    return path


def write_demo_checkpoint(path: Path) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_tensors(DEMO_CONFIG), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(DEMO_CONFIG, indent=2) + "\n")
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": NUM_BYTE_TOKENS, "eos_token_id": EOS_TOKEN_ID}, indent=2) + "\n"
    )
    _write_tokenizer(path)
    (path / "README.txt").write_text(
        "qil embedded demo model: random weights, meaningless outputs. For smoke tests only.\n"
    )
    return path


# Qwen3's chat format, reduced: messages, the generation prompt and the enable_thinking switch.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


def _write_tokenizer(path: Path) -> bool:
    """A byte-level BPE tokenizer without merges (one token per byte), if ``tokenizers`` exists."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        return False
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: idx for idx, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": SPECIAL_TOKENS[2], "model_max_length": 2048, "chat_template": CHAT_TEMPLATE},
            indent=2,
        )
        + "\n"
    )
    return True


def _byte_of(ch: str) -> int:
    """The byte a GPT-2 byte-level character stands for."""
    table = _bytes_to_unicode()
    return {v: k for k, v in table.items()}[ch]


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))
