"""Token ids → their strings, for the ``tokens`` and ``top_logprobs`` of logprobs answers.

The front holds no tokenizer (it lives in the worker), so the strings come from the worker's
Detokenize, one id per call (a joined decode loses the boundaries), and are kept: a vocabulary
is at most a few hundred thousand short strings, and a logprobs caller asks for the same
frequent ids again and again. Without a tokenizer a token is written ``token_id:N`` (vLLM's
spelling of the same case).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from qil_worker.service.front.front import Front

# more than any vocabulary qil serves: the cache never grows past the model's ids
MAX_CACHED = 1 << 20


class TokenStrings:
    def __init__(self, front: "Front") -> None:
        self.front = front
        self._known: dict[int, str] = {}

    async def of(self, ids: Iterable[int]) -> dict[int, str]:
        """The string of each id."""
        wanted = set(ids)
        info = self.front.info
        if info is not None and not info.has_tokenizer:
            return {t: f"token_id:{t}" for t in wanted}
        missing = sorted(wanted.difference(self._known))
        if missing:
            texts = await asyncio.gather(*(self.front.detokenize([t], False) for t in missing))
            if len(self._known) + len(missing) <= MAX_CACHED:
                self._known.update(zip(missing, texts))
            else:
                return {**{t: self._known[t] for t in wanted if t in self._known}, **dict(zip(missing, texts))}
        return {t: self._known[t] for t in wanted}
