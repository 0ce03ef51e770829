"""Small random Qwen3 checkpoints written by transformers: the reference our tests compare to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    eos_token_id=None,
)


def make_checkpoint(
    path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Save a random ``Qwen3ForCausalLM`` (float32) to ``path`` and return it.

    ``max_shard_size`` (e.g. ``"20KB"``) makes transformers write several shards and an index.
    Weights are re-drawn with a larger spread than the default init so that logits differ
    clearly between tokens and greedy choices are not decided by rounding.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**{**TINY_CONFIG, **overrides})
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return Path(path)


def load_reference(path: Path, dtype: torch.dtype = torch.float32):
    """The transformers model for a checkpoint directory, in eval mode."""
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=dtype).eval()


QWEN_STYLE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
CORPUS = [
    "hello world, qil serves qwen3 models over grpc.",
    "the quick brown fox jumps over the lazy dog " * 3,
    "héllo wörld — ünïcödé text, 中文字符, emoji 🙂🚀 and more",
    "stop here STOP there. end of line\n",
]


def make_tokenizer(path: Path, vocab_size: int = 300):
    """A small byte-level BPE (trained locally) with Qwen-style special tokens and chat template.

    Byte-level, so characters outside its merges (CJK, emoji) span several tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = QWEN_STYLE_CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


def make_text_checkpoint(path: Path, seed: int = 5, **overrides: Any) -> Path:
    """A random checkpoint whose vocabulary is a local tokenizer's (EOS = <|im_end|>);
    ``overrides``: further config values (``max_position_embeddings``...)."""
    tokenizer = make_tokenizer(path)
    make_checkpoint(path, seed=seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides)
    return Path(path)


FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_fp8_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] → (float8_e4m3fn weight, float32 ``weight_scale_inv`` [ceil(out/128),
    ceil(in/128)]) as transformers' ``Fp8Quantize`` computes them (scale = 448 / block amax, the
    stored inverse its reciprocal), with ragged edge blocks where a dimension is not a multiple
    of 128 (the grid transformers' ``FP8Linear`` allocates)."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    padded = torch.zeros(grid[0] * block, grid[1] * block, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(grid[0], block, grid[1], block)
    amax = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, fp8_max / torch.where(amax > 0, amax, 1.0), 1.0)
    quantized = (tiles * scales[:, None, :, None]).clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)
    quantized = quantized.view(grid[0] * block, grid[1] * block)[:rows, :cols].contiguous()
    return quantized, (1.0 / scales).to(torch.float32)


def make_fp8_checkpoint(
    path: Path, seed: int = 0, shards: int = 1, modules_to_not_convert: list[str] | None = None,
    **overrides: Any,
) -> Path:
    """A random Qwen3 checkpoint in the layout of Qwen's official FP8 releases: the decoder's
    linear weights float8_e4m3fn with a float32 ``weight_scale_inv`` per 128x128 block,
    everything else (embedding, norms, LM head) bfloat16, and config.json's
    ``quantization_config``. Modules matching ``modules_to_not_convert`` (a suffix, as in
    transformers) stay bfloat16. ``shards`` > 1 spreads the tensors over several files with an
    index, a weight and its scale in different files."""
    import json

    from safetensors.torch import load_file, save_file

    make_checkpoint(path, seed=seed, **overrides)
    path = Path(path)
    skip = modules_to_not_convert or []
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in FP8_LINEARS and not any(module.endswith(s) for s in skip):
            tensors[name], tensors[module + ".weight_scale_inv"] = quantize_fp8_blocks(tensor)
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    (path / "model.safetensors").unlink()
    if shards == 1:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    else:
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        weight_map = {name: files[i % shards] for i, name in enumerate(sorted(tensors))}
        for file in files:
            part = {n: t for n, t in tensors.items() if weight_map[n] == file}
            save_file(part, path / file, metadata={"format": "pt"})
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128],
        **({"modules_to_not_convert": skip} if skip else {}),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


MOE_TINY_CONFIG: dict[str, Any] = dict(
    TINY_CONFIG,
    num_hidden_layers=3,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    mlp_only_layers=[0],
    decoder_sparse_step=1,
    norm_topk_prob=False,
)
# The routers' spread: logits a few units apart, so top-k choices are decided by the weights and
# not by the rounding in which qil and transformers differ.
ROUTER_STD = 0.6


def make_moe_checkpoint(
    path: Path, seed: int = 0, max_shard_size: str | None = None, expert_count_key: str = "num_local_experts",
    **overrides: Any,
) -> Path:
    """Save a random ``Qwen3MoeForCausalLM`` (float32) to ``path`` and return it: 8 experts,
    top-2, layer 0 a dense MLP (``MOE_TINY_CONFIG``), weights drawn as ``make_checkpoint`` does
    and the routers wider (``ROUTER_STD``). ``expert_count_key``: the spelling config.json
    gets, transformers 5's ``num_local_experts`` or the official checkpoints' ``num_experts``."""
    import json

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**MOE_TINY_CONFIG, **overrides})
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, ROUTER_STD if name.endswith("mlp.gate.weight") else 0.15)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    path = Path(path)
    if expert_count_key != "num_local_experts":
        raw = json.loads((path / "config.json").read_text())
        raw[expert_count_key] = raw.pop("num_local_experts")
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def load_moe_reference(path: Path, dtype: torch.dtype = torch.float32):
    """The transformers MoE model for a checkpoint directory, in eval mode."""
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype).eval()


def make_fp8_moe_checkpoint(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random Qwen3-MoE checkpoint in the layout of Qwen3-30B-A3B-FP8: every attention, dense
    MLP and expert projection float8_e4m3fn with a float32 ``weight_scale_inv`` per 128x128
    block; the routers (``mlp.gate``, listed in ``modules_to_not_convert`` as there, with
    ``lm_head``), norms, embedding and LM head bfloat16."""
    import json

    from safetensors.torch import load_file, save_file

    make_moe_checkpoint(path, seed=seed, **overrides)
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(path / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if module.split(".")[-1] in FP8_LINEARS:
            tensors[name], tensors[module + ".weight_scale_inv"] = quantize_fp8_blocks(tensor)
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    routers = sorted({name.removesuffix(".weight") for name in tensors if name.endswith("mlp.gate.weight")})
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", *routers],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def make_judge_checkpoint(path: Path, seed: int = 3) -> Path:
    """A random checkpoint for embeddings and scores: its tokenizer appends <|endoftext|> to a
    sequence (as Qwen3-Embedding's does) and has the single tokens "yes" and "no" (as a Qwen3
    tokenizer has, which Qwen3-Reranker's scores read)."""
    from tokenizers import processors

    tok = make_tokenizer(path)
    tok.add_tokens(["yes", "no"])
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eos)]
    )
    tok.save_pretrained(path)
    make_checkpoint(path, seed=seed, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    return Path(path)


def make_headless_checkpoint(path: Path, seed: int = 6) -> Path:
    """A Qwen3-Embedding-shaped checkpoint (as the 4B/8B are stored): untied config, base-model
    names without ``model.``, no LM head."""
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(path, seed=seed, tie_word_embeddings=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file({name.removeprefix("model."): t for name, t in tensors.items()}, path / "model.safetensors")
    return path


def rewrite_checkpoint(src: Path, dst: Path, mutate) -> Path:
    """A copy of the single-file checkpoint ``src`` at ``dst`` with ``mutate(tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    mutate(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst
