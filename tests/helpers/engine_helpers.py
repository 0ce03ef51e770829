"""Reference greedy generation and pool checks shared by the engine tests."""

from __future__ import annotations

import random

import torch

from qil_worker import FinishReason


def reference_greedy(ref, prompt: list[int], max_new_tokens: int, stop_ids=()) -> list[int]:
    """transformers' greedy continuation, cut after the first stop id like the engine does."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(
            ids, attention_mask=torch.ones_like(ids),  # else a prompt token equal to pad_token_id is masked
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )[0, len(prompt):].tolist()
    for i, t in enumerate(out):
        if t in stop_ids:
            return out[: i + 1]
    return out


def run_to_completion(engine, max_steps: int = 10_000) -> list:
    events = []
    for _ in range(max_steps):
        if engine.idle:
            return events
        events.extend(engine.step())
    raise AssertionError("engine did not become idle")


def assert_pool_free(engine) -> None:
    stats = engine.stats()
    assert stats.num_pages_used == 0 and stats.num_pages_free == stats.num_pages_total, stats
    assert stats.num_running == 0 and stats.num_waiting == 0


def random_prompts(lengths, seed=3) -> list[list[int]]:
    """Seeded token-id prompts of ``lengths`` for the tiny models (ids 1..96: 0 is the
    reference's pad id)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(n)] for n in lengths]


def check_preemption_and_cancel(engine, ref) -> list:
    """Six requests on an engine whose pool is too small for them all (30 pages of 4), and a
    seventh cancelled after 12 steps: the six give transformers' tokens after being preempted,
    the seventh ends cancelled, every page is free. → the six results."""
    prompts = random_prompts([3, 9, 17, 40, 70, 2], seed=11)
    expected = [reference_greedy(ref, p, 10) for p in prompts]
    ids = [engine.submit(p, max_new_tokens=10) for p in prompts]
    victim = engine.submit(random_prompts([30], seed=5)[0], max_new_tokens=10)
    for _ in range(12):
        engine.step()
    engine.cancel(victim)
    run_to_completion(engine)
    results = [engine.result(i) for i in ids]
    assert [r.output_token_ids for r in results] == expected
    assert sum(r.num_preemptions for r in results) > 0, "the pool was meant to force preemption"
    assert engine.result(victim).finish_reason is FinishReason.CANCELLED
    assert_pool_free(engine)
    return results


def seeded_prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` prefilled at once (float32)."""
    from qil_worker.engine.probe import ForwardProbe

    probe = ForwardProbe(model, num_pages=32, page_size=8)
    (logits,) = probe.forward([(probe.sequence(ids), len(ids))])
    return logits.float()


def decode_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` fed one token per forward (float32)."""
    from qil_worker.engine.probe import ForwardProbe

    probe = ForwardProbe(model, num_pages=32, page_size=4)
    seq = probe.sequence(ids)
    return torch.cat([probe.forward([(seq, 1)])[0] for _ in ids]).float()


def reference_logits(path, ids: list[int]) -> torch.Tensor:
    """transformers' logits of ``ids`` for the checkpoint at ``path``."""
    from checkpoints import load_reference

    with torch.no_grad():
        return load_reference(path)(torch.tensor([ids])).logits[0]
