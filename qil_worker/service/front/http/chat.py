"""``POST /v1/chat/completions``: ``messages`` through the model's chat template → an
assistant message, with the chat logprobs shape; streamed, each choice's first chunk carries
the role."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qil_worker.service.errors import invalid
from qil_worker.service.front.request_log import FrontRequest, SampleEnd
from qil_worker.service.front.http.params import CallParams, Prompt, chat_params
from qil_worker.service.front.http.shapes import chat_logprobs, finish_reason, output_text

if TYPE_CHECKING:
    from qil_worker.service.front.http.context import HttpContext


async def fill_context(ctx: "HttpContext", params: CallParams) -> None:
    """No max tokens given: the API's default is the rest of the context, which needs the
    prompt's length; so the messages are tokenized first and the ids submitted."""
    front = ctx.front
    prompt = params.prompts[0]
    thinking = params.options.pop("enable_thinking", None)
    ids = await front.tokenize(None, prompt.messages, thinking)
    info = front.info
    limit = info.max_position_embeddings if info is not None else 0
    if info is not None and front.stats.pages_total:
        # the last output token needs no KV slot
        limit = min(limit, front.stats.pages_total * info.page_size + 1)
    room = limit - len(ids)
    if room < 1:
        raise invalid("messages", f"the prompt ({len(ids)} tokens) leaves no room for output "
                      f"within the model's context ({limit} tokens)")
    params.prompts = [Prompt(token_ids=ids)]
    params.max_new_tokens = room


class Chat:
    chat = True
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def parse(self, body: dict) -> CallParams:
        return chat_params(body)

    async def prepare(self, ctx: "HttpContext", params: CallParams) -> None:
        if params.max_new_tokens is None:
            await fill_context(ctx, params)

    def opening_chunks(self, state: None, count: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(count)]

    def chunk_choice(self, state: None, index: int, req: FrontRequest, positions: list[int],
                     end: SampleEnd | None, strings: dict[int, str] | None) -> dict | None:
        text = output_text(req, positions, end)
        logprobs = chat_logprobs(req, positions, strings) if strings is not None else None
        reason = finish_reason(end)
        if not text and logprobs is None and reason is None and req.texts is not None:
            # tokens that released no text yet (a held-back stop string, say); without a
            # tokenizer, never: there each empty chunk says a token came
            return None
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": reason}

    def full_choice(self, state: None, index: int, req: FrontRequest, positions: list[int],
                    end: SampleEnd | None, strings: dict[int, str] | None) -> dict:
        return {"index": index,
                "message": {"role": "assistant", "content": output_text(req, positions, end), "refusal": None},
                "logprobs": chat_logprobs(req, positions, strings) if strings is not None else None,
                "finish_reason": finish_reason(end)}
