"""Which slice of each weight a tensor-parallel rank holds, and which TP sizes a model allows.

Column-parallel projections (q/k/v, gate/up, each expert's gate/up) hold a contiguous block of
output rows; row-parallel ones (o, down) the matching block of input columns, their partial
outputs summed by one all-reduce. Attention is split by heads: each rank has
``num_attention_heads / N`` query heads and ``num_key_value_heads / N`` KV heads — or, when there
are fewer KV heads than ranks, the one KV head its query heads read (replicated across the
ranks that share it). The vocabulary is split in blocks of ``ceil(vocab / N)`` rows, the last
rank's block padded with zero rows, so that any vocabulary size works.
"""

from __future__ import annotations

from typing import NamedTuple

from qil_worker.config import Fp8Quantization, Qwen3Config
from qil_worker.errors import ConfigError


class Shard(NamedTuple):
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a checkpoint tensor whose
    size along ``dim`` is ``full``."""

    dim: int
    start: int
    stop: int
    full: int

    def index(self) -> tuple[slice, ...]:
        """The index of the slice, for ``safe_open(...).get_slice(name)[...]``."""
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)

    def full_shape(self, local: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint tensor's shape, given the shape of this slice."""
        return local[: self.dim] + (self.full,) + local[self.dim + 1 :]


def even(full: int, rank: int, world_size: int, dim: int) -> Shard:
    """Rank ``rank``'s block of ``full`` split evenly (``full`` divisible by ``world_size``)."""
    size = full // world_size
    return Shard(dim, rank * size, (rank + 1) * size, full)


def vocab_block(vocab: int, world_size: int) -> int:
    """Rows of the embedding and the LM head every rank holds (the last rank's padded)."""
    return -(-vocab // world_size)


def vocab_shard(vocab: int, rank: int, world_size: int) -> Shard:
    """Rank ``rank``'s rows of the embedding table and the LM head."""
    block = vocab_block(vocab, world_size)
    start = min(rank * block, vocab)
    return Shard(0, start, min(start + block, vocab), vocab)


class AttentionHeads(NamedTuple):
    """One rank's attention heads: how many query and KV heads, and the first of each."""

    q_heads: int
    kv_heads: int
    head_dim: int
    first_q_head: int = 0
    first_kv_head: int = 0

    @property
    def query_groups(self) -> int:
        """Query heads per KV head on this rank (the GQA fold)."""
        return self.q_heads // self.kv_heads

    @classmethod
    def of(cls, config: Qwen3Config, rank: int = 0, world_size: int = 1) -> "AttentionHeads":
        """Rank ``rank``'s heads (``check_tp_size`` has accepted ``world_size``)."""
        q = config.num_attention_heads // world_size
        kv_total = config.num_key_value_heads
        if kv_total >= world_size:
            kv, first_kv = kv_total // world_size, rank * (kv_total // world_size)
        else:  # fewer KV heads than ranks: each rank keeps the one its query heads read
            kv, first_kv = 1, rank // (world_size // kv_total)
        return cls(q, kv, config.head_dim, rank * q, first_kv)


def tp_problems(config: Qwen3Config, world_size: int) -> list[str]:
    """Why ``config`` cannot be split over ``world_size`` ranks (empty: it can), each problem
    naming its config field."""
    n = world_size
    problems = []
    if config.num_attention_heads % n:
        problems.append(f"num_attention_heads ({config.num_attention_heads}) is not divisible by {n}")
    kv = config.num_key_value_heads
    if kv % n and n % kv:
        problems.append(
            f"num_key_value_heads ({kv}) neither divides nor is divisible by {n} (KV heads are split, "
            "or replicated when fewer than the ranks)"
        )
    dense = any(not config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    if dense and config.intermediate_size % n:
        problems.append(f"intermediate_size ({config.intermediate_size}) is not divisible by {n}")
    if config.is_moe and config.moe_intermediate_size % n:
        problems.append(f"moe_intermediate_size ({config.moe_intermediate_size}) is not divisible by {n}")
    return problems


def fp8_slice_problems(config: Qwen3Config, world_size: int) -> list[str]:
    """The slices of an FP8 block-quantized model that would end inside a scale block at
    ``world_size`` ranks (each would share one scale between two ranks): a rank's slice of a
    projection reads whole blocks of its ``weight_scale_inv`` (``fp8.scale_shard``)."""
    if world_size == 1:
        return []  # nothing is sliced
    n, (rows, cols) = world_size, config.quantization.block_size
    slices = {"q_proj rows (num_attention_heads x head_dim)": config.num_attention_heads * config.head_dim // n}
    if config.num_key_value_heads >= n:
        kv_rows = config.num_key_value_heads * config.head_dim // n
        slices["k_proj/v_proj rows (num_key_value_heads x head_dim)"] = kv_rows
    else:  # each rank keeps one whole KV head
        slices["k_proj/v_proj rows (head_dim, one KV head per rank)"] = config.head_dim
    if any(not config.is_sparse_layer(i) for i in range(config.num_hidden_layers)):
        slices["gate_proj/up_proj rows (intermediate_size)"] = config.intermediate_size // n
    if config.is_moe:
        slices["expert gate_proj/up_proj rows (moe_intermediate_size)"] = config.moe_intermediate_size // n
    # a column-parallel slice's rows are the width of its row-parallel partner's columns
    return [f"{name} {size} per rank" for name, size in slices.items() if size % rows or size % cols]


def _fp8_refusal(config: Qwen3Config, world_size: int, inside: list[str]) -> str:
    rows, cols = config.quantization.block_size
    working = [n for n in range(1, config.num_attention_heads + 1)
               if not tp_problems(config, n) and not fp8_slice_problems(config, n)]
    return (
        f"tensor_parallel_size {world_size}: this FP8 block-quantized checkpoint (weight_block_size "
        f"[{rows}, {cols}]) splits only on whole blocks of its weight_scale_inv, and these slices end "
        f"inside a block: {'; '.join(inside)}. The largest tensor_parallel_size that works: {max(working)} "
        f"(all that do: {', '.join(map(str, working))})."
    )


def check_tp_size(config: Qwen3Config, world_size: int) -> None:
    """Raise ``ConfigError`` naming every field that ``world_size`` does not divide, and the
    tensor-parallel sizes that do work for this model."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if config.quantization is not None and world_size > 1:
        if not isinstance(config.quantization, Fp8Quantization):
            raise ConfigError(
                "tensor_parallel_size: int4 checkpoints (quantization_config: AWQ, GPTQ) are not "
                "split across ranks yet; serve them with tensor_parallel_size 1"
            )
        if not tp_problems(config, world_size):
            inside = fp8_slice_problems(config, world_size)
            if inside:
                raise ConfigError(_fp8_refusal(config, world_size, inside))
    problems = tp_problems(config, world_size)
    if problems:
        working = [n for n in range(1, config.num_attention_heads + 1) if not tp_problems(config, n)]
        raise ConfigError(
            f"tensor_parallel_size {world_size} does not fit this model: " + "; ".join(problems)
            + f". Sizes that work: {', '.join(map(str, working))}"
        )
