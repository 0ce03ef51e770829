"""Our Qwen3 dense forward over a flat batch of tokens from many requests.

One call computes every scheduled token of a step: tokens of different requests are
concatenated, each with its absolute position and KV slot; the step's attention metadata keeps
requests apart (``qil_worker.attention``). Logits are computed only for ``sample_indices``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker import cpu_memory
from qil_worker.config import Qwen3Config
from qil_worker.kv.cache import KVCache
from qil_worker.attention.backend import StepAttention
from qil_worker.model.dtypes import resolve_device, resolve_dtype
from qil_worker.model.layers import GatedMLP, QKNorm, RMSNorm, RotaryEmbedding, apply_rope
from qil_worker.model.linear import Linear, pack_and_release, packing_supported

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
        self.split = (q_size + kv_size, kv_size)  # queries and keys side by side, then values

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(cpu_memory.empty(shape, dtype, device), requires_grad=False)

        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.qkv = param(q_size + 2 * kv_size, c.hidden_size)  # q, k, v fused into one matmul
        self.qk_norm = QKNorm(c.head_dim, c.num_attention_heads, c.rms_norm_eps, dtype, device)
        self.o_proj = param(c.hidden_size, q_size)
        # On CUDA one wide matmul saves launches; on CPU the split matmuls are faster (measured:
        # fused [1024 x 6144] gate/up took 74-101 ms vs 2 x 34 ms split, 2 threads), so the fused
        # weights are used through contiguous row slices there.
        self.fused = device.type == "cuda" if fused is None else fused
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, dtype, device, fused=self.fused)
        qkv = self.qkv.data
        # CPU: queries and keys from one matmul (their rows are adjacent), values from another
        self.qkv_proj = [Linear(qkv)] if self.fused else [Linear(qkv[: q_size + kv_size]), Linear(qkv[q_size + kv_size :])]
        self.out_proj = Linear(self.o_proj.data)

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
            qk, v = self.qkv_proj[0](h).split(self.split, dim=-1)
        else:
            qk, v = (proj(h) for proj in self.qkv_proj)
        # query and key heads normed and rotated together, [T, Hq + Hkv, D]
        qk = apply_rope(self.qk_norm(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)), *rope)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        kv.write(self.index, attention.slot_mapping, k, v.view(tokens, self.num_kv_heads, self.head_dim))
        x = x + self.out_proj(attention.attend(q, kv, self.index))
        return x + self.mlp(self.post_attention_norm(x))

    def pack_weights(self) -> bool:
        """Pack the projections for oneDNN (see ``linear.py``) and release the plain parameters."""
        attention = pack_and_release([*self.qkv_proj, self.out_proj], [self.qkv, self.o_proj])
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
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(
                cpu_memory.empty((config.vocab_size, config.hidden_size), dtype, device),
                requires_grad=False,
            )
        )
        self.head = Linear(self.embed.data if self.lm_head is None else self.lm_head.data)
        self.rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, dtype, device
        )

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
    ) -> "Qwen3":
        """Load a Hugging Face Qwen3 directory strictly (see ``loader.load_weights``).

        ``device`` defaults to CPU; ``dtype`` to bfloat16 on CUDA and float32 elsewhere
        (``"auto"`` takes the checkpoint's own dtype). ``pack_weights``: on CPU, pack the
        weights for oneDNN after loading (``pack_weights()``); False keeps the plain parameters.
        ``fused_projections``: see ``Qwen3``.
        """
        from qil_worker.model.loader import load_weights, stored_dtype

        config = Qwen3Config.from_directory(path)
        device = resolve_device(device)
        checkpoint_dtype = config.torch_dtype
        if dtype == "auto" and checkpoint_dtype is None:  # as transformers: the stored tensors'
            checkpoint_dtype = stored_dtype(Path(path))
        model = cls(
            config, device=device, dtype=resolve_dtype(dtype, device, checkpoint_dtype),
            fused_projections=fused_projections,
        )
        load_weights(model, Path(path))
        if pack_weights:
            model.pack_weights()
        return model.eval()

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name → the (view of the) parameter it is loaded into."""
        c = self.config
        targets: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed.data, "model.norm.weight": self.norm.weight.data}
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head.data
        q_size, kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            qkv, gate_up = layer.qkv.data, layer.mlp.gate_up.data
            targets.update(
                {
                    p + "input_layernorm.weight": layer.input_norm.weight.data,
                    p + "post_attention_layernorm.weight": layer.post_attention_norm.weight.data,
                    p + "self_attn.q_proj.weight": qkv[:q_size],
                    p + "self_attn.k_proj.weight": qkv[q_size : q_size + kv_size],
                    p + "self_attn.v_proj.weight": qkv[q_size + kv_size :],
                    p + "self_attn.q_norm.weight": layer.qk_norm.q_weight.data,
                    p + "self_attn.k_norm.weight": layer.qk_norm.k_weight.data,
                    p + "self_attn.o_proj.weight": layer.o_proj.data,
                    p + "mlp.gate_proj.weight": gate_up[: c.intermediate_size],
                    p + "mlp.up_proj.weight": gate_up[c.intermediate_size :],
                    p + "mlp.down_proj.weight": layer.mlp.down.data,
                }
            )
        return targets

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: StepAttention,
        kv: KVCache,
        sample_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Compute all ``input_ids`` [T] and return logits [S, vocab] at ``sample_indices`` [S]."""
        hidden = self.hidden_states(input_ids, positions, attention, kv)
        return self.logits(hidden.index_select(0, sample_indices))

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
        """Final norm and LM head for the rows that are sampled: [S, hidden] → [S, vocab]."""
        return self.head(self.norm(hidden))

    def pack_weights(self) -> int:
        """Pack every projection and the LM head for oneDNN (CPU; see ``linear.py``), releasing
        the plain parameters; → how many layers were packed (0 where unsupported).

        Call after loading: ``weight_targets`` no longer applies. A tied LM head is packed as a
        copy (the embedding table stays for lookups) — one more vocab x hidden matrix of memory,
        for an LM head ~1.5x (bf16) to 2x (float32) faster at decode sizes.
        """
        if not packing_supported(self.device, self.dtype):
            return 0
        start = time.perf_counter()
        packed = sum(layer.pack_weights() for layer in self.layers)
        if self.lm_head is None:
            head = self.head.pack(keep_plain=True)
        else:
            head = pack_and_release([self.head], [self.lm_head])
        log.info("weights packed for oneDNN: %d/%d layers, LM head %s (%.1f s)",
                 packed, len(self.layers), "yes" if head else "no", time.perf_counter() - start)
        return packed
