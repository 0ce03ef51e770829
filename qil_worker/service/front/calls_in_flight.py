"""The front's table of tokenizer calls (Tokenize / Detokenize) waiting for the worker's answer.

Each call gets a fresh id and a future; the worker's answer carries the id back. The caller
removes its entry when it stops waiting, answered or not (a deadline, a cancelled RPC), so an
answer that comes later finds nothing and is dropped, and nothing is left behind. A dead worker
fails every entry at once.
"""

from __future__ import annotations

import asyncio
import itertools

from qil_worker.service import protocol as P
from qil_worker.service.errors import ServiceError

Answer = P.Tokenized | P.Detokenized


class CallsInFlight:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Answer]] = {}

    def __len__(self) -> int:
        """Calls sent to the worker whose caller still waits."""
        return len(self._waiting)

    def open(self) -> tuple[int, asyncio.Future[Answer]]:
        call_id = next(self._ids)
        answered = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = answered
        return call_id, answered

    def close(self, call_id: int) -> None:
        """The caller stopped waiting (answered, failed or gone)."""
        self._waiting.pop(call_id, None)

    def answer(self, answer: Answer) -> None:
        answered = self._waiting.get(answer.call_id)
        if answered is not None and not answered.done():
            answered.set_result(answer)

    def fail_all(self, error: ServiceError) -> None:
        """The worker died: no call will be answered."""
        for answered in self._waiting.values():
            if not answered.done():
                answered.set_exception(error)
