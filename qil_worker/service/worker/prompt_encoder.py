"""Long text and chat prompts tokenized on a thread beside the worker's step loop.

Tokenizing is fast for ordinary prompts but grows with the text: a prompt of millions of
characters (still under the 16 MiB message limit) takes seconds, and encoded in the step loop
it would stall every other stream that long. The tokenizer releases the GIL while it works, so
on a thread the loop steps on meanwhile (docs/performance.md has the figures). Prompts up to
``INLINE_CHARS`` characters (a few ms to tokenize) are still encoded in the loop, in order, so
one huge prompt on the thread delays no ordinary request. A long prompt's request is
acknowledged to the front when it is encoded and the engine accepted it; a cancel that arrives
before then ends it right after.

The same thread answers long tokenizer calls (``Tokenize`` / ``Detokenize``, see
``tokenizer_calls``): one queue, in arrival order, so neither kind overtakes the other and the
loop waits on one set of futures. A call's answer needs no cancel: the front drops it when its
caller is gone.

A prompt that cannot fit (the model's positions or the whole KV pool, less ``max_new_tokens``)
is refused as soon as that is certain (``prompt.encode_text``), not after encoding all of it; so
is a Tokenize of more tokens than the model's positions.

The thread and the waiting submits are ``beside_loop``'s.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Callable

from qil_worker.engine.spec import RequestSpec
from qil_worker.freed_memory import OUTSIZED_CHARS
from qil_worker.service.protocol import Detokenize, Tokenize
from qil_worker.service.worker.beside_loop import Pending, SideThread, WaitingSubmits, wait_any
from qil_worker.service.worker.tokenizer_calls import INLINE_IDS
from qil_worker.text.prompt import PromptRoom, PromptTooLong, encode_prompt, prompt_chars

INLINE_CHARS = 16384  # prompts up to this long are tokenized in the step loop


def encode_within(tokenizer: Any, spec: RequestSpec, room: PromptRoom) -> list[int]:
    """A submit's text or chat prompt as ids, refused (``CapacityError``) as soon as it cannot
    fit ``room``."""
    prompt, max_new_tokens = spec.prompt, spec.max_new_tokens
    try:
        return encode_prompt(tokenizer, prompt.text, prompt.messages, prompt.enable_thinking,
                             room.max_prompt(max_new_tokens), prompt.tools, document=spec.embeds)
    except PromptTooLong as too_long:
        raise room.refusal(too_long, max_new_tokens, prompt.field) from None


class PromptEncoder:
    def __init__(self, tokenizer: Any, room: PromptRoom | None = None) -> None:
        self._tokenizer = tokenizer
        self._room = room or PromptRoom()
        self._thread = SideThread("qil-tokenize")
        self._waiting = WaitingSubmits()  # submits whose prompt is still text or messages
        self._calls: list[Future] = []  # tokenizer calls under way, in arrival order
        self._outsized = 0  # outsized jobs (``freed_memory.OUTSIZED_CHARS``) not yet all done

    def takes(self, spec: RequestSpec) -> bool:
        """Whether a submit's prompt is text or messages longer than ``INLINE_CHARS`` that this
        encoder can tokenize (the engine refuses text without a tokenizer, or malformed
        messages, with its own clear error)."""
        if self._tokenizer is None:
            return False
        return prompt_chars(spec.prompt.text, spec.prompt.messages) > INLINE_CHARS

    def take_outsized(self) -> bool:
        """Whether outsized jobs ran since the last call and none is left: the moment to give
        their memory back."""
        if not self._outsized or self.busy:
            return False
        self._outsized = 0
        return True

    def takes_call(self, call: Tokenize | Detokenize) -> bool:
        """Whether a tokenizer call is long enough for the thread (a text as ``takes``
        counts it, or more than ``INLINE_IDS`` ids to decode)."""
        if self._tokenizer is None:
            return False
        if isinstance(call, Tokenize):
            return prompt_chars(call.text, call.messages) > INLINE_CHARS
        return len(call.token_ids) > INLINE_IDS

    def start(self, submit: Pending) -> None:
        """Begin encoding the prompt of a submit given as text or messages."""
        encoded = self._thread.run(encode_within, self._tokenizer, submit.spec, self._room)
        self._waiting.add(submit, encoded)
        prompt = submit.spec.prompt
        self._outsized += prompt_chars(prompt.text, prompt.messages) >= OUTSIZED_CHARS

    def start_call(self, answer: Callable[..., Any], *args: Any) -> None:
        """Run ``answer(*args)``, a tokenizer call's (``tokenizer_calls``; it never raises), on
        the thread; its result comes out of ``answers``."""
        self._calls.append(self._thread.run(answer, *args))
        call = args[-1]
        size = (prompt_chars(call.text, call.messages) if isinstance(call, Tokenize)
                else len(call.token_ids) if isinstance(call, Detokenize) else 0)
        self._outsized += size >= OUTSIZED_CHARS

    def cancel(self, rid: str) -> bool:
        """A cancel for a request still being encoded: it ends as soon as it is submitted."""
        return self._waiting.cancel(rid)

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or bool(self._calls)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` for an encoding or a call to finish; whether one has."""
        return wait_any(self._waiting.futures() + self._calls, timeout)

    def answers(self) -> list[Any]:
        """The answers of the tokenizer calls done since the last call, in arrival order."""
        done, running = [], []
        for f in self._calls:  # (each future asked once: one may finish meanwhile)
            (done if f.done() else running).append(f)
        self._calls = running
        return [f.result() for f in done]

    def finished(self) -> list[tuple[Pending, BaseException | None, bool]]:
        """``(submit, error, cancelled)`` for every prompt done since the last call, in
        submission order: the submit with its prompt as token ids (the original when encoding
        raised ``error``), and whether a cancel came meanwhile."""
        def prepared(submit: Pending, token_ids: list[int]) -> Pending:
            spec = submit.spec
            return dataclasses.replace(submit, spec=spec.with_prompt(spec.prompt.encoded(token_ids)))

        return self._waiting.finished(prepared)

    def close(self) -> None:
        """Drop what is still queued; an encode under way is abandoned with its daemon thread."""
        self._waiting.drop()
        for call in self._calls:
            call.cancel()
        self._thread.close()
