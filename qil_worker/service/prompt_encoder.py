"""Long text and chat prompts tokenized on a thread beside the worker's step loop.

Tokenizing is fast for ordinary prompts but grows with the text: a prompt of millions of
characters (still under the 16 MiB message limit) takes seconds, and encoded in the step loop
it would stall every other stream that long. The tokenizer releases the GIL while it works, so
on a thread the loop steps on meanwhile (docs/performance.md has the figures). Prompts up to
``INLINE_CHARS`` characters (a few ms to tokenize) are still encoded in the loop, in order, so
one huge prompt on the thread delays no ordinary request. A long prompt's request is
acknowledged to the front when it is encoded and the engine accepted it; a cancel that arrives
before then ends it right after.

The thread is a daemon: a worker told to stop exits at once instead of waiting for an encode
nobody will use (a 16 MiB prompt takes many seconds). ``ThreadPoolExecutor``'s threads are
joined when the process exits, so it is not used here.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from qil_worker.service.protocol import Submit
from qil_worker.text.prompt import encode_prompt

PROMPT_OPTIONS = ("text", "messages", "enable_thinking")  # consumed by encoding
INLINE_CHARS = 16384  # prompts up to this long are tokenized in the step loop


@dataclass
class _Pending:
    submit: Submit  # prompt still as text or messages
    encoded: Future
    cancelled: bool = field(default=False)


class PromptEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._queue: queue.SimpleQueue[tuple[Future, tuple] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started on first use
        self._pending: dict[str, _Pending] = {}

    def takes(self, options: dict[str, Any]) -> bool:
        """Whether a submit's prompt is text or messages longer than ``INLINE_CHARS`` that this
        encoder can tokenize (the engine refuses text without a tokenizer, or malformed
        messages, with its own clear error)."""
        if self._tokenizer is None:
            return False
        text, messages = options.get("text"), options.get("messages")
        if isinstance(text, str):
            return len(text) > INLINE_CHARS
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            return sum(len(str(m.get("content", ""))) for m in messages) > INLINE_CHARS
        return False

    def start(self, submit: Submit) -> None:
        """Begin encoding the prompt of a ``Submit`` given as text or messages."""
        options = submit.options
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="qil-tokenize", daemon=True)
            self._thread.start()
        encoded: Future = Future()
        self._queue.put((encoded, (options.get("text"), options.get("messages"), options.get("enable_thinking"))))
        self._pending[submit.request_id] = _Pending(submit, encoded)

    def _run(self) -> None:
        """The encoding thread: one prompt at a time, in submission order, until ``close``."""
        while (item := self._queue.get()) is not None:
            encoded, (text, messages, enable_thinking) = item
            if not encoded.set_running_or_notify_cancel():
                continue
            try:
                encoded.set_result(encode_prompt(self._tokenizer, text, messages, enable_thinking))
            except BaseException as exc:  # noqa: BLE001 - handed to the loop with its submit
                encoded.set_exception(exc)

    def cancel(self, rid: str) -> bool:
        """A cancel for a request still being encoded: it ends as soon as it is submitted."""
        pending = self._pending.get(rid)
        if pending is None:
            return False
        pending.cancelled = True
        return True

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` for an encoding to finish; whether one has."""
        done, _ = wait([p.encoded for p in self._pending.values()], timeout, FIRST_COMPLETED)
        return bool(done)

    def finished(self) -> list[tuple[Submit, BaseException | None, bool]]:
        """``(submit, error, cancelled)`` for every prompt done since the last call, in
        submission order: the ``Submit`` with the prompt as token ids (the original when
        encoding raised ``error``), and whether a cancel came meanwhile."""
        done = []
        for rid, pending in list(self._pending.items()):
            if not pending.encoded.done():
                continue
            del self._pending[rid]
            error = pending.encoded.exception()
            submit = pending.submit
            if error is None:
                rest = {k: v for k, v in submit.options.items() if k not in PROMPT_OPTIONS}
                submit = dataclasses.replace(submit, token_ids=pending.encoded.result(), options=rest)
            done.append((submit, error, pending.cancelled))
        return done

    def close(self) -> None:
        """Drop what is still queued; an encode under way is abandoned with its daemon thread."""
        for pending in self._pending.values():
            pending.encoded.cancel()
        self._queue.put(None)
