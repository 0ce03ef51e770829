"""Our paged forward against transformers' Qwen3ForCausalLM, float32, 1e-4 absolute."""

import pytest
import torch

from checkpoints import load_reference, make_checkpoint
from qil_worker import Qwen3
from qil_worker.engine.probe import ForwardProbe

ATOL = 1e-4


@pytest.fixture(scope="module", params=[(4, 4, True, None), (4, 2, False, "30KB"), (8, 2, True, None)],
                ids=["mha-tied", "gqa2-untied-sharded", "gqa4-tied"])
def pair(request, tmp_path_factory, device):
    heads, kv_heads, tied, shard = request.param
    path = make_checkpoint(
        tmp_path_factory.mktemp("logits"), seed=heads + kv_heads,
        num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
        max_shard_size=shard,
    )
    return Qwen3.from_directory(path, device=device, dtype="float32"), load_reference(path)


def _reference_logits(ref, ids, device="cpu"):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].to(device)


def _prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (n,), generator=g).tolist()


def test_full_prefill(pair):
    model, ref = pair
    ids = _prompt(45, 1)
    probe = ForwardProbe(model, num_pages=32, page_size=8)
    (got,) = probe.forward([(probe.sequence(ids), len(ids))])
    torch.testing.assert_close(got, _reference_logits(ref, ids, got.device), atol=ATOL, rtol=0)


def test_token_by_token(pair):
    model, ref = pair
    ids = _prompt(21, 2)
    probe = ForwardProbe(model, num_pages=32, page_size=4)
    seq = probe.sequence(ids)
    got = torch.cat([probe.forward([(seq, 1)])[0] for _ in ids])
    torch.testing.assert_close(got, _reference_logits(ref, ids, got.device), atol=ATOL, rtol=0)


def test_irregular_chunks_of_several_sequences_in_one_batch(pair, device):
    """Three sequences advance together with different chunk sizes each step."""
    model, ref = pair
    prompts = [_prompt(30, 3), _prompt(17, 4), _prompt(1, 5)]
    schedules = [[3, 1, 7, 5, 9, 5], [1, 1, 10, 2, 3], [1]]
    probe = ForwardProbe(model, num_pages=64, page_size=4)
    seqs = [probe.sequence(p) for p in prompts]
    got = [[] for _ in prompts]
    for step in range(max(len(s) for s in schedules)):
        pieces = [(i, s[step]) for i, s in enumerate(schedules) if step < len(s)]
        outs = probe.forward([(seqs[i], n) for i, n in pieces])
        for (i, _), out in zip(pieces, outs):
            got[i].append(out)
    for i, ids in enumerate(prompts):
        torch.testing.assert_close(torch.cat(got[i]), _reference_logits(ref, ids, device), atol=ATOL, rtol=0)
    for seq in seqs:
        probe.release(seq)
    assert probe.pool.num_free == probe.pool.total


def test_bfloat16_close_to_reference(tmp_path, device):
    path = make_checkpoint(tmp_path, seed=9)
    model = Qwen3.from_directory(path, device=device, dtype=torch.bfloat16)
    ref = load_reference(path, dtype=torch.bfloat16)
    ids = _prompt(24, 6)
    probe = ForwardProbe(model, num_pages=16, page_size=8)
    (got,) = probe.forward([(probe.sequence(ids), len(ids))])
    want = _reference_logits(ref, ids, device).float()
    # bf16 keeps ~3 significant digits; both sides round differently along 2 layers.
    assert (got - want).abs().max() < 0.05 * want.abs().max()
