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
        self.matched_stop: str | None = None  # the stop string the text ended at, once it did

    def push(self, token_id: int) -> str:
        matcher = self._matcher
        delta = matcher.feed(self._detokenizer.push(token_id))
        self.matched_stop = matcher.matched
        self.text += delta
        return delta

    def finish(self) -> str:
        matcher = self._matcher
        delta = matcher.feed(self._detokenizer.finish()) + matcher.flush()
        self.matched_stop = matcher.matched
        self.text += delta
        return delta
