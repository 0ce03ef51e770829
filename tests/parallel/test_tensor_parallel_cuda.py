"""Tensor parallelism on CUDA (skipped without a GPU; the device check runs it).

NCCL at world size 1: a spawned rank joins with ``device="cuda"`` (its own GPU, cuda:0) and runs
``ParallelState``'s collectives on CUDA tensors; an engine whose model went through that group
gives the single-device run's logits, greedy tokens and seeded samples (at TP 1 the model makes
no collective call, so this checks the joining, not a second forward). TP 2 on one GPU: NCCL
refuses two ranks on one device, so those ranks join with ``backend="gloo"``, whose collectives
take CUDA tensors; they give TP 1's greedy tokens (dense, float32) and free every page.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import load_reference
from engine_helpers import random_prompts, reference_greedy
from tp_ranks import collectives, forward_and_generate, run_ranks

from qil_worker.parallel import SINGLE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = random_prompts([3, 9, 17, 40, 70, 2], seed=11)
SHARED = random_prompts([16], seed=2)[0]
PROMPTS += [SHARED + [5, 6], SHARED + [7]]  # a shared prefix of 4 pages: prefix-cache hits
LOGIT_PROMPT = random_prompts([23], seed=4)[0]


@pytest.fixture(scope="module")
def single(tiny_dir):
    """The plain single-device run on cuda:0 (``SINGLE``, no group), in this process."""
    return forward_and_generate(SINGLE, str(tiny_dir), PROMPTS, LOGIT_PROMPT, device="cuda:0")


@pytest.fixture(scope="module")
def gloo_on_one_gpu(tmp_path_factory):
    """``collectives`` on two ranks sharing cuda:0 over gloo → each rank's results."""
    return run_ranks(collectives, 2, tmp_path_factory.mktemp("gloo-cuda"), "cuda:0", device="cuda:0",
                     backend="gloo")


def _gather_refusal(ranks: list[dict]) -> str | None:
    return next((r["gather_refused"] for r in ranks if "gather_refused" in r), None)


def test_nccl_at_world_size_1_runs_the_collectives_on_cuda(tmp_path):
    (got,) = run_ranks(collectives, 1, tmp_path, "cuda", device="cuda")
    assert got["backend"] == "nccl"
    assert got["device"] == "cuda:0" and got["current_device"] == 0  # "cuda": rank 0's GPU
    assert "gather_refused" not in got, got.get("gather_refused")
    assert got["in_place"] and torch.equal(got["reduced"], torch.ones(4, 3))
    assert got["gathered_device"] == "cuda:0"
    assert torch.equal(got["gathered"], torch.arange(6, dtype=torch.float32).view(3, 2))
    assert got["empty_shape"] == (0, 2) and got["empty_device"] == "cuda:0"  # no collective: none of 0 rows


def test_tp1_through_an_nccl_group_gives_the_single_device_run(tiny_dir, single, tmp_path):
    (through,) = run_ranks(forward_and_generate, 1, tmp_path, str(tiny_dir), PROMPTS, LOGIT_PROMPT, device="cuda")
    ref = load_reference(tiny_dir)
    assert single["tokens"] == [reference_greedy(ref, p, 10) for p in PROMPTS]
    assert through["tokens"] == single["tokens"] and through["sampled"] == single["sampled"]
    torch.testing.assert_close(through["logits"], single["logits"], atol=1e-5, rtol=0)
    assert through["weight_bytes"] == single["weight_bytes"] and through["pages_used"] == 0
    assert through["preemptions"] == single["preemptions"] and through["prefix_hit_rate"] > 0


def test_gloo_gathers_and_sums_cuda_tensors_of_two_ranks_on_one_gpu(gloo_on_one_gpu):
    refused = _gather_refusal(gloo_on_one_gpu)
    if refused is not None:
        pytest.skip(f"gloo refuses all_gather_into_tensor of CUDA tensors in this torch: {refused}")
    for got in gloo_on_one_gpu:
        assert (got["backend"], got["device"], got["current_device"]) == ("gloo", "cuda:0", 0)
        assert got["in_place"] and torch.equal(got["reduced"], torch.full((4, 3), 3.0))  # 1 + 2
        base = torch.arange(6, dtype=torch.float32).view(3, 2)
        assert torch.equal(got["gathered"], torch.cat([base, base + 100], dim=1))  # rank r's columns 2r, 2r + 1
        assert got["gathered_device"] == "cuda:0" and got["empty_shape"] == (0, 4)


def test_tp2_on_one_gpu_over_gloo_gives_tp1s_greedy_tokens(tiny_dir, single, gloo_on_one_gpu, tmp_path):
    refused = _gather_refusal(gloo_on_one_gpu)
    if refused is not None:  # the vocab-parallel LM head gathers its logits so
        pytest.skip(f"gloo refuses all_gather_into_tensor of CUDA tensors in this torch: {refused}")
    ranks = run_ranks(forward_and_generate, 2, tmp_path, str(tiny_dir), PROMPTS, LOGIT_PROMPT, device="cuda:0",
                      backend="gloo")
    lead = ranks[0]
    assert (lead["logits"] - single["logits"]).abs().max().item() < 1e-4
    assert lead["tokens"] == single["tokens"] and lead["sampled"] == single["sampled"]
    assert lead["pages_used"] == 0 and lead["preemptions"] == single["preemptions"]
    assert ranks[1]["steps"] > len(PROMPTS)
    assert all(r["weight_bytes"] < single["weight_bytes"] * 0.75 for r in ranks)
