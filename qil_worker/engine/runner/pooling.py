"""Pooled requests' answers, computed on the device beside the step's sampling: the final
(normed) hidden state of each pooled prompt's last token becomes an embedding (truncated to
its ``dimensions``, L2-normalised) or, for a score, P(yes) of a yes/no judge.

The hidden state is the one the LM head would read (``Qwen3.logits`` applies the same norm),
which is what transformers' ``Qwen3Model`` returns as ``last_hidden_state``; an embedding
needs no LM head, and a score's logit row is one of the step's (``batch``: after the prompt
rows), so a step makes the same LM-head call, and the same collectives on every
tensor-parallel rank, with or without them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qil_worker.engine.request import Request
from qil_worker.engine.transfer import to_device
from qil_worker.model import Qwen3


@dataclass
class PooledAnswers:
    """Row i answers ``requests[i]``: an embedding zero-padded to the hidden size, or a score
    in column 0. Read after the step's sampled tokens (which follow it on the device)."""

    requests: list[Request]
    rows: torch.Tensor  # [R, hidden] float32

    def read(self) -> list[list[float] | float]:
        """Each request's answer on the host: its embedding (``dimensions`` long) or its score."""
        rows = self.rows.cpu().tolist()
        width = self.rows.shape[1]
        answers: list[list[float] | float] = []
        for request, row in zip(self.requests, rows):
            pooling = request.pooling
            answers.append(row[0] if pooling.kind == "score" else row[: pooling.dimensions or width])
        return answers


def pooled_answers(
    model: Qwen3, hidden: torch.Tensor, requests: list[Request], score_logits: torch.Tensor
) -> PooledAnswers:
    """``hidden`` [R, hidden]: the decoder stack's output at each pooled request's last token;
    ``score_logits`` [S, vocab]: the logits there of the S score requests among them, in order
    (computed with the step's other logit rows, one LM-head call)."""
    specs = [r.pooling for r in requests]
    device = hidden.device
    out = model.norm(hidden).float()
    width = out.shape[1]
    dims = to_device([p.dimensions or width for p in specs], device, torch.long)
    out = out * (torch.arange(width, device=device) < dims[:, None])  # Matryoshka: the leading part
    normalize = to_device([p.kind == "embed" and p.normalize for p in specs], device, torch.bool)
    out = torch.where(normalize[:, None], F.normalize(out, dim=-1), out)
    scored = [i for i, p in enumerate(specs) if p.kind == "score"]
    if scored:
        rows = to_device(scored, device, torch.long)
        pairs = to_device([t for i in scored for t in (specs[i].no_token_id, specs[i].yes_token_id)], device, torch.long)
        judged = torch.softmax(score_logits.gather(1, pairs.view(-1, 2)).float(), dim=-1)[:, 1]
        out[rows, 0] = judged
    return PooledAnswers(requests, out)
