"""A request's streamed text: incremental detokenization followed by stop-string matching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qil_worker.text.detokenizer import IncrementalDetokenizer, joined, keep
from qil_worker.text.stop_strings import StopStringMatcher


class TextOutput:
    def __init__(
        self,
        tokenizer: Any,
        stop_strings: Sequence[str] = (),
        include_stop_string: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._matcher = StopStringMatcher(stop_strings, include_stop_string)
        self._released: list[str] = []  # the deltas released so far (``text`` joins them)
        self.matched_stop: str | None = None  # the stop string the text ended at, once it did

    @property
    def text(self) -> str:
        """All text released so far."""
        return joined(self._released)

    def push(self, token_id: int) -> str:
        matcher = self._matcher
        delta = matcher.feed(self._detokenizer.push(token_id))
        self.matched_stop = matcher.matched
        keep(self._released, delta)
        return delta

    def finish(self) -> str:
        matcher = self._matcher
        delta = matcher.feed(self._detokenizer.finish()) + matcher.flush()
        self.matched_stop = matcher.matched
        keep(self._released, delta)
        return delta
