"""Token ids → text deltas that are always whole characters.

A character can span several byte-level tokens; decoding the newest tokens alone would show
U+FFFD halves. Each step decodes a short window (from the last point known to be a clean
boundary) and releases only the text past what that window produced before; while the window
ends in an incomplete character, only the whole characters before it are released (a token
such as b" \xc3" completes a space, and a stop string ending in it, at once). ``finish``
releases whatever is left, so the deltas concatenate to ``tokenizer.decode(all ids)``.

With a tokenizer that decodes by joining per-id bytes (``token_bytes``) the same windows are
decoded from bytes kept as they grow, the prefix's text length only when the prefix moves, and
a token that is whole characters on a window that ends one is its own delta at once.
"""

from __future__ import annotations

from typing import Any

from qil_worker.text.token_bytes import token_bytes

REPLACEMENT = "\ufffd"


# released deltas are joined into one string every this many (what a list of them costs beside
# the string stays bounded; appending to one string would copy the whole text every time)
JOIN_EVERY = 64


def keep(parts: list[str], delta: str) -> None:
    """Add ``delta`` to the released ``parts``, joined every ``JOIN_EVERY``."""
    parts.append(delta)
    if len(parts) > JOIN_EVERY:
        joined(parts)


def joined(parts: list[str]) -> str:
    """The strings of ``parts`` as one, which ``parts`` then holds alone (read again: no join)."""
    if len(parts) != 1:
        parts[:] = ["".join(parts)]
    return parts[0]


def window_delta(window: str, start: int) -> tuple[str, bool] | None:
    """(the window's text past ``start`` to release now, whether the window ends a character),
    or None when it ends one and holds nothing past ``start``. Where it ends in an incomplete
    character, only the whole characters before it are released."""
    if window.endswith(REPLACEMENT):
        whole = window.rstrip(REPLACEMENT)
        return (whole[start:] if len(whole) > start else ""), False
    if len(window) <= start:
        return None
    return window[start:], True


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: a clean boundary
        self._read_offset = 0  # tokens up to here have been released as text
        self._early = 0  # characters of the window past its prefix, released before its end was whole
        self._released: list[str] = []  # the deltas released so far (``text`` joins them)
        # With a byte table: the window's bytes (ids from the prefix offset on), the length of
        # its prefix's bytes and text (ids up to the read offset), and whether every id is
        # released with the window valid UTF-8 (``push``'s shortcut).
        self._bytes = token_bytes(tokenizer, skip_special_tokens)
        self._window = b""
        self._prefix_bytes = 0
        self._prefix_chars = 0
        self._settled = True

    @property
    def text(self) -> str:
        """Everything released so far (kept as the deltas, joined when read: appending to one
        string would copy the whole text for every token)."""
        return joined(self._released)

    def _decode(self, ids: list[int]) -> str:
        if self._bytes is not None:
            text = self._bytes.decode(ids)
            if text is not None:
                return text
            self._bytes = None
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False
        )

    def push(self, token_id: int) -> str:
        """Add one token; return the new complete text (possibly empty)."""
        self._ids.append(token_id)
        table = self._bytes
        if table is not None:
            if self._settled:
                whole = table.whole.get(token_id)
                if whole is None:
                    whole = table.whole_text(token_id)
                if whole:
                    # every id is released and the window (its prefix) ends a character: the
                    # window's text is the prefix's, then this token's, all of it released
                    added = table.bytes_of(token_id)
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                    self._window, self._prefix_bytes, self._prefix_chars = added, len(added), len(whole)
                    keep(self._released, whole)
                    return whole
            added = table.bytes_of(token_id)
            if added is not None:
                if not added and self._settled:  # nothing to show, and the window is as it was
                    return ""
                return self._push_bytes(self._window + added)
            self._bytes = None  # the tokenizer decodes otherwise: ask it from now on
        return self._push_ids()

    def _push_bytes(self, window_bytes: bytes) -> str:
        """``_push_ids`` over the window's bytes."""
        self._settled = False
        self._window = window_bytes
        found = window_delta(window_bytes.decode("utf-8", "replace"), self._prefix_chars + self._early)
        if found is None:
            return ""
        delta, complete = found
        if not complete:
            self._early += len(delta)
        else:
            prefix = window_bytes[self._prefix_bytes :]
            try:
                chars, self._settled = len(prefix.decode("utf-8")), True
            except UnicodeDecodeError:
                chars = len(prefix.decode("utf-8", "replace"))
            self._advance(prefix, chars)
        keep(self._released, delta)
        return delta

    def _advance(self, prefix: bytes, chars: int) -> None:
        """Every id is released: the window starts at the read offset, the prefix is the rest."""
        self._prefix_offset, self._read_offset, self._early = self._read_offset, len(self._ids), 0
        self._window, self._prefix_bytes, self._prefix_chars = prefix, len(prefix), chars

    def _push_ids(self) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        found = window_delta(window, len(prefix) + self._early)
        if found is None:
            return ""
        delta, complete = found
        if not complete:
            self._early += len(delta)
        else:
            self._prefix_offset, self._read_offset, self._early = self._read_offset, len(self._ids), 0
        keep(self._released, delta)
        return delta

    def finish(self) -> str:
        """The text not yet released (e.g. a trailing incomplete character)."""
        full = self._decode(self._ids)
        text = self.text
        rest = full[len(text) :] if full.startswith(text) else ""
        keep(self._released, rest)
        return rest
