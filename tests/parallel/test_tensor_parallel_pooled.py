"""Pooled requests (embeddings, yes/no scores) under tensor parallelism on CPU with gloo: at TP 2
rank 0's answers equal TP 1's (float32), alone — steps whose only finishing chunks are pooled
have no logit row, as have those of a long prompt's first chunks — and in steps mixed with
generation, whose tokens stay TP 1's; every page of rank 0's pool (the group's only page
bookkeeping) is free afterwards. A headless embedding checkpoint loads sharded as an embedding
model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checkpoints import make_checkpoint, make_headless_checkpoint
from engine_helpers import random_prompts
from tp_ranks import pooled_and_generate, run_ranks

from qil_worker.parallel import SINGLE

COSINE = 0.99999  # float32 against float32: the same math, its sums split over two ranks
ATOL = 1e-5
YES_NO = (11, 42)
# the 40-token prompt is chunked (prefill_chunk 16): its first steps end no pooled prompt
EMBED = random_prompts([3, 9, 40], seed=21)
SCORE = random_prompts([7, 11], seed=22)
GENERATE = random_prompts([5, 12], seed=23)


def assert_same_vectors(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g, w = torch.tensor(g), torch.tensor(w)
        assert g.shape == w.shape
        assert F.cosine_similarity(g, w, dim=0).item() >= COSINE
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tp-pooled"), seed=3, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def headless_dir(tmp_path_factory):
    return make_headless_checkpoint(tmp_path_factory.mktemp("tp-headless") / "m")


def test_tp2_embeddings_scores_and_mixed_steps_match_tp1(untied_dir, tmp_path):
    args = (str(untied_dir), EMBED, SCORE, GENERATE, YES_NO)
    want = pooled_and_generate(SINGLE, *args)
    lead, follower = run_ranks(pooled_and_generate, 2, tmp_path, *args)
    assert_same_vectors(lead["embeddings"], want["embeddings"])
    assert lead["scores"] == pytest.approx(want["scores"], abs=ATOL)
    assert all(0 < s < 1 for s in lead["scores"])
    assert lead["long_tokens"] == want["long_tokens"] and len(lead["long_tokens"]) == 4
    # generation, embeddings (Matryoshka 16) and scores whose prompts ran in one step
    ids = lead["mixed_ids"]
    short = ids["generate"] + ids["score"] + ids["embed"][:2]
    assert set(lead["first_step_requests"]) >= set(short)
    assert lead["mixed_tokens"] == want["mixed_tokens"] and all(len(t) == 6 for t in lead["mixed_tokens"])
    assert_same_vectors(lead["mixed_embeddings"], want["mixed_embeddings"])
    assert all(len(v) == 16 for v in lead["mixed_embeddings"])
    assert lead["mixed_scores"] == pytest.approx(want["scores"], abs=ATOL)
    for got in (lead, want):
        assert got["pages_after_embed"] == got["pages_after_score"] == got["pages_used"] == 0
        assert got["pages_free"] == got["pages_total"] and got["running"] == got["waiting"] == 0
    assert follower["steps"] > 0


def test_tp2_headless_embedding_checkpoint_matches_tp1(headless_dir, tmp_path):
    args = (str(headless_dir), EMBED, SCORE, GENERATE, YES_NO, True)
    want = pooled_and_generate(SINGLE, *args)
    lead, follower = run_ranks(pooled_and_generate, 2, tmp_path, *args)
    assert_same_vectors(lead["embeddings"], want["embeddings"])
    assert lead["pages_after_embed"] == 0 and follower["steps"] > 0
