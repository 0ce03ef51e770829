"""Prompt text or chat messages → token ids, with the tokenizer's own chat template.

A prompt may be given a ``max_tokens``: one that cannot fit is then refused without encoding
it all (``PromptTooLong``). First a lower bound from the text's size (``tokenizer.min_tokens``),
then, where the tokenizer allows it (``EncodingTraits.splits_at_whitespace``), encoding in
pieces of about ``PIECE_CHARS`` characters, counting as it goes: a text of megabytes costs a
few pieces, not seconds and a tokenizer's worth of offsets and token strings for every id.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from qil_worker.errors import CapacityError, InvalidRequestError, TokenizerUnavailableError
from qil_worker.text.tokenizer import encoding_traits, min_tokens

ROLES = ("system", "user", "assistant", "tool")
PIECE_CHARS = 1 << 15
# Where a text may be cut without changing its ids (see tokenizer.SPLITTABLE_REGEXES): before
# a space or after a newline, each between two non-space characters.
_CUT = re.compile(r"(?<=\S)(?= \S)|(?<=\S\n)(?=\S)")


class PromptTooLong(Exception):
    """The prompt has more than ``max_tokens`` tokens: at least ``at_least`` (a lower bound
    when ``exact`` is False)."""

    def __init__(self, at_least: int, exact: bool) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least
        self.exact = exact


@dataclass(frozen=True)
class PromptRoom:
    """How long a prompt can be: the model's positions and the KV pool's pages (0: unknown)."""

    max_positions: int = 0
    num_pages: int = 0
    page_size: int = 0

    def max_prompt(self, max_new_tokens: int) -> int | None:
        """The most prompt tokens a request with ``max_new_tokens`` can have (the engine's
        ``validate_submit`` rules); None when unknown or when ``max_new_tokens`` is invalid
        (the engine says why)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            return None
        room = []
        if self.max_positions:
            room.append(self.max_positions - max_new_tokens)
        if self.num_pages and self.page_size:
            room.append(self.num_pages * self.page_size + 1 - max_new_tokens)  # the last token needs no slot
        return max(0, min(room)) if room else None

    def refusal(self, too_long: PromptTooLong, max_new_tokens: int, prompt_field: str) -> CapacityError:
        """The engine's refusal of a prompt known to have at least ``too_long.at_least`` tokens,
        blaming the prompt's field (``prompt_field``: text or messages) when the prompt alone
        cannot fit, else max_new_tokens."""
        n = too_long.at_least
        prompt = f"{n}" if too_long.exact else f"at least {n} tokens"
        total = n + max_new_tokens
        alone = self.max_prompt(1)
        field = prompt_field if alone is not None and n > alone else "max_new_tokens"
        if self.max_positions and total > self.max_positions:
            if too_long.exact:
                return CapacityError.positions(n, max_new_tokens, self.max_positions, prompt_field)
            return CapacityError(
                field,
                f"prompt ({prompt}) + max_new_tokens ({max_new_tokens}) = at least {total} exceeds "
                f"the model's {self.max_positions} positions",
            )
        needed = -(-(total - 1) // self.page_size)  # kv.page_table.pages_for, torch-free
        return CapacityError(
            field,
            f"prompt ({prompt}) + max_new_tokens ({max_new_tokens}) needs {'' if too_long.exact else 'at least '}"
            f"{needed} KV pages but the whole pool has {self.num_pages} (page size {self.page_size})",
        )


def prompt_chars(text: str | None, messages: list[dict[str, Any]] | None) -> int:
    """The size of a prompt in characters (what decides whether the worker encodes it in its
    loop or beside it, and whether it is outsized)."""
    if isinstance(text, str):
        return len(text)
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        return sum(len(str(m.get("content", ""))) for m in messages)
    return 0


def prompt_field(options: dict[str, Any]) -> str:
    """The field a submit's text or chat prompt came in."""
    return "messages" if options.get("messages") is not None else "text"


def tokenize_refusal(num_tokens: int, max_tokens: int, exact: bool) -> str:
    """Why a Tokenize of ``num_tokens`` tokens (a lower bound unless ``exact``) is refused."""
    count = f"{num_tokens}" if exact else f"at least {num_tokens}"
    return f"{count} tokens, more than the model's {max_tokens} positions: no request could carry it"


def piece_ends(text: str, size: int = PIECE_CHARS) -> Iterator[int]:
    """The end offsets of consecutive pieces of ``text`` of about ``size`` characters, each cut
    at a ``_CUT`` place (the last one before ``size``, else the next one after); a stretch
    without one stays whole. The last end is ``len(text)``."""
    start, n = 0, len(text)
    while n - start > size:
        cut = None
        for m in _CUT.finditer(text, start + size // 2, start + size + 2):
            cut = m.start()
        if cut is None:
            m = _CUT.search(text, start + size)
            if m is None:
                break
            cut = m.start()
        yield cut
        start = cut
    yield n


def encode_text(tokenizer: Any, text: str, max_tokens: int | None = None) -> list[int]:
    """``text``'s ids (no special tokens added); ``PromptTooLong`` as soon as more than
    ``max_tokens`` (None: no limit) are certain."""
    traits = encoding_traits(tokenizer)
    if max_tokens is not None:
        bound = min_tokens((text,), traits.max_token_bytes, traits.normal_form)
        if bound > max_tokens:
            raise PromptTooLong(bound, exact=False)
    if len(text) <= PIECE_CHARS or not traits.splits_at_whitespace:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLong(len(ids), exact=True)
        return ids
    ids = []
    start = 0
    for end in piece_ends(text):
        ids.extend(tokenizer.encode(text[start:end], add_special_tokens=False))
        start = end
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLong(len(ids), exact=end == len(text))
    return ids


def encode_document(tokenizer: Any, text: str, max_tokens: int | None = None) -> list[int]:
    """``text``'s ids with the special tokens the tokenizer's own post-processing puts around a
    single sequence (an embedding model's tokenizer appends ``<|endoftext|>``, whose hidden
    state is the pooled one; a chat model's adds none): what ``tokenizer(text)`` gives, for
    text of any length."""
    prefix, suffix = _document_specials(tokenizer)
    room = None if max_tokens is None else max(max_tokens - len(prefix) - len(suffix), 0)
    ids = prefix + (encode_text(tokenizer, text, room) if text else []) + suffix
    return ids or [document_start(tokenizer)]  # an empty text with no specials: as an empty prompt


_SPECIALS: "weakref.WeakKeyDictionary[Any, tuple[list[int], list[int]]]" = weakref.WeakKeyDictionary()


def _document_specials(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the post-processor adds before and after one sequence, found once per tokenizer
    by encoding a probe with and without them."""
    try:
        return _SPECIALS[tokenizer]
    except (KeyError, TypeError):
        pass
    probe = "a"
    plain = list(tokenizer.encode(probe, add_special_tokens=False))
    full = list(tokenizer.encode(probe, add_special_tokens=True))
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
    specials = ([], []) if at is None else (full[:at], full[at + len(plain) :])
    try:
        _SPECIALS[tokenizer] = specials
    except TypeError:  # not weakly referenceable: probed again next time
        pass
    return specials


DOCUMENT_SEPARATOR = "<|endoftext|>"  # Qwen's (and GPT-2's) token between training documents


def document_start(tokenizer: Any) -> int:
    """The one-token prompt an empty text stands for: what the model saw before a document in
    training (its BOS, else ``<|endoftext|>``, else its EOS), so that it generates as from the
    start of a new document, as the OpenAI API does for an empty prompt."""
    for token_id in (getattr(tokenizer, "bos_token_id", None),
                     _known_id(tokenizer, DOCUMENT_SEPARATOR),
                     getattr(tokenizer, "eos_token_id", None)):
        if isinstance(token_id, int):
            return token_id
    raise InvalidRequestError("text", "is empty, and this tokenizer has no BOS or EOS token to start a document")


def _known_id(tokenizer: Any, token: str) -> int | None:
    """The id of ``token`` when the tokenizer has it as one token."""
    ids = tokenizer.convert_tokens_to_ids([token])
    unknown = getattr(tokenizer, "unk_token_id", None)
    return ids[0] if ids and ids[0] is not None and ids[0] != unknown else None


def encode_prompt(
    tokenizer: Any,
    text: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    enable_thinking: bool | None = None,
    max_tokens: int | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
    document: bool = False,
) -> list[int]:
    """Exactly one of ``text`` (encoded as is; with ``document``, as ``encode_document``: an
    embedding's input) or ``messages`` (rendered with the chat template, ``tools`` given to it
    as transformers' ``apply_chat_template`` gives them).

    ``enable_thinking`` is Qwen3's switch for its reasoning block; None leaves the template's
    default. ``max_tokens``: raise ``PromptTooLong`` for a longer prompt (see ``encode_text``).
    """
    if tokenizer is None:
        raise TokenizerUnavailableError(
            "this server has no tokenizer: send token ids instead of text",
            field="text" if text is not None else "messages",
        )
    if (text is None) == (messages is None):
        raise InvalidRequestError("prompt", "give exactly one of text or messages")
    if text is not None:
        if not isinstance(text, str):
            raise InvalidRequestError("text", "must be a string")
        if document:
            return encode_document(tokenizer, text, max_tokens)
        if not text:
            return [document_start(tokenizer)]
        return encode_text(tokenizer, text, max_tokens)
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
    if tools:
        kwargs["tools"] = list(tools)
    try:
        rendered = tokenizer.apply_chat_template(list(messages), tokenize=False, **kwargs)
    except Exception as exc:  # noqa: BLE001 - templates refuse messages by raising (raise_exception)
        raise InvalidRequestError("messages", f"the chat template refused them: {exc}") from None
    return encode_text(tokenizer, rendered, max_tokens)
