"""Choosing the next token of every sampled request from its logits, in one batched op.

Greedy for now; the sampling issue extends this module with per-request parameters.
"""

from __future__ import annotations

import torch


class Sampler:
    def sample(self, logits: torch.Tensor) -> list[int]:
        """``logits`` [S, vocab] → one token id per row. The step's only host sync is here."""
        return logits.argmax(dim=-1).tolist()
