"""``POST /v1/completions``: prompts (text or token ids) → text, with ``echo`` and the
completions logprobs shape (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qil_worker.service.errors import invalid
from qil_worker.service.front_request import FrontRequest
from qil_worker.service.http.params import CallParams, completion_params
from qil_worker.service.http.shapes import completion_logprobs, finish_reason, output_text

if TYPE_CHECKING:
    from qil_worker.service.http.site import HttpContext


@dataclass
class CompletionState:
    n: int
    echo: list[str] | None  # the prompt texts, when echoed
    sent: dict[int, int] = field(default_factory=dict)  # choice → characters streamed so far


class Completions:
    chat = False
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def parse(self, body: dict) -> CallParams:
        return completion_params(body)

    async def prepare(self, ctx: "HttpContext", params: CallParams) -> CompletionState:
        echo = None
        if params.echo:
            if params.top_logprobs is not None:
                raise invalid("echo", "echo with logprobs needs prompt logprobs, which this server does not compute yet")
            has_text = ctx.front.info is None or ctx.front.info.has_tokenizer
            echo = [
                p.text if p.text is not None
                else (await ctx.front.detokenize(p.token_ids or [], False) if has_text else "")
                for p in params.prompts
            ]
        return CompletionState(params.n, echo)

    def opening_chunks(self, state: CompletionState, count: int) -> list[dict]:
        return []

    def _echo(self, state: CompletionState, index: int) -> str:
        return state.echo[index // state.n] if state.echo is not None else ""

    def chunk_choice(self, state: CompletionState, index: int, req: FrontRequest, start: int, end: int,
                     strings: dict[int, str] | None) -> dict:
        prefix = self._echo(state, index) if index not in state.sent else ""
        before = state.sent.get(index, 0)
        text = prefix + output_text(req, start, end)
        state.sent[index] = before + len(text)
        logprobs = None
        if strings is not None:
            logprobs = completion_logprobs(req, start, end, strings, before + len(prefix))
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(req)}

    def full_choice(self, state: CompletionState, index: int, req: FrontRequest,
                    strings: dict[int, str] | None) -> dict:
        echo = self._echo(state, index)
        logprobs = None
        if strings is not None:
            logprobs = completion_logprobs(req, 0, len(req.tokens), strings, len(echo))
        return {"index": index, "text": echo + output_text(req, 0, len(req.tokens)),
                "logprobs": logprobs, "finish_reason": finish_reason(req)}
