"""Stop strings over streamed text, also when one spans several tokens.

Text that might be the start of a stop string is held back until the next delta settles it, so
a stream never shows part of a stop string it will then have to take back.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Only the text not released yet is kept (shorter than the longest stop string): a stop
    string can start nowhere before it, since the text released never ends in the start of a
    stop string, and one wholly inside the released text was found when it appeared."""

    def __init__(self, stops: Sequence[str], include_stop_string: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include_stop_string
        self._longest = max((len(s) for s in self.stops), default=0)
        # what ``_held_suffix`` looks for: every start of a stop string that a suffix of up to
        # ``longest - 1`` characters can be, and the last characters of those
        self._starts = frozenset(s[:k] for s in self.stops for k in range(1, min(len(s), self._longest - 1) + 1))
        self._start_ends = frozenset(start[-1] for start in self._starts)
        self._pending = ""  # the text held back: it may be the start of a stop string
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        """Add text; return what may be shown now. After a match, ``matched`` is set."""
        if self.matched is not None or not delta:
            # no new text: a match in it would have been found before, and the same suffix
            # is held back
            return ""
        if not self.stops:  # nothing to match or hold back
            return delta
        text = self._pending + delta
        hit_at, hit = len(text) + 1, None
        for stop in self.stops:
            at = text.find(stop)
            if at != -1 and at < hit_at:
                hit_at, hit = at, stop
        if hit is not None:
            self.matched = hit
            self._pending = ""
            return text[: hit_at + len(hit) if self.include else hit_at]
        held = self._held_suffix(text)
        self._pending = text[len(text) - held :] if held else ""
        return text[: len(text) - held]

    def flush(self) -> str:
        """At the end: release what was held back (unless a stop string ended the text)."""
        out, self._pending = self._pending, ""
        return "" if self.matched is not None else out

    def _held_suffix(self, text: str) -> int:
        """The length of the longest suffix of ``text`` (the pending text and the new delta;
        under the longest stop string's) that starts a stop string: a longer one would have
        started with a longer such suffix of the text before the delta, held back instead."""
        if text[-1] not in self._start_ends:
            return 0
        starts = self._starts
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            if text[-k:] in starts:
                return k
        return 0
