"""Stop strings over streamed text, also when one spans several tokens.

Text that might be the start of a stop string is held back until the next delta settles it, so
a stream never shows part of a stop string it will then have to take back.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_stop_string: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include_stop_string
        self._longest = max((len(s) for s in self.stops), default=0)
        # what ``_held_suffix`` looks for: every start of a stop string that a suffix of up to
        # ``longest - 1`` characters can be, and the last characters of those
        self._starts = frozenset(s[:k] for s in self.stops for k in range(1, min(len(s), self._longest - 1) + 1))
        self._start_ends = frozenset(start[-1] for start in self._starts)
        self._text = ""
        self._released = 0
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add text; return what may be shown now. After a match, ``matched`` is set."""
        if self.matched is not None or not delta:
            # no new text: a match in it would have been found before, and the same suffix
            # is held back
            return ""
        if not self.stops:  # nothing to match or hold back
            return delta
        text = self._text
        search_from = len(text) - self._longest + 1
        if search_from < 0:
            search_from = 0
        text += delta
        self._text = text
        hit_at, hit = len(text) + 1, None
        for stop in self.stops:
            at = text.find(stop, search_from)
            if at != -1 and at < hit_at:
                hit_at, hit = at, stop
        released = self._released
        if hit is not None:
            self.matched = hit
            end = hit_at + len(hit) if self.include else hit_at
        else:
            end = len(text) - self._held_suffix(text, released)
        if end <= released:
            return ""
        self._released = end
        return text[released:end]

    def flush(self) -> str:
        """At the end: release what was held back (unless a stop string ended the text)."""
        return "" if self.matched is not None else self._release(len(self._text))

    def _held_suffix(self, text: str, released: int) -> int:
        """The length of the longest suffix (under the longest stop string's) that starts a
        stop string. It lies in the text not released yet: a longer one would have started with
        a longer such suffix of the text before the last delta, which was held back instead."""
        if len(text) == released or text[-1] not in self._start_ends:
            return 0
        starts = self._starts
        for k in range(min(self._longest - 1, len(text) - released), 0, -1):
            if text[-k:] in starts:
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._released)
        out = self._text[self._released : end]
        self._released = end
        return out
