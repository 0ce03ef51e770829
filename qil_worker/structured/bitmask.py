"""The grammar stage of the sampler: one bitmask for all constrained rows of a step, applied in
one masked fill to those rows only."""

from __future__ import annotations

import torch

from qil_worker.structured.matcher import ConstraintMatcher

# bit b of a byte: the uint8 view unpacks the int32 words with one broadcast AND (little-endian)
_BITS = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)


class GrammarMasks:
    """A persistent int32 buffer [rows, ceil(vocab / 32)] the matchers fill each step."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, 0, dtype=torch.int32)
        self._bits: dict[torch.device, torch.Tensor] = {}

    def apply(self, logits: torch.Tensor, matchers: list[ConstraintMatcher | None]) -> torch.Tensor:
        """Set to -inf, in place, every token the grammar of row i forbids (rows whose matcher is
        None are left alone); returns ``logits``. ``logits`` [rows, vocab] float, the step's own."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        vocab = logits.shape[1]
        masks = self._fill([matchers[i] for i in rows], (vocab + 31) // 32)
        forbidden = self._unpack(masks.to(logits.device, non_blocking=True), vocab)
        with torch.inference_mode():  # the model's logits are inference tensors
            if len(rows) == len(matchers):
                logits.masked_fill_(forbidden, float("-inf"))
            else:
                index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
                constrained = logits.index_select(0, index).masked_fill_(forbidden, float("-inf"))
                logits.index_copy_(0, index, constrained)
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

    def _unpack(self, masks: torch.Tensor, vocab: int) -> torch.Tensor:
        """[n, words] int32 → [n, vocab] bool, True where a token is forbidden."""
        bits = self._bits.get(masks.device)
        if bits is None:
            bits = self._bits[masks.device] = _BITS.to(masks.device)
        n = masks.shape[0]
        as_bytes = masks.view(torch.uint8)
        return ((as_bytes.unsqueeze(-1) & bits) == 0).view(n, -1)[:, :vocab]
