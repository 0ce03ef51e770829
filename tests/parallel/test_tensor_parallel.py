"""Tensor parallelism on CPU with gloo: ranks in spawned processes, each loading only its shard,
give the single-device model's logits and transformers' greedy tokens (dense and MoE, float32).

Rank 0 runs the engine (scheduler, page pool, sampling); the other ranks follow the steps it
sends them (``runner.follower``), KV page copies of forked samples included.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import load_moe_reference, load_reference, make_checkpoint, make_moe_checkpoint
from engine_helpers import random_prompts, reference_greedy
from tp_ranks import SAMPLED_PROMPT, forward_and_generate, kill_a_follower_mid_stream, run_ranks

from qil_worker import Engine, Qwen3
from qil_worker.engine.probe import ForwardProbe
from qil_worker.errors import ConfigError
from qil_worker.parallel import ParallelState

PROMPTS = random_prompts([3, 9, 17, 40, 70, 2], seed=11)
SHARED = random_prompts([16], seed=2)[0]
PROMPTS += [SHARED + [5, 6], SHARED + [7]]  # a shared prefix of 4 pages: prefix-cache hits
LOGIT_PROMPT = random_prompts([23], seed=4)[0]


def single_device(path) -> tuple[torch.Tensor, int, list[list[int]]]:
    """TP 1's logits of ``LOGIT_PROMPT``, its weight bytes and its two seeded samples."""
    model = Qwen3.from_directory(path, dtype="float32")
    probe = ForwardProbe(model, num_pages=32, page_size=4)
    (logits,) = probe.forward([(probe.sequence(LOGIT_PROMPT), len(LOGIT_PROMPT))])
    engine = Engine(model, num_pages=30, page_size=4)
    sampled = engine.generate([SAMPLED_PROMPT], max_new_tokens=6, n=2, temperature=1.0, seed=7)[0]
    return logits, model.weight_summary()[1], [r.output_token_ids for r in sampled]


def check_ranks(ranks: list[dict], path, reference, world_size: int, prompts=PROMPTS) -> None:
    """Rank 0: TP 1's logits to 1e-4 and its seeded samples, transformers' greedy tokens after
    preemption, prefix hits, every page free; the others followed its steps. Each rank's weights
    a fraction of the whole model's."""
    want_logits, whole_bytes, want_sampled = single_device(path)
    lead = ranks[0]
    assert (lead["logits"] - want_logits).abs().max().item() < 1e-4
    assert lead["tokens"] == [reference_greedy(reference, p, 10) for p in prompts]
    assert lead["sampled"] == want_sampled and lead["sampled"][0] != lead["sampled"][1]
    assert lead["prefix_hit_rate"] > 0
    assert lead["pages_used"] == 0
    if prompts is PROMPTS:  # (too few others to press the pool)
        assert lead["preemptions"] > 0, "the pool was meant to force preemption"
    for got in ranks[1:]:
        assert got["steps"] > len(prompts)
    for got in ranks:
        # a rank holds its share of everything but the norms, routers and replicated KV heads
        assert got["weight_bytes"] < whole_bytes * (1 / world_size + 0.25), (got["weight_bytes"], whole_bytes)


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory):
    return {
        "tied": make_checkpoint(tmp_path_factory.mktemp("tp-tied"), seed=0),
        "untied-sharded": make_checkpoint(tmp_path_factory.mktemp("tp-untied"), seed=1, tie_word_embeddings=False,
                                          max_shard_size="30KB"),
        "one-kv-head": make_checkpoint(tmp_path_factory.mktemp("tp-kv1"), seed=2, num_key_value_heads=1),
    }


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_moe_checkpoint(tmp_path_factory.mktemp("tp-moe"), seed=0)


@pytest.mark.parametrize("kind", ["tied", "untied-sharded", "one-kv-head"])
def test_dense_tp2_matches_tp1_and_transformers(kind, dense_dirs, tmp_path):
    path = dense_dirs[kind]
    ranks = run_ranks(forward_and_generate, 2, tmp_path, str(path), PROMPTS, LOGIT_PROMPT)
    check_ranks(ranks, path, load_reference(path), 2)
    # one KV head for two ranks is replicated (each keeps it); two are split
    assert [r["kv_heads"] for r in ranks] == [1, 1]


def test_moe_tp2_matches_tp1_and_transformers(moe_dir, tmp_path):
    ranks = run_ranks(forward_and_generate, 2, tmp_path, str(moe_dir), PROMPTS, LOGIT_PROMPT)
    check_ranks(ranks, moe_dir, load_moe_reference(moe_dir), 2)


def test_fused_wiring_tp2_dense_and_moe(dense_dirs, moe_dir, tmp_path):
    """The CUDA wiring (one q/k/v and one gate/up projection, grouped experts) split the same."""
    for name, path, reference in [("dense", dense_dirs["tied"], load_reference(dense_dirs["tied"])),
                                  ("moe", moe_dir, load_moe_reference(moe_dir))]:
        workdir = tmp_path / name
        workdir.mkdir()
        ranks = run_ranks(forward_and_generate, 2, workdir, str(path), PROMPTS, LOGIT_PROMPT, True)
        check_ranks(ranks, path, reference, 2)


def test_tp4_replicates_kv_heads_across_rank_pairs(dense_dirs, tmp_path):
    """Four query heads, two KV heads on four ranks: ranks 0-1 share KV head 0, ranks 2-3 head 1."""
    path = dense_dirs["tied"]
    prompts = PROMPTS[:1] + PROMPTS[-2:]
    ranks = run_ranks(forward_and_generate, 4, tmp_path, str(path), prompts, LOGIT_PROMPT)
    check_ranks(ranks, path, load_reference(path), 4, prompts)
    assert [r["kv_heads"] for r in ranks] == [1, 1, 1, 1]


def test_a_rank_other_than_0_runs_no_engine(dense_dirs):
    model = Qwen3.from_directory(dense_dirs["tied"], parallel=ParallelState(1, 2))
    with pytest.raises(ValueError, match="rank 1 follows rank 0"):
        Engine(model, num_pages=8, page_size=4)


def test_sizes_that_do_not_divide_are_refused_naming_the_fields(dense_dirs, moe_dir):
    with pytest.raises(ConfigError) as error:
        Qwen3.from_directory(dense_dirs["tied"], parallel=ParallelState(0, 3))
    message = str(error.value)
    assert "num_attention_heads (4) is not divisible by 3" in message
    assert "num_key_value_heads (2)" in message and "intermediate_size (96) is not divisible by 3" not in message
    assert "Sizes that work: 1, 2, 4" in message
    with pytest.raises(ConfigError, match=r"moe_intermediate_size \(32\) is not divisible by 3"):
        Qwen3.from_directory(moe_dir, parallel=ParallelState(0, 3))


def test_tp1_holds_the_whole_model_and_no_shards(dense_dirs):
    model = Qwen3.from_directory(dense_dirs["tied"])
    assert model.weight_shards() == {} and not model.parallel.sharded
    assert model.embed.shape[0] == model.config.vocab_size
    assert all(layer.reduce is None for layer in model.layers)


def test_a_rank_on_cuda_without_an_index_takes_its_own_gpu(monkeypatch):
    from qil_worker.parallel.group import rank_device

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [rank_device("cuda", r) for r in (0, 1, 5)] == [torch.device("cuda", i) for i in (0, 1, 1)]
    assert rank_device("cuda:0", 3) == torch.device("cuda", 0)  # an index is kept (ranks sharing a GPU)
    assert rank_device("cpu", 1) == torch.device("cpu")


def test_a_killed_follower_fails_the_streams_at_once_and_the_engine_refuses_work(dense_dirs, tmp_path):
    """SIGKILL of rank 1 mid-stream: rank 0's next collective fails at once (no wait for a
    timeout), its requests end with an error naming the group, and the engine takes no more
    work (as after a lost device: the worker is then replaced)."""
    lead, killed = run_ranks(kill_a_follower_mid_stream, 2, tmp_path, str(dense_dirs["tied"]), str(tmp_path),
                             killed=(1,))
    assert killed is None
    for reason, error in lead["finals"]:
        assert reason == lead["error_reason"]
        assert "tensor-parallel group failed" in error
    assert "tensor-parallel group failed" in lead["failure"]
    assert lead["refused"] is not None and "unusable" in lead["refused"]
    assert lead["elapsed"] < 20  # the collective timeout is 60 s: this was no timeout



def test_fp8_block_checkpoints_whose_slices_end_inside_a_block_are_refused_naming_them(tmp_path):
    """A slice edge inside a 128x128 block would share its scale between two ranks: refused at
    load, before any tensor is read, naming the slices and the sizes that work; TP 1 loads it."""
    from checkpoints import make_fp8_checkpoint, make_fp8_moe_checkpoint

    dense = make_fp8_checkpoint(tmp_path / "dense")
    with pytest.raises(ConfigError) as error:
        Qwen3.from_directory(dense, parallel=ParallelState(0, 2))
    message = str(error.value)
    assert message.startswith("tensor_parallel_size 2: this FP8 block-quantized checkpoint")
    assert "splits only on whole blocks of its weight_scale_inv" in message
    assert "gate_proj/up_proj rows (intermediate_size) 48 per rank" in message  # 96 / 2, inside a block
    assert "q_proj rows (num_attention_heads x head_dim) 32 per rank" in message
    assert message.endswith("The largest tensor_parallel_size that works: 1 (all that do: 1).")
    assert Qwen3.from_directory(dense).config.quantization is not None
    with pytest.raises(ConfigError, match=r"expert gate_proj/up_proj rows \(moe_intermediate_size\) 16 per rank"):
        Qwen3.from_directory(make_fp8_moe_checkpoint(tmp_path / "moe"), parallel=ParallelState(0, 2))


def _fp8_config(**shape):
    from qil_worker.config import Qwen3Config

    return Qwen3Config.from_dict(dict(
        vocab_size=151936, num_hidden_layers=4, head_dim=128, max_position_embeddings=40960,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                             "weight_block_size": [128, 128]}, **shape,
    ))


def test_fp8_sizes_of_the_official_shapes():
    """Qwen3-8B splits on whole blocks at 2, 4 and 8 ranks; Qwen3-30B-A3B's 768-wide experts
    only at 2 (at 4 a rank's 192 rows end inside a block)."""
    from qil_worker.parallel import check_tp_size

    dense = _fp8_config(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                        num_key_value_heads=8)
    for n in (1, 2, 4, 8):
        check_tp_size(dense, n)
    moe = _fp8_config(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                      num_key_value_heads=4, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8)
    check_tp_size(moe, 2)
    with pytest.raises(ConfigError) as error:
        check_tp_size(moe, 4)
    assert "expert gate_proj/up_proj rows (moe_intermediate_size) 192 per rank" in str(error.value)
    assert "The largest tensor_parallel_size that works: 2 (all that do: 1, 2)." in str(error.value)


# every rank's slice whole 128-blocks at TP 2: 2 heads of 128, widths of 256
FP8_ALIGNED = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                   intermediate_size=256)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fp8_tp2_loads_each_ranks_blocks_and_gives_tp1s_logits_and_tokens(kind, tmp_path):
    """Each rank reads its slice of every FP8 projection and the scale blocks of that slice,
    dequantized as at TP 1: the same logits (float32) and greedy tokens, every page free."""
    from checkpoints import make_fp8_checkpoint, make_fp8_moe_checkpoint

    if kind == "dense":
        path = make_fp8_checkpoint(tmp_path / "ckpt", **FP8_ALIGNED)
    else:
        path = make_fp8_moe_checkpoint(tmp_path / "ckpt", **FP8_ALIGNED, moe_intermediate_size=256)
    for size in (1, 2):
        (tmp_path / f"tp{size}").mkdir()
    (alone,) = run_ranks(forward_and_generate, 1, tmp_path / "tp1", str(path), PROMPTS[:4], LOGIT_PROMPT)
    ranks = run_ranks(forward_and_generate, 2, tmp_path / "tp2", str(path), PROMPTS[:4], LOGIT_PROMPT)
    lead = ranks[0]
    assert (lead["logits"] - alone["logits"]).abs().max().item() < 1e-4 * alone["logits"].abs().max().item()
    assert lead["tokens"] == alone["tokens"] and lead["sampled"] == alone["sampled"]
    assert lead["pages_used"] == 0 and ranks[1]["steps"] > 4
    assert all(r["weight_bytes"] < alone["weight_bytes"] * 0.75 for r in ranks)
