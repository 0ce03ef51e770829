"""Token ids → text deltas that are always whole characters.

A character can span several byte-level tokens; decoding the newest tokens alone would show
U+FFFD halves. Each step decodes a short window (from the last point known to be a clean
boundary) and releases only the text past what that window produced before; while the window
ends in an incomplete character, only the whole characters before it are released (a token
such as b" \xc3" completes a space, and a stop string ending in it, at once). ``finish``
releases whatever is left, so the deltas concatenate to ``tokenizer.decode(all ids)``.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: a clean boundary
        self._read_offset = 0  # tokens up to here have been released as text
        self._early = 0  # characters of the window past its prefix, released before its end was whole
        self.text = ""  # everything released so far

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False
        )

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly empty)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        start = len(prefix) + self._early
        if window.endswith(REPLACEMENT):  # an incomplete character: release what precedes it
            whole = window.rstrip(REPLACEMENT)
            delta = whole[start:] if len(whole) > start else ""
            self._early += len(delta)
        elif len(window) <= start:
            return ""
        else:
            delta = window[start:]
            self._prefix_offset, self._read_offset, self._early = self._read_offset, len(self._ids), 0
        self.text += delta
        return delta

    def finish(self) -> str:
        """The text not yet released (e.g. a trailing incomplete character)."""
        full = self._decode(self._ids)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += rest
        return rest
