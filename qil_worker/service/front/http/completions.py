"""``POST /v1/completions``: prompts (text or token ids) → text, with ``echo`` (and, with
logprobs, the prompt's own logprobs: ``prompt_logprobs``; ``max_tokens: 0`` then scores a
prompt without generating, as lm-eval's loglikelihood asks) and the completions logprobs shape
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qil_worker.service.front.request_log import FrontRequest, SampleEnd
from qil_worker.service.front.http.params import CallParams, Prompt, completion_params
from qil_worker.service.front.http.shapes import completion_logprobs, finish_reason, output_text, prompt_part

if TYPE_CHECKING:
    from qil_worker.service.front.http.context import HttpContext


@dataclass
class CompletionState:
    n: int
    echo: list[str] | None  # the prompt texts, when echoed
    hide_output: bool
    prompt_ids: list[list[int]] | None = None  # echoed with logprobs: each prompt's ids...
    prompt_strings: dict[int, str] = field(default_factory=dict)  # ...and their strings
    sent: dict[int, int] = field(default_factory=dict)  # choice → characters streamed so far


class Completions:
    chat = False
    id_prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def parse(self, body: dict) -> CallParams:
        return completion_params(body)

    async def prepare(self, ctx: "HttpContext", params: CallParams) -> CompletionState:
        state = CompletionState(params.n, None, params.hide_output)
        if not params.echo:
            return state
        front = ctx.front
        if params.top_logprobs is not None:
            # the prompt's tokens are scored one by one: their ids are needed here, so text
            # prompts are tokenized first (as the submit would) and submitted as ids
            ids = [p.token_ids if p.token_ids is not None else await front.tokenize(p.text, None, None)
                   for p in params.prompts]
            state.prompt_ids = ids
            state.prompt_strings = await ctx.token_strings.of({t for p in ids for t in p})
        has_text = front.info is None or front.info.has_tokenizer
        state.echo = [
            p.text if p.text is not None
            else (await front.detokenize(p.token_ids or [], False) if has_text else "")
            for p in params.prompts
        ]
        if state.prompt_ids is not None:
            params.prompts = [Prompt(token_ids=ids) for ids in state.prompt_ids]
        return state

    def opening_chunks(self, state: CompletionState, count: int) -> list[dict]:
        return []

    def _echo(self, state: CompletionState, index: int) -> str:
        return state.echo[index // state.n] if state.echo is not None else ""

    def _prompt_part(self, state: CompletionState, index: int, req: FrontRequest, strings: dict[int, str]):
        if state.prompt_ids is None:
            return None
        return prompt_part(state.prompt_ids[index // state.n], req, {**state.prompt_strings, **strings})

    def chunk_choice(self, state: CompletionState, index: int, req: FrontRequest, positions: list[int],
                     end: SampleEnd | None, strings: dict[int, str] | None) -> dict | None:
        first = index not in state.sent
        prefix = self._echo(state, index) if first else ""
        if state.hide_output:
            positions = []
        before = state.sent.get(index, 0)
        text = prefix + ("" if state.hide_output else output_text(req, positions, end))
        state.sent[index] = before + len(text)
        logprobs = None
        if strings is not None:
            prompt = self._prompt_part(state, index, req, strings) if first else None
            logprobs = completion_logprobs(req, positions, strings, before + len(prefix), prompt)
        reason = finish_reason(end)
        if not text and logprobs is None and reason is None and req.texts is not None:
            return None  # tokens that released no text yet (without a tokenizer: never)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def full_choice(self, state: CompletionState, index: int, req: FrontRequest, positions: list[int],
                    end: SampleEnd | None, strings: dict[int, str] | None) -> dict:
        echo = self._echo(state, index)
        if state.hide_output:
            positions = []
        text = echo + ("" if state.hide_output else output_text(req, positions, end))
        logprobs = None
        if strings is not None:
            logprobs = completion_logprobs(req, positions, strings, len(echo), self._prompt_part(state, index, req, strings))
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(end)}

    def reasoning_tokens(self, reqs: list[FrontRequest]) -> int | None:
        return None  # a completion's text is not split
