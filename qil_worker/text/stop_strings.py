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
        self._text = ""
        self._released = 0
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add text; return what may be shown now. After a match, ``matched`` is set."""
        if self.matched is not None:
            return ""
        search_from = max(0, len(self._text) - self._longest + 1)
        self._text += delta
        hit_at, hit = len(self._text) + 1, None
        for stop in self.stops:
            at = self._text.find(stop, search_from)
            if at != -1 and at < hit_at:
                hit_at, hit = at, stop
        if hit is not None:
            self.matched = hit
            end = hit_at + len(hit) if self.include else hit_at
            return self._release(end)
        return self._release(len(self._text) - self._held_suffix())

    def flush(self) -> str:
        """At the end: release what was held back (unless a stop string ended the text)."""
        return "" if self.matched is not None else self._release(len(self._text))

    def _held_suffix(self) -> int:
        for k in range(min(self._longest - 1, len(self._text)), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._released)
        out = self._text[self._released : end]
        self._released = end
        return out
