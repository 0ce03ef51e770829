"""A request's streamed text: incremental detokenization followed by stop-string matching."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qil_worker.text.detokenizer import IncrementalDetokenizer
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
        self.text = ""  # all text released so far

    @property
    def matched_stop(self) -> str | None:
        return self._matcher.matched

    def push(self, token_id: int) -> str:
        delta = self._matcher.feed(self._detokenizer.push(token_id))
        self.text += delta
        return delta

    def finish(self) -> str:
        return self._keep(self._matcher.feed(self._detokenizer.finish()) + self._matcher.flush())

    def _keep(self, delta: str) -> str:
        self.text += delta
        return delta
