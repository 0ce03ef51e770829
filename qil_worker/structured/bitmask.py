"""The grammar stage of the sampler: one bitmask for all constrained rows of a step, applied in
one masked fill to those rows only."""

from __future__ import annotations

import torch

from qil_worker.structured.matcher import ConstraintMatcher

# Byte → its 8 bits as additive logit biases (0 allowed, -inf forbidden; little-endian words, so
# token t is bit t % 8 of byte t // 8). Looking the mask's bytes up in this table and adding the
# result is several times faster on a CPU than unpacking bits with broadcast shifts and a masked
# fill (docs/performance.md, "Structured output").
_BYTE_BIASES = torch.tensor(
    [[0.0 if byte >> bit & 1 else float("-inf") for bit in range(8)] for byte in range(256)]
)


class GrammarMasks:
    """A persistent int32 buffer [rows, ceil(vocab / 32)] the matchers fill each step."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, 0, dtype=torch.int32)
        self._biases: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, matchers: list[ConstraintMatcher | None]) -> torch.Tensor:
        """Make every token the grammar of row i forbids -inf, in place (rows whose matcher is None
        are left alone); returns ``logits``. ``logits`` [rows, vocab] float, the step's own."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        vocab = logits.shape[1]
        masks = self._fill([matchers[i] for i in rows], (vocab + 31) // 32)
        bias = self._biases_of(masks.to(logits.device, non_blocking=True), vocab, logits.dtype)
        with torch.inference_mode():  # the model's logits are inference tensors
            if len(rows) == len(matchers):
                logits += bias
            else:
                index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
                logits.index_copy_(0, index, logits.index_select(0, index).add_(bias))
        return logits

    def _fill(self, matchers: list[ConstraintMatcher], words: int) -> torch.Tensor:
        n = len(matchers)
        if self._buffer.shape[0] < n or self._buffer.shape[1] != words:
            rows = max(n, 2 * self._buffer.shape[0]) if self._buffer.shape[1] == words else n
            self._buffer = torch.empty(rows, words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        masks = self._buffer[:n]
        row_bytes = words * 4
        base = masks.data_ptr()
        for i, matcher in enumerate(matchers):
            matcher.fill_mask(base + i * row_bytes, row_bytes)
            if matcher.error is not None:
                # a failed matcher (a lexer limit): leave its row unmasked; the token it then
                # rejects fails that request, with the library's message
                masks[i].fill_(-1)
        return masks

    def _biases_of(self, masks: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
        """[n, words] int32 bitmask → [n, vocab] additive biases: 0 where allowed, -inf where not."""
        key = (masks.device, dtype)
        table = self._biases.get(key)
        if table is None:
            table = self._biases[key] = _BYTE_BIASES.to(masks.device, dtype)
        n = masks.shape[0]
        return table.index_select(0, masks.view(torch.uint8).flatten().long()).view(n, -1)[:, :vocab]
