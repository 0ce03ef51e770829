"""Prompt text or chat messages → token ids, with the tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qil_worker.errors import InvalidRequestError, TokenizerUnavailableError

ROLES = ("system", "user", "assistant", "tool")


def encode_prompt(
    tokenizer: Any,
    text: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    enable_thinking: bool | None = None,
) -> list[int]:
    """Exactly one of ``text`` (encoded as is) or ``messages`` (rendered with the chat template).

    ``enable_thinking`` is Qwen3's switch for its reasoning block; None leaves the template's default.
    """
    if tokenizer is None:
        raise TokenizerUnavailableError(
            "this server has no tokenizer: send token ids instead of text",
            field="text" if text is not None else "messages",
        )
    if (text is None) == (messages is None):
        raise InvalidRequestError("prompt", "give exactly one of text or messages")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise InvalidRequestError("text", "must be a non-empty string")
        return list(tokenizer.encode(text, add_special_tokens=False))
    if not messages:
        raise InvalidRequestError("messages", "must hold at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise InvalidRequestError(
                f"messages[{i}]", f"needs a role in {list(ROLES)} and a string content"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise TokenizerUnavailableError(
            "the tokenizer has no chat template: send text or token ids", field="messages"
        )
    kwargs: dict[str, Any] = {"add_generation_prompt": True}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    try:
        rendered = tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - templates refuse messages by raising (raise_exception)
        raise InvalidRequestError("messages", f"the chat template refused them: {exc}") from None
    return list(tokenizer.encode(rendered, add_special_tokens=False))
