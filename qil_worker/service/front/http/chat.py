"""``POST /v1/chat/completions``: ``messages`` (and ``tools``) through the model's chat
template → an assistant message (reasoning, content and tool calls: ``assistant_message``), with
the chat logprobs shape; streamed, each choice's first chunk carries the role."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qil_worker.service.errors import invalid
from qil_worker.service.front.request_log import FrontRequest, SampleEnd
from qil_worker.service.front.http.params import CallParams, chat_params
from qil_worker.service.front.http.assistant_message import StreamedMessage, message_of, reasoning_tokens
from qil_worker.service.front.http.shapes import by_sample, chat_logprobs, finish_reason, output_text

if TYPE_CHECKING:
    from qil_worker.service.front.http.context import HttpContext


async def fill_context(ctx: "HttpContext", params: CallParams) -> None:
    """No max tokens given: the API's default is the rest of the context, which needs the
    prompt's length; so the messages are tokenized first. They are still submitted as
    messages: the spec knows a chat prompt (its output split, its constraint after thinking)."""
    front = ctx.front
    prompt = params.prompts[0]
    thinking = params.options.get("enable_thinking")
    ids = await front.tokenize(None, prompt.messages, thinking, params.options.get("tools"))
    info = front.info
    limit = info.max_position_embeddings if info is not None else 0
    if info is not None and front.stats.pages_total:
        # the last output token needs no KV slot
        limit = min(limit, front.stats.pages_total * info.page_size + 1)
    room = limit - len(ids)
    if room < 1:
        raise invalid("messages", f"the prompt ({len(ids)} tokens) leaves no room for output "
                      f"within the model's context ({limit} tokens)")
    params.max_new_tokens = room


@dataclass
class ChatState:
    """One call's: whether its output's tool-call blocks are calls, and each streamed choice's
    message so far."""

    tools: bool
    streams: dict[int, StreamedMessage] = field(default_factory=dict)

    def stream(self, index: int) -> StreamedMessage:
        if index not in self.streams:
            self.streams[index] = StreamedMessage(self.tools)
        return self.streams[index]


class Chat:
    chat = True
    id_prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def parse(self, body: dict) -> CallParams:
        return chat_params(body)

    async def prepare(self, ctx: "HttpContext", params: CallParams) -> ChatState:
        if params.max_new_tokens is None:
            await fill_context(ctx, params)
        return ChatState(params.tools is not None and params.tools.calls_parsed)

    def opening_chunks(self, state: ChatState, count: int) -> list[dict]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(count)]

    def chunk_choice(self, state: ChatState, index: int, req: FrontRequest, positions: list[int],
                     end: SampleEnd | None, strings: dict[int, str] | None) -> dict | None:
        stream = state.stream(index)
        delta = stream.delta(output_text(req, positions, end), end is not None)
        logprobs = chat_logprobs(req, positions, strings) if strings is not None else None
        reason = stream.reason(finish_reason(end))
        if not delta and logprobs is None and reason is None and req.texts is not None:
            # tokens that released no text yet (a held-back stop string or tag, say); without
            # a tokenizer, never: there each empty chunk says a token came
            return None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def full_choice(self, state: ChatState, index: int, req: FrontRequest, positions: list[int],
                    end: SampleEnd | None, strings: dict[int, str] | None) -> dict:
        message, reason = message_of(output_text(req, positions, end), state.tools, finish_reason(end))
        return {"index": index, "message": message,
                "logprobs": chat_logprobs(req, positions, strings) if strings is not None else None,
                "finish_reason": reason}

    def reasoning_tokens(self, reqs: list[FrontRequest]) -> int | None:
        """The reasoning tokens of every sample of ``reqs`` (for usage)."""
        if any(r.texts is None for r in reqs):
            return None
        return sum(reasoning_tokens([r.texts[i] for i in positions])
                   for r in reqs for positions in by_sample(r, 0, len(r.tokens)).values())
