"""Our Qwen3 dense forward over a flat batch of tokens from many requests.

One call computes every scheduled token of a step: tokens of different requests are
concatenated, each with its absolute position and KV slot; the step's attention metadata keeps
requests apart (``qil_worker.attention``). Logits are computed only for ``logit_indices``: the
sampled positions, and the prompt positions of requests that asked for prompt logprobs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker import cpu_memory
from qil_worker.attention.backend import StepAttention
from qil_worker.config import Qwen3Config
from qil_worker.errors import ConfigError
from qil_worker.kv.cache import KVCache
from qil_worker.model.dtypes import resolve_device, resolve_dtype
from qil_worker.model.layers import GatedMLP, QKNorm, RMSNorm, RotaryEmbedding, apply_rope
from qil_worker.model.linear import Linear, pack_all, packing_supported
from qil_worker.model.weight_quantization import projection_modules, quantize_projections, weight_summary
from qil_worker.quantization import resolve_quantize

log = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    """Pre-norm attention block and MLP block, each with a residual."""

    def __init__(
        self, index: int, config: Qwen3Config, dtype: torch.dtype, device: torch.device,
        fused: bool | None = None,
    ) -> None:
        super().__init__()
        c = config
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_size = q_size
        self.split = (q_size + kv_size, kv_size)  # queries and keys side by side, then values
        # On CUDA one wide matmul saves launches; on CPU split matmuls are faster, so there
        # queries and keys come from one projection (their rows are adjacent), values from another.
        self.fused = device.type == "cuda" if fused is None else fused
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        if self.fused:
            self.qkv_proj = Linear(q_size + 2 * kv_size, c.hidden_size, dtype, device)
        else:
            self.qk_proj = Linear(q_size + kv_size, c.hidden_size, dtype, device)
            self.v_proj = Linear(kv_size, c.hidden_size, dtype, device)
        self.qk_norm = QKNorm(c.head_dim, c.num_attention_heads, c.rms_norm_eps, dtype, device)
        self.o_proj = Linear(c.hidden_size, q_size, dtype, device)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, dtype, device, fused=self.fused)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attention: StepAttention,
        kv: KVCache,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        h = self.input_norm(x)
        if self.fused:
            qk, v = self.qkv_proj(h).split(self.split, dim=-1)
        else:
            qk, v = self.qk_proj(h), self.v_proj(h)
        # query and key heads normed and rotated together, [T, Hq + Hkv, D]
        qk = apply_rope(self.qk_norm(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)), *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        kv.write(self.index, attention.slot_mapping, k, v.view(tokens, self.num_kv_heads, self.head_dim))
        x = x + self.o_proj(attention.attend(q, kv, self.index))
        return x + self.mlp(self.post_attention_norm(x))

    def projections(self) -> list[Linear]:
        return [self.qkv_proj] if self.fused else [self.qk_proj, self.v_proj]

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name → the (view of the) weight it is loaded into."""
        q, kv = self.q_size, self.split[1]
        if self.fused:
            qkv = self.qkv_proj.weight.data
            q_w, k_w, v_w = qkv[:q], qkv[q : q + kv], qkv[q + kv :]
        else:
            qk = self.qk_proj.weight.data
            q_w, k_w, v_w = qk[:q], qk[q:], self.v_proj.weight.data
        return {
            prefix + "input_layernorm.weight": self.input_norm.weight.data,
            prefix + "post_attention_layernorm.weight": self.post_attention_norm.weight.data,
            prefix + "self_attn.q_proj.weight": q_w,
            prefix + "self_attn.k_proj.weight": k_w,
            prefix + "self_attn.v_proj.weight": v_w,
            prefix + "self_attn.q_norm.weight": self.qk_norm.q_weight.data,
            prefix + "self_attn.k_norm.weight": self.qk_norm.k_weight.data,
            prefix + "self_attn.o_proj.weight": self.o_proj.weight.data,
            **self.mlp.weight_targets(prefix + "mlp."),
        }

    def pack_weights(self) -> bool:
        """Pack the projections for oneDNN (see ``linear.py``): the attention's all or none, the
        MLP's all or none."""
        attention = pack_all([*self.projections(), self.o_proj])
        return self.mlp.pack_weights() and attention


class Qwen3(nn.Module):
    """Qwen3 dense causal LM: embedding, decoder layers, final norm, tied or untied LM head."""

    def __init__(
        self, config: Qwen3Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
        fused_projections: bool | None = None,
    ) -> None:
        """``fused_projections``: one matmul for q/k/v and one for gate/up (default: on CUDA
        only, where it saves launches; True elsewhere runs the CUDA wiring, for tests)."""
        super().__init__()
        self.config = config
        device = torch.device(device)
        self.embed = nn.Parameter(
            cpu_memory.empty((config.vocab_size, config.hidden_size), dtype, device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(i, config, dtype, device, fused_projections) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        # tied: the LM head is the embedding table itself (until packing gives it its own copy)
        self.head = Linear(
            config.vocab_size, config.hidden_size, dtype, device,
            weight=self.embed if config.tie_word_embeddings else None,
        )
        self.rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, dtype, device
        )

    @property
    def lm_head(self) -> torch.Tensor | None:
        """The untied LM head's weight (None when the head is the embedding table)."""
        return None if self.config.tie_word_embeddings else self.head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @classmethod
    def from_directory(
        cls,
        path: str | Path,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        pack_weights: bool = True,
        fused_projections: bool | None = None,
        fp8: str = "auto",
        quantize: str | None = None,
    ) -> "Qwen3":
        """Load a Hugging Face Qwen3 directory strictly (see ``loader.load_weights``).

        ``device`` defaults to CPU; ``dtype`` to bfloat16 on CUDA and float32 elsewhere
        (``"auto"`` takes the checkpoint's own dtype). ``pack_weights``: on CPU, pack the
        weights for oneDNN after loading (``pack_weights()``); False keeps the plain parameters.
        ``fused_projections``: see ``Qwen3``. ``fp8`` (FP8 checkpoints only): ``"auto"`` keeps
        the FP8 weights and runs block-scaled FP8 matmuls where the device runs them right
        (``fp8_linear.py``), else dequantizes to ``dtype`` at load; ``"dequantize"`` always does.
        ``quantize``: None (or "none") keeps the weights in the compute dtype; "int8" quantizes
        them at load (``quantize_weights``), before packing — an FP8 checkpoint is then
        dequantized first, whatever ``fp8`` says.
        """
        from qil_worker.model import fp8_linear
        from qil_worker.model.loader import load_weights, stored_dtype

        if fp8 not in ("auto", "dequantize"):
            raise ConfigError(f"fp8: expected 'auto' or 'dequantize', got {fp8!r}")

        config = Qwen3Config.from_directory(path)
        quantize = resolve_quantize(quantize)
        device = resolve_device(device)
        checkpoint_dtype = config.torch_dtype
        if dtype == "auto" and checkpoint_dtype is None:  # as transformers: the stored tensors'
            checkpoint_dtype = stored_dtype(Path(path))
        model = cls(
            config, device=device, dtype=resolve_dtype(dtype, device, checkpoint_dtype),
            fused_projections=fused_projections,
        )
        keep_fp8 = config.quantization is not None and fp8 == "auto" and quantize is None
        kernels = fp8_linear.cuda_kernels(device) if keep_fp8 else []
        kept: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = {} if kernels else None
        load_weights(model, Path(path), keep_fp8=kept)
        summary = fp8_linear.use_fp8(model, kept, kernels) if kept is not None else None
        if quantize is not None:
            model.quantize_weights(quantize)
        if pack_weights:
            model.pack_weights()
        if config.quantization is not None:
            log.info("%s", fp8_linear.describe(model, summary))
        return model.eval()

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name → the (view of the) parameter it is loaded into."""
        targets: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed.data, "model.norm.weight": self.norm.weight.data}
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head.data
        for i, layer in enumerate(self.layers):
            targets.update(layer.weight_targets(f"model.layers.{i}."))
        return targets

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: StepAttention,
        kv: KVCache,
        logit_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Compute all ``input_ids`` [T] and return logits [L, vocab] at ``logit_indices`` [L],
        one LM-head call for all of them."""
        hidden = self.hidden_states(input_ids, positions, attention, kv)
        return self.logits(hidden.index_select(0, logit_indices))

    @torch.inference_mode()
    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: StepAttention, kv: KVCache
    ) -> torch.Tensor:
        """The decoder stack: [T] tokens → [T, hidden] before the final norm (writes their K/V).

        Split from ``logits`` so a captured CUDA graph can stop here and keep its output small.
        """
        x = F.embedding(input_ids, self.embed)
        rope = self.rope.lookup(positions)
        for layer in self.layers:
            x = layer(x, rope, attention, kv)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the rows that need logits: [L, hidden] → [L, vocab]."""
        return self.head(self.norm(hidden))

    def pack_weights(self) -> int:
        """Pack every projection and the LM head for oneDNN (CPU; see ``linear.py``): each
        ``Linear`` then holds only its packed weight; → how many layers were packed (0 where
        unsupported).

        One explicit step after loading (``from_directory`` takes it): ``weight_targets`` no
        longer applies. A tied LM head is packed as a copy (the embedding table stays for
        lookups) — one more vocab x hidden matrix of memory, for a markedly faster LM head at
        decode sizes.
        """
        if not packing_supported(self.device, self.dtype):
            return 0
        start = time.perf_counter()
        # only layers of plain ``Linear``s: quantized projections run on their own kernels
        plain = [layer for layer in self.layers if all(type(m) is Linear for m in projection_modules(layer))]
        packed = sum(layer.pack_weights() for layer in plain)
        head = type(self.head) is Linear and self.head.pack()
        log.info("weights packed for oneDNN: %d/%d layers, LM head %s (%.1f s)",
                 packed, len(self.layers), "yes" if head else "no", time.perf_counter() - start)
        return packed

    def quantize_weights(self, method: str = "int8", head: bool | None = None) -> int:
        """Quantize every plain projection (and the LM head unless ``head`` is False) with
        ``method`` (``QUANTIZE_CHOICES``; see ``weight_quantization.py``), in place of oneDNN
        packing for them; → how many projections were quantized. One explicit step after
        loading (``from_directory(quantize=...)`` takes it); the unquantized weights are freed
        (a tied head's embedding table stays, for lookups)."""
        return quantize_projections(self, method, head)

    def weight_summary(self) -> tuple[str, int]:
        """(the formats the weights run in, the bytes every weight holds: projections with their
        scales, embedding, norms; a tensor shared by two places counted once)."""
        return weight_summary(self)

