"""vLLM's tokenizer routes beside the API (``POST /tokenize``, ``POST /detokenize``, ``GET
/tokenizer_info``), which tools that count or score tokens remotely look for (lm-eval's remote
tokenizer, say): over the front's Tokenize and Detokenize, so ids are exactly a submit's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from qil_worker.service.errors import HttpError, ServiceError, invalid, unknown_model
from qil_worker.service.front.http.body import read_body
from qil_worker.service.front.http.params import chat_messages, chat_tools, token_ids_of, thinking_of
from qil_worker.service.front.http.sse import dumps

if TYPE_CHECKING:
    from qil_worker.service.front.http.context import HttpContext


def check_model(ctx: "HttpContext", body: dict) -> None:
    model = body.get("model")
    if model is not None and model != ctx.model_name:
        raise unknown_model(str(model), ctx.model_name)


def _tokenizer_needed(ctx: "HttpContext", field: str) -> None:
    info = ctx.front.info
    if info is not None and not info.has_tokenizer:
        raise invalid(field, "this server has no tokenizer (it serves token ids only)")


async def tokenize(ctx: "HttpContext", request: web.Request) -> web.Response:
    """``{"prompt": text}`` or ``{"messages": [...]}`` (with ``chat_template_kwargs`` and
    ``tools``, checked as a chat call's, so the count is its ``prompt_tokens``) →
    ``{"count", "max_model_len", "tokens", "token_strs"}``; ``add_special_tokens`` is accepted
    and changes nothing (a Qwen3 tokenizer adds none to a text)."""
    body = await read_body(request)
    check_model(ctx, body)
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise invalid("prompt", "give prompt (a string) or messages, not both and not neither")
    if prompt is not None and not isinstance(prompt, str):
        raise invalid("prompt", "must be a string")
    for name in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise invalid(name, "must be a boolean")
    field = "prompt" if prompt is not None else "messages"
    _tokenizer_needed(ctx, field)
    chat = chat_messages(body) if messages is not None else None
    tools = chat_tools(body)
    if tools is not None and chat is None:
        raise invalid("tools", "need a chat prompt (messages)")
    try:
        ids = await ctx.front.tokenize(prompt or None, chat, thinking_of(body) if chat else None, tools)
    except ServiceError as err:
        if err.field in ("text", "messages"):
            err.field = field
        raise
    strings = None
    if body.get("return_token_strs"):
        known = await ctx.token_strings.of(ids)
        strings = [known[t] for t in ids]
    info = ctx.front.info
    return web.json_response({
        "count": len(ids), "max_model_len": info.max_position_embeddings if info is not None else 0,
        "tokens": ids, "token_strs": strings,
    }, dumps=dumps)


async def detokenize(ctx: "HttpContext", request: web.Request) -> web.Response:
    """``{"tokens": [ids]}`` → ``{"prompt": text}`` (special tokens kept: the exact text)."""
    body = await read_body(request)
    check_model(ctx, body)
    ids = token_ids_of(body.get("tokens"))
    if ids is None:
        raise invalid("tokens", "must be an array of token ids")
    _tokenizer_needed(ctx, "tokens")
    try:
        text = await ctx.front.detokenize(ids, False)
    except ServiceError as err:
        if err.field == "token_ids":
            err.field = "tokens"
        raise
    return web.json_response({"prompt": text}, dumps=dumps)


async def tokenizer_info(ctx: "HttpContext", request: web.Request) -> web.Response:
    """The tokenizer's class, special tokens and chat template (404 without a tokenizer)."""
    info = ctx.front.info
    if info is None or not info.tokenizer_summary:
        raise HttpError(404, "not_found_error", "this server has no tokenizer (it serves token ids only)")
    return web.json_response(info.tokenizer_summary, dumps=dumps)
