"""Reference greedy generation and pool checks shared by the engine tests."""

from __future__ import annotations

import torch


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
