"""Qwen3 ``config.json`` → a typed, validated config.

Two architectures are accepted: dense Qwen3 (``model_type: qwen3``) and Qwen3-MoE
(``qwen3_moe``: sparse MLP blocks of routed experts, no shared expert). Anything we would
silently compute wrong (another model type, non-default RoPE scaling, sliding windows, attention
biases) is rejected with an error that names the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qil_worker.errors import ConfigError

# model_type → the transformers class its checkpoints are written by
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES.values())

_REQUIRED_INT_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


@dataclass(frozen=True)
class Fp8Quantization:
    """``quantization_config`` of an official FP8 checkpoint (transformers' fine-grained FP8):
    the decoder's linear weights stored as ``float8_e4m3fn`` with one ``weight_scale_inv`` per
    ``block_size`` block, activations quantized dynamically (per token) when computed in FP8."""

    block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()


@dataclass(frozen=True)
class AwqQuantization:
    """``quantization_config`` of an AutoAWQ GEMM checkpoint: the decoder's linear layers as
    4-bit codes with a zero point and an fp16 scale per ``group_size`` inputs
    (``model/awq.py``); ``modules_to_not_convert`` stay in a float dtype."""

    group_size: int = 128
    modules_to_not_convert: tuple[str, ...] = ()


@dataclass(frozen=True)
class GptqQuantization:
    """``quantization_config`` of a GPTQ checkpoint (AutoGPTQ / optimum, v1 ``gptq`` format,
    no act-order): the decoder's linear layers as 4-bit codes with a zero point and an fp16
    scale per ``group_size`` inputs (``model/gptq.py``); ``sym``: whether the zeros are all 8
    (recorded; the stored zeros are used either way)."""

    group_size: int = 128
    sym: bool = True
    modules_to_not_convert: tuple[str, ...] = ()


Quantization = Fp8Quantization | AwqQuantization | GptqQuantization
# the linears a GPTQ ``modules_in_block_to_quantize`` must list (qil quantizes all or them)
GPTQ_BLOCK_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# What transformers' FineGrainedFP8Config assumes where the checkpoint is silent.
_FP8_DEFAULTS = {"fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "float"}
FP8_BLOCK_SIZE = (128, 128)
# What qil computes of AutoAWQ's formats (absent zero_point: AwqConfig's default, true).
_AWQ_SUPPORTED = {"bits": 4, "zero_point": True, "version": "gemm"}


def _quantization(raw: Any) -> Quantization | None:
    """Validate ``quantization_config`` (None when absent): Qwen's FP8 scheme, AutoAWQ's 4-bit
    GEMM, or GPTQ 4-bit without act-order."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"quantization_config: expected an object, got {raw!r}")
    method = raw.get("quant_method")
    if method in ("awq", "gptq"):
        return awq_quantization(raw) if method == "awq" else gptq_quantization(raw)
    if method != "fp8":
        raise ConfigError(
            f"quantization_config.quant_method: {method!r} is not supported; qil loads "
            "'fp8' (block-wise float8_e4m3fn), 'awq' (AutoAWQ 4-bit GEMM) and 'gptq' (4-bit, no "
            "act-order) checkpoints and unquantized ones"
        )
    for field, supported in _FP8_DEFAULTS.items():
        value = raw.get(field, supported)
        if value != supported:
            raise ConfigError(
                f"quantization_config.{field}: {value!r} is not supported (only {supported!r})"
            )
    block = raw.get("weight_block_size", list(FP8_BLOCK_SIZE))
    if not isinstance(block, (list, tuple)) or tuple(block) != FP8_BLOCK_SIZE:
        raise ConfigError(
            f"quantization_config.weight_block_size: {block!r} is not supported (only "
            f"{list(FP8_BLOCK_SIZE)}: one scale per 128x128 block)"
        )
    if raw.get("modules_to_convert"):  # FP8 embedding tables
        raise ConfigError(
            f"quantization_config.modules_to_convert: {raw['modules_to_convert']!r} is not "
            "supported (only the decoder's linear layers may be FP8)"
        )
    return Fp8Quantization(block_size=FP8_BLOCK_SIZE, modules_to_not_convert=_modules_to_not_convert(raw))


def awq_quantization(raw: dict[str, Any]) -> AwqQuantization:
    """An AutoAWQ ``quantization_config``: 4-bit GEMM with zero points and a positive group
    size, else a ``ConfigError`` naming the key. transformers 5 writes the packing as
    ``format``, AutoAWQ as ``version``: either is read, and both must agree."""
    version, fmt = raw.get("version"), raw.get("format")
    if version is not None and fmt is not None and str(version).lower() != str(fmt).lower():
        raise ConfigError(
            f"quantization_config.format: {fmt!r} disagrees with version {version!r}; they are "
            "two spellings of the AWQ packing"
        )
    for key, want in _AWQ_SUPPORTED.items():
        name = "format" if key == "version" and version is None and fmt is not None else key
        stated = raw.get(name)
        value = want if key == "zero_point" and stated is None else stated
        if isinstance(value, str):
            value = value.lower()
        if value != want or isinstance(value, bool) != isinstance(want, bool):
            raise ConfigError(
                f"quantization_config.{name}: {stated!r} is not supported for awq (only {want!r})"
            )
    group = raw.get("group_size")
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise ConfigError(
            f"quantization_config.group_size: {group!r} is not supported for awq (a positive "
            "integer; -1, one group per column, is not)"
        )
    return AwqQuantization(group_size=group, modules_to_not_convert=_modules_to_not_convert(raw))


def gptq_quantization(raw: dict[str, Any]) -> GptqQuantization:
    """A GPTQ ``quantization_config``: 4 bits, no act-order (``desc_act: false``), the v1
    ``gptq`` checkpoint format, a positive group size, the LM head and every decoder linear as
    in AutoGPTQ's defaults; else a ``ConfigError`` naming the key."""
    def refuse(key: str, why: str) -> ConfigError:
        return ConfigError(f"quantization_config.{key}: {raw.get(key)!r} is not supported for gptq ({why})")

    if raw.get("bits") != 4 or isinstance(raw.get("bits"), bool):
        raise refuse("bits", "only 4")
    if raw.get("desc_act", False) is not False:
        raise refuse("desc_act", "only false: act-order checkpoints permute the groups")
    sym = raw.get("sym", True)
    if not isinstance(sym, bool):
        raise refuse("sym", "true or false")
    group = raw.get("group_size")
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0:
        raise refuse("group_size", "a positive integer; -1, one group per column, is not")
    formats = {key: raw[key] for key in ("checkpoint_format", "format") if raw.get(key) is not None}
    for key, value in formats.items():
        if not isinstance(value, str) or value.lower() != "gptq":
            raise refuse(key, "only 'gptq', the v1 layout with zeros stored minus one")
    if raw.get("pack_dtype", "int32") != "int32":
        raise refuse("pack_dtype", "only 'int32'")
    if raw.get("lm_head", False) is not False:
        raise refuse("lm_head", "the LM head is loaded unquantized only")
    if raw.get("dynamic"):
        raise refuse("dynamic", "per-module overrides are not read")
    blocks = raw.get("modules_in_block_to_quantize")
    if blocks is not None:
        listed = {name for group_names in blocks for name in group_names} \
            if isinstance(blocks, list) and all(isinstance(b, list) and all(isinstance(n, str) for n in b)
                                                for b in blocks) else set()
        if not set(GPTQ_BLOCK_MODULES) <= listed:
            raise refuse("modules_in_block_to_quantize", f"it must list all of {list(GPTQ_BLOCK_MODULES)}")
    return GptqQuantization(group_size=group, sym=sym, modules_to_not_convert=_modules_to_not_convert(raw))


def _modules_to_not_convert(raw: dict[str, Any]) -> tuple[str, ...]:
    """The module patterns a quantized checkpoint keeps unquantized, validated."""
    skip = raw.get("modules_to_not_convert")
    if skip is None:  # MiniMax's spelling, which transformers accepts too
        skip = raw.get("ignored_layers")
    skip = [] if skip is None else skip
    if not isinstance(skip, list) or not all(isinstance(name, str) for name in skip):
        raise ConfigError(
            f"quantization_config.modules_to_not_convert: expected a list of module names, got {skip!r}"
        )
    for pattern in skip:  # transformers matches them as regular expressions too
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(
                f"quantization_config.modules_to_not_convert: {pattern!r} is not a valid pattern ({exc})"
            ) from None
    return tuple(skip)


# Where config.json is silent, transformers' Qwen3Config defaults decide what the weights mean.
DEFAULT_ROPE_THETA = 10_000.0
DEFAULT_HEAD_DIM = 128
# ... and for qwen3_moe, transformers' Qwen3MoeConfig's (its head_dim: hidden / heads).
MOE_DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                "decoder_sparse_step": 1, "max_position_embeddings": 32768}


@dataclass(frozen=True)
class ParameterCount:
    """Weights of the model, and of them those one token's forward reads (``active``: every
    routed expert but its top-k left out; embedding and LM head included, as Qwen counts the
    "A3B" of Qwen3-30B-A3B)."""

    total: int
    active: int


@dataclass(frozen=True)
class Qwen3Config:
    """The hyper-parameters the forward needs, with Qwen3's meaning of each (``architecture``:
    "qwen3" or "qwen3_moe", the config's ``model_type``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    quantization: Quantization | None = None
    # Qwen3-MoE (architecture "qwen3_moe"); a dense model has no experts
    architecture: str = "qwen3"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # an embedding model loaded without its (absent) LM head: ``embedding_checkpoint.detect``
    headless: bool = False

    @property
    def num_query_groups(self) -> int:
        """Query heads that share one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def is_moe(self) -> bool:
        return self.architecture == "qwen3_moe"

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer ``index``'s MLP is routed experts (else a dense MLP of
        ``intermediate_size``), by transformers' rule."""
        return (
            self.is_moe and index not in self.mlp_only_layers and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_sparse_layer(i))

    def parameter_count(self) -> ParameterCount:
        """Total and per-token active weights (see ``ParameterCount``), from the shapes alone."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads) + 2 * h + 2 * d
        dense_mlp = 3 * h * self.intermediate_size
        expert = 3 * h * self.moe_intermediate_size
        router = self.num_experts * h
        sparse = len(self.sparse_layers)
        dense = self.num_hidden_layers - sparse
        outer = self.vocab_size * h * (1 if self.tie_word_embeddings or self.headless else 2) + h
        shared = outer + self.num_hidden_layers * attention + dense * dense_mlp + sparse * router
        return ParameterCount(
            total=shared + sparse * self.num_experts * expert,
            active=shared + sparse * self.num_experts_per_tok * expert,
        )

    def describe(self) -> str:
        """One line for the start-up log: the architecture and its weights, total and per token."""
        count = self.parameter_count()
        text = f"{self.architecture}: {self.num_hidden_layers} layers"
        if self.is_moe:
            text += (f" ({len(self.sparse_layers)} sparse: {self.num_experts} experts, "
                     f"top-{self.num_experts_per_tok}, expert width {self.moe_intermediate_size}"
                     f"{', top-k renormalised' if self.norm_topk_prob else ''})")
        return f"{text}; {_count(count.total)} parameters, {_count(count.active)} active per token"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Qwen3Config":
        """Validate a parsed config.json (Transformers 4.x or 5.x spelling)."""
        model_type = raw.get("model_type")
        if model_type not in ARCHITECTURES:
            raise ConfigError(
                f"model_type: expected 'qwen3' (dense Qwen3) or 'qwen3_moe' (Qwen3-MoE), got "
                f"{model_type!r}; qil only serves Qwen3 text models"
            )
        architectures = raw.get("architectures")
        if architectures is not None and ARCHITECTURES[model_type] not in architectures:
            raise ConfigError(
                f"architectures: expected {[ARCHITECTURES[model_type]]} for model_type "
                f"{model_type!r}, got {architectures!r}"
            )
        for name in _REQUIRED_INT_FIELDS:
            _positive_int(raw, name)
        heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]
        if heads % kv_heads:
            raise ConfigError(
                f"num_key_value_heads: {kv_heads} does not divide num_attention_heads {heads}"
            )
        moe = model_type == "qwen3_moe"
        # transformers' Qwen3MoeConfig has no head_dim default: its attention takes hidden / heads
        head_dim = raw.get("head_dim", raw["hidden_size"] // heads if moe else DEFAULT_HEAD_DIM)
        if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"head_dim: expected a positive even integer, got {head_dim!r}")
        if raw.get("attention_bias"):
            raise ConfigError("attention_bias: Qwen3 dense models have no attention bias; got true")
        if raw.get("use_sliding_window"):
            raise ConfigError("use_sliding_window: sliding-window attention is not supported")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act: only 'silu' is supported, got {act!r}")
        experts = _experts(raw) if moe else {}
        default_positions = MOE_DEFAULTS["max_position_embeddings"] if moe else 40960
        return cls(
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=_positive_number(raw, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=_positive_int(raw, "max_position_embeddings", default_positions),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            quantization=_quantization(raw.get("quantization_config")),
            architecture=model_type,
            **experts,
        )

    @classmethod
    def from_directory(cls, path: str | Path) -> "Qwen3Config":
        """Read ``config.json`` from a model directory, with the EOS ids of its
        ``generation_config.json`` added (see ``_generation_eos_ids``)."""
        config_path = Path(path) / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{config_path}: no config.json in the model directory") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{config_path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{config_path}: expected a JSON object")
        config = cls.from_dict(raw)
        extra = [i for i in _generation_eos_ids(Path(path)) if i not in config.eos_token_ids]
        return replace(config, eos_token_ids=config.eos_token_ids + tuple(extra))


def _experts(raw: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3-MoE fields, validated; transformers' Qwen3MoeConfig defaults where silent.
    ``router_aux_loss_coef`` and ``output_router_logits`` only matter to training: ignored."""
    both = "num_experts" in raw and "num_local_experts" in raw
    if both and raw["num_experts"] != raw["num_local_experts"]:
        # transformers >= 5 writes num_local_experts and maps num_experts onto it; which one a
        # reader takes differs between versions, so a file that says both must say one thing
        raise ConfigError(
            f"num_experts ({raw['num_experts']!r}) and num_local_experts ({raw['num_local_experts']!r}) "
            "disagree; they are two spellings of the expert count"
        )
    name = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    num_experts = _positive_int(raw, name, MOE_DEFAULTS["num_experts"])
    top_k = _positive_int(raw, "num_experts_per_tok", MOE_DEFAULTS["num_experts_per_tok"])
    if top_k > num_experts:
        raise ConfigError(f"num_experts_per_tok: {top_k} is more than the {num_experts} experts")
    norm_topk_prob = raw.get("norm_topk_prob", False)
    if not isinstance(norm_topk_prob, bool):
        raise ConfigError(f"norm_topk_prob: expected true or false, got {norm_topk_prob!r}")
    layers = raw["num_hidden_layers"]
    mlp_only = raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in mlp_only
    ):
        raise ConfigError(
            f"mlp_only_layers: expected a list of layer indices in [0, {layers}), got {mlp_only!r}"
        )
    if raw.get("shared_expert_intermediate_size"):  # Qwen2-MoE's shared expert: not in Qwen3-MoE
        raise ConfigError("shared_expert_intermediate_size: Qwen3-MoE has no shared expert")
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_positive_int(raw, "moe_intermediate_size", MOE_DEFAULTS["moe_intermediate_size"]),
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=_positive_int(raw, "decoder_sparse_step", MOE_DEFAULTS["decoder_sparse_step"]),
        mlp_only_layers=tuple(sorted(set(mlp_only))),
    )


def _rope_theta(raw: dict[str, Any]) -> float:
    """RoPE base, read where transformers reads it: from ``rope_scaling`` (4.x) when that is a
    non-empty object, else from ``rope_parameters`` (5.x), else the top-level ``rope_theta``.
    Any scaled RoPE, in either field, is refused."""
    chosen: dict[str, Any] = {}
    for field in ("rope_scaling", "rope_parameters"):
        params = raw.get(field)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ConfigError(f"{field}: expected an object or null, got {params!r}")
        if any(isinstance(v, dict) for v in params.values()):
            raise ConfigError(f"{field}: RoPE parameters per layer type are not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(
                f"{field}: rope_type {rope_type!r} is not supported (only the default RoPE)"
            )
        if params and not chosen:
            chosen = params
    if "rope_theta" in chosen:
        return _positive_number(chosen, "rope_theta", DEFAULT_ROPE_THETA)
    # transformers' Qwen3Config default (every released Qwen3 config states its own, 1e6)
    return _positive_number(raw, "rope_theta", DEFAULT_ROPE_THETA)


def _positive_int(raw: dict[str, Any], name: str, default: int | None = None) -> int:
    """``raw[name]`` (``default`` when absent; None: required) as a positive int, or a ConfigError."""
    value = raw.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}: expected a positive integer, got {value!r}")
    return value


def _positive_number(raw: dict[str, Any], name: str, default: float) -> float:
    """``raw[name]`` (``default`` when absent) as a positive finite float, or a ConfigError."""
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{name}: expected a positive number, got {value!r}")
    return float(value)


def _eos_ids(value: Any, source: str = "eos_token_id") -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{source}: expected an int or a list of ints, got {value!r}")
    return tuple(values)


def _generation_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """``eos_token_id`` of ``generation_config.json`` (none if the file is absent).

    transformers' ``generate`` stops at these, and Qwen3 checkpoints list more there than in
    ``config.json`` (the instruct models: ``<|im_end|>`` in both, ``<|endoftext|>`` only here)."""
    path = model_dir / "generation_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return ()
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return _eos_ids(raw.get("eos_token_id"), f"{path.name}: eos_token_id")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 10**8 else f"{n / 1e6:.2f}M"
