"""Our Qwen3 forward (dense and MoE) over a flat batch of tokens from many requests.

One call computes every scheduled token of a step: tokens of different requests are
concatenated, each with its absolute position and KV slot; the step's attention metadata keeps
requests apart (``qil_worker.attention``). Logits are computed only for ``logit_indices``: the
sampled positions, and the prompt positions of requests that asked for prompt logprobs.

Qwen3-MoE is the same model but for the MLP of its sparse layers (``moe.SparseMoeBlock``), so one
class serves both architectures. Loading (which weights, FP8, int8, packing) is ``build.py``'s.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qil_worker import cpu_memory
from qil_worker.attention.backend import StepAttention
from qil_worker.config import Qwen3Config
from qil_worker.kv.cache import KVCache
from qil_worker.model.build import build_model
from qil_worker.model.compiled_decode import DecodeStep, compile_decode_step
from qil_worker.model.layers import GatedMLP, QKNorm, RMSNorm, RotaryEmbedding, apply_rope
from qil_worker.model.linear import Linear, pack_all
from qil_worker.model.moe import SparseMoeBlock
from qil_worker.model.packing import pack_model
from qil_worker.model.routed_experts import compiled_int8_experts
from qil_worker.model.weight_quantization import quantize_projections, weight_summary
from qil_worker.parallel import SINGLE, AttentionHeads, ParallelState, Shard
from qil_worker.parallel.shards import vocab_block, vocab_shard


class DecoderLayer(nn.Module):
    """Pre-norm attention block and MLP block (dense, or routed experts in a Qwen3-MoE sparse
    layer), each with a residual.

    Under tensor parallelism (``parallel`` sharded) the layer holds its rank's attention heads
    and MLP (or expert) width (``qil_worker.parallel.shards``); o and down are row-parallel, so
    the attention's and the MLP's outputs are each summed over the ranks by one all-reduce."""

    def __init__(
        self, index: int, config: Qwen3Config, dtype: torch.dtype, device: torch.device,
        fused: bool | None = None, parallel: ParallelState = SINGLE,
    ) -> None:
        super().__init__()
        c = config
        self.index = index
        self.parallel = parallel
        self.heads = AttentionHeads.of(c, parallel.rank, parallel.world_size)
        self.num_heads, self.num_kv_heads, self.head_dim = self.heads.q_heads, self.heads.kv_heads, c.head_dim
        self.config_kv_heads = c.num_key_value_heads
        q_size, kv_size = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
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
        self.qk_norm = QKNorm(c.head_dim, self.num_heads, c.rms_norm_eps, dtype, device)
        self.o_proj = Linear(c.hidden_size, q_size, dtype, device)
        self.post_attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp: GatedMLP | SparseMoeBlock
        if c.is_sparse_layer(index):  # the fused (CUDA) wiring runs the experts grouped too
            self.mlp = SparseMoeBlock(c, dtype, device, grouped=self.fused, world_size=parallel.world_size)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size // parallel.world_size, dtype, device,
                                fused=self.fused)
        # the sum of the row-parallel partial outputs; None on one device, where there is none
        self.reduce = parallel.all_reduce if parallel.sharded else None

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
        if self.reduce is None:
            x = x + self.o_proj(attention.attend(q, kv, self.index))
            return x + self.mlp(self.post_attention_norm(x))
        x = x + self.reduce(self.o_proj(attention.attend(q, kv, self.index)))
        return x + self.reduce(self.mlp(self.post_attention_norm(x)))

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

    def weight_shards(self, prefix: str) -> dict[str, Shard]:
        """Checkpoint tensor name → the slice of it this rank loads, for every split tensor
        (none on one device)."""
        p = self.parallel
        if not p.sharded:
            return {}
        h, d = self.heads, self.head_dim
        c_q, c_kv = h.q_heads * p.world_size * d, self.config_kv_heads * d
        q = Shard(0, h.first_q_head * d, (h.first_q_head + h.q_heads) * d, c_q)
        kv = Shard(0, h.first_kv_head * d, (h.first_kv_head + h.kv_heads) * d, c_kv)
        attn = prefix + "self_attn."
        return {
            attn + "q_proj.weight": q, attn + "k_proj.weight": kv, attn + "v_proj.weight": kv,
            attn + "o_proj.weight": Shard(1, q.start, q.stop, c_q),
            **self.mlp.weight_shards(prefix + "mlp.", p.rank, p.world_size),
        }

    def pack_weights(self) -> bool:
        """Pack the projections for oneDNN (see ``linear.py``): the attention's all or none, the
        MLP's all or none."""
        attention = pack_all([*self.projections(), self.o_proj])
        return self.mlp.pack_weights() and attention


class Qwen3(nn.Module):
    """Qwen3 causal LM, dense or MoE: embedding, decoder layers, final norm, tied or untied LM
    head.

    Under tensor parallelism (``parallel``) the embedding and the LM head are vocab-parallel:
    each rank holds a block of vocabulary rows; an embedding lookup is summed over the ranks,
    and the head's logits (of the sampled positions only) are gathered into the whole
    vocabulary on every rank."""

    def __init__(
        self, config: Qwen3Config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
        fused_projections: bool | None = None, parallel: ParallelState = SINGLE,
    ) -> None:
        """``fused_projections``: one matmul for q/k/v and one for gate/up (default: on CUDA
        only, where it saves launches; True elsewhere runs the CUDA wiring, for tests).
        ``parallel``: this rank's place in a tensor-parallel group (``qil_worker.parallel``;
        the sizes already checked by ``check_tp_size``)."""
        super().__init__()
        self.config = config
        self.parallel = parallel
        device = torch.device(device)
        self.vocab = vocab_shard(config.vocab_size, parallel.rank, parallel.world_size)
        rows = vocab_block(config.vocab_size, parallel.world_size)
        # the last rank's padding rows stay zero: their logits are cut off after the gather
        table = cpu_memory.zeros if parallel.sharded else cpu_memory.empty
        self.embed = nn.Parameter(table((rows, config.hidden_size), dtype, device), requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(i, config, dtype, device, fused_projections, parallel)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        # tied: the LM head is the embedding table itself (until packing gives it its own copy);
        # headless (an embedding model, which serves no generation): no head weights of its own
        shares = config.tie_word_embeddings or config.headless
        self.head = Linear(rows, config.hidden_size, dtype, device, weight=self.embed if shares else None)
        if parallel.sharded and not shares:
            self.head.weight.data.zero_()
        self.rope = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.max_position_embeddings, dtype, device
        )

    @property
    def lm_head(self) -> torch.Tensor | None:
        """The untied LM head's weight (None when the head is the embedding table, or there is
        none: a headless embedding model)."""
        return None if self.config.tie_word_embeddings or self.config.headless else self.head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def heads(self) -> AttentionHeads:
        """This rank's attention heads (all of them on one device): the KV cache's and the
        attention backend's shape."""
        return self.layers[0].heads

    @property
    def graph_capturable(self) -> bool:
        """Whether a forward can be captured in a CUDA graph: not where a MoE block runs its
        experts in a host loop (off CUDA, or no grouped kernel for this dtype or quantization),
        nor across tensor-parallel ranks (collectives are not captured)."""
        if self.parallel.sharded:
            return False
        return all(layer.mlp.capturable for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock))

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
        parallel: ParallelState = SINGLE,
        embedding: bool = False,
        compile: bool = True,
    ) -> "Qwen3":
        """Load a Hugging Face Qwen3 or Qwen3-MoE directory strictly: ``build.build_model``,
        whose docstring says what each argument does."""
        return build_model(cls, path, device=device, dtype=dtype, pack_weights=pack_weights,
                           fused_projections=fused_projections, fp8=fp8, quantize=quantize,
                           parallel=parallel, embedding=embedding, compile=compile)

    def weight_targets(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name → the (view of the) parameter it is loaded into (this rank's
        slice of it, ``weight_shards``, under tensor parallelism)."""
        rows = self.vocab.stop - self.vocab.start
        targets: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed.data[:rows],
                                            "model.norm.weight": self.norm.weight.data}
        if self.lm_head is not None:
            targets["lm_head.weight"] = self.lm_head.data[:rows]
        for i, layer in enumerate(self.layers):
            targets.update(layer.weight_targets(f"model.layers.{i}."))
        return targets

    def weight_shards(self) -> dict[str, Shard]:
        """Checkpoint tensor name → the slice of it this rank loads, for every tensor split
        across the ranks (none on one device; ``loader.load_weights`` reads only the slices)."""
        if not self.parallel.sharded:
            return {}
        shards = {"model.embed_tokens.weight": self.vocab}
        if self.lm_head is not None:
            shards["lm_head.weight"] = self.vocab
        for i, layer in enumerate(self.layers):
            shards.update(layer.weight_shards(f"model.layers.{i}."))
        return shards

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
        x = self.embed_sharded(input_ids) if self.parallel.sharded else F.embedding(input_ids, self.embed)
        rope = self.rope.lookup(positions)
        for layer in self.layers:
            x = layer(x, rope, attention, kv)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head for the rows that need logits: [L, hidden] → [L, vocab]
        (gathered from every rank's block of the vocabulary under tensor parallelism)."""
        logits = self.head(self.norm(hidden))
        if not self.parallel.sharded:
            return logits
        return self.parallel.all_gather_columns(logits)[:, : self.config.vocab_size]

    def embed_sharded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank's rows for the ids in its block, zeros for the
        others, summed over the ranks."""
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.stop - self.vocab.start)
        x = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.parallel.all_reduce(x.masked_fill_(outside.unsqueeze(1), 0))

    def pack_weights(self) -> int:
        """Pack every plain projection, the experts and the LM head for oneDNN (CPU;
        ``packing.pack_model``); → how many layers were packed (0 where unsupported). One explicit
        step after loading (``from_directory`` takes it): ``weight_targets`` no longer applies."""
        return pack_model(self)

    def quantize_weights(self, method: str = "int8", head: bool | None = None) -> int:
        """Quantize every plain projection (and the LM head unless ``head`` is False) with
        ``method`` (``QUANTIZE_CHOICES``; see ``weight_quantization.py``), in place of oneDNN
        packing for them; → how many projections were quantized. One explicit step after
        loading (``from_directory(quantize=...)`` takes it); the unquantized weights are freed
        (a tied head's embedding table stays, for lookups)."""
        return quantize_projections(self, method, head)

    def compile_cpu_kernels(self) -> int:
        """On CPU, compile what measures faster compiled: the int8 experts' few-token steps
        (``routed_experts.py``); → how many MoE blocks use it (0 where none applies or compiling
        failed, which leaves every block on its loop). One explicit step after quantizing
        (``from_directory(compile=True)`` takes it)."""
        blocks = [layer.mlp for layer in self.layers
                  if isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.int8_experts]
        if not blocks or self.device.type != "cpu":
            return 0
        stack = blocks[0].gate_up
        routed = compiled_int8_experts(stack.in_features, blocks[0].intermediate, stack.num_experts,
                                       blocks[0].top_k, stack.scales.dtype)
        for block in blocks:
            block.use_routed(routed)
        return len(blocks) if routed is not None else 0

    def compiled_decode(self) -> DecodeStep | None:
        """The in-place decode forward of one row compiled by inductor (``compiled_decode.py``),
        compiled on the first call and kept for every engine of this model; None where it cannot
        be (not on the CPU, MoE, tensor-parallel, or compiling failed: logged once)."""
        if not hasattr(self, "_compiled_decode"):
            self._compiled_decode = compile_decode_step(self)
        return self._compiled_decode

    def weight_summary(self) -> tuple[str, int]:
        """(the formats the weights run in, the bytes every weight holds: projections with their
        scales, embedding, norms; a tensor shared by two places counted once)."""
        return weight_summary(self)

