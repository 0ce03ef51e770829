"""The grammar stage of the sampler: one bitmask for all constrained rows of a step, applied in
one masked fill to those rows only."""

from __future__ import annotations

import concurrent.futures

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
    """A persistent int32 buffer [rows, ceil(vocab / 32)] the matchers fill each step.

    With ``overlap``, ``prepare`` starts the fill on a helper thread while the step's forward
    runs (a mask depends only on the tokens already accepted, and llguidance releases the GIL);
    ``apply`` then waits for it. That pays where the host idles during the forward (CUDA); on a
    CPU the forward already occupies every core, so the engine fills inline there
    (docs/performance.md, "Structured output"). Without ``prepare``, ``apply`` fills inline.
    """

    def __init__(self, overlap: bool = False) -> None:
        self.overlap = overlap
        self._buffer = torch.empty(0, 0, dtype=torch.int32)
        self._biases: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: tuple[list[ConstraintMatcher], concurrent.futures.Future] | None = None

    def prepare(self, matchers: list[ConstraintMatcher | None], vocab: int) -> None:
        """Start filling the masks of the rows about to be sampled (None: unconstrained rows)."""
        self._settle()
        if not self.overlap:
            return
        constrained = [m for m in matchers if m is not None]
        masks = self._rows(len(constrained), (vocab + 31) // 32)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qil-grammar-masks")
        self._pending = (constrained, self._pool.submit(self._fill, masks, constrained))

    def apply(self, logits: torch.Tensor, matchers: list[ConstraintMatcher | None]) -> torch.Tensor:
        """Make every token the grammar of row i forbids -inf, in place (rows whose matcher is None
        are left alone); returns ``logits``. ``logits`` [rows, vocab] float, the step's own."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        constrained = [matchers[i] for i in rows]
        vocab = logits.shape[1]
        masks = self._prepared(constrained, (vocab + 31) // 32)
        if masks is None:
            masks = self._fill(self._rows(len(constrained), (vocab + 31) // 32), constrained)
        bias = self._biases_of(masks.to(logits.device, non_blocking=True), vocab, logits.dtype)
        with torch.inference_mode():  # the model's logits are inference tensors
            if len(rows) == len(matchers):
                logits += bias
            else:
                index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
                logits.index_copy_(0, index, logits.index_select(0, index).add_(bias))
        return logits

    def _prepared(self, matchers: list[ConstraintMatcher], words: int) -> torch.Tensor | None:
        """The masks ``prepare`` filled, if it was for exactly these matchers and this width."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        prepared, future = pending
        masks = future.result()
        same = len(prepared) == len(matchers) and all(a is b for a, b in zip(prepared, matchers))
        return masks if same and masks.shape[1] == words else None

    def _settle(self) -> None:
        """Wait for a fill still running (a step that failed after ``prepare``): the buffer is reused."""
        pending, self._pending = self._pending, None
        if pending is not None:
            concurrent.futures.wait([pending[1]])

    def _rows(self, n: int, words: int) -> torch.Tensor:
        if self._buffer.shape[0] < n or self._buffer.shape[1] != words:
            rows = max(n, 2 * self._buffer.shape[0]) if self._buffer.shape[1] == words else n
            self._buffer = torch.empty(rows, words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        return self._buffer[:n]

    @staticmethod
    def _fill(masks: torch.Tensor, matchers: list[ConstraintMatcher]) -> torch.Tensor:
        row_bytes = masks.shape[1] * 4
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
