"""Decoding token ids by joining their bytes, for tokenizers that decode that way.

A byte-level BPE tokenizer (GPT-2's, Qwen's: a ``tokenizers`` backend whose decoder is
``ByteLevel``) decodes a list of ids by taking each id's token string (dropping unknown ids,
and special tokens under ``skip_special_tokens``), turning each into bytes (every character
through the byte-level alphabet, or the token's own UTF-8 when some character is outside it,
as for most added tokens), joining them and decoding the whole as UTF-8 with U+FFFD for each
invalid sequence. So ``decode(ids)`` is the join of per-id byte strings, decoded; a table of
those byte strings decodes a short window of ids in well under a microsecond, where the
tokenizer's ``decode`` costs about ten (most of it transformers' argument handling) — which
the engine pays twice per request per step.

Each id's bytes are derived on first use and checked against the tokenizer's own
``decode([id])``; a tokenizer that disagrees on any id (or is not of that kind) is decoded by
the tokenizer from then on (``TokenBytes.decode`` returns None).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte. Printable Latin-1
    bytes stand for themselves; the others for characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shown = set(printable)
    byte_of: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in shown:
            byte_of[chr(256 + extra)] = b
            extra += 1
    return byte_of


BYTE_OF = byte_level_alphabet()


class TokenBytes:
    """Per-id byte strings of one tokenizer under one ``skip_special_tokens`` setting."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._backend = tokenizer.backend_tokenizer
        self._bytes: dict[int, bytes] = {}
        self.whole: dict[int, str] = {}  # ``whole_text`` of the ids seen (read directly on hot paths)
        self._vocab_size = -1  # the vocabulary the tables were made for (``_check_vocabulary``)
        self._special: frozenset[str] = frozenset()
        self.usable = True  # False once an id decoded otherwise than its bytes say

    def bytes_of(self, token_id: int) -> bytes | None:
        """The id's bytes in a decoded sequence (None when this tokenizer cannot be trusted)."""
        found = self._bytes.get(token_id)
        if found is not None:
            return found
        if not self.usable:
            return None
        self._check_vocabulary()
        token = self._backend.id_to_token(token_id) if token_id >= 0 else None
        if token is None or (self._skip and token in self._special):
            found = b""
        elif all(c in BYTE_OF for c in token):
            found = bytes(BYTE_OF[c] for c in token)
        else:
            found = token.encode()
        expected = self._tokenizer.decode(
            [token_id], skip_special_tokens=self._skip, clean_up_tokenization_spaces=False
        )
        if found.decode("utf-8", "replace") != expected:
            # this tokenizer does not decode as modelled: trust none of the table
            self.usable = False
            self._bytes.clear()
            self.whole.clear()
            return None
        self._bytes[token_id] = found
        return found

    def _check_vocabulary(self) -> None:
        """Start the tables afresh when tokens were added to the tokenizer since (an added
        special token may be one that was plain before)."""
        size = self._backend.get_vocab_size(with_added_tokens=True)
        if size != self._vocab_size:
            self._vocab_size = size
            self._bytes.clear()
            self.whole.clear()
            self._special = frozenset(
                t.content for t in self._backend.get_added_tokens_decoder().values() if t.special
            )

    def whole_text(self, token_id: int) -> str:
        """The id's text when its bytes are whole characters by themselves, not ending in
        U+FFFD; else "" (also when this tokenizer cannot be trusted)."""
        text = self.whole.get(token_id)
        if text is None:
            found = self.bytes_of(token_id)
            if found is None:
                return ""
            try:
                text = found.decode("utf-8")
            except UnicodeDecodeError:
                text = ""
            if text.endswith("\ufffd"):
                text = ""
            self.whole[token_id] = text
        return text

    def valid(self, ids: Sequence[int]) -> bool:
        """Whether the ids' bytes, joined, are valid UTF-8 (False when not known)."""
        parts = [self.bytes_of(i) for i in ids]
        if None in parts:
            return False
        try:
            b"".join(parts).decode("utf-8")  # type: ignore[arg-type]
        except UnicodeDecodeError:
            return False
        return True

    def decode(self, ids: Sequence[int]) -> str | None:
        """``tokenizer.decode(ids)`` (None: ask the tokenizer)."""
        table = self._bytes
        try:
            joined = b"".join([table[i] for i in ids])
        except KeyError:
            parts = [self.bytes_of(i) for i in ids]
            if None in parts:
                return None
            joined = b"".join(parts)  # type: ignore[arg-type]
        return joined.decode("utf-8", "replace")


_TABLES: "weakref.WeakKeyDictionary[Any, dict[bool, TokenBytes | None]]" = weakref.WeakKeyDictionary()


def token_bytes(tokenizer: Any, skip_special_tokens: bool) -> TokenBytes | None:
    """The tokenizer's shared ``TokenBytes`` (one per setting), or None when it does not decode
    by joining bytes (not a ``tokenizers`` backend with a ``ByteLevel`` decoder, or a class
    that overrides transformers' decoding)."""
    try:
        per_setting = _TABLES.setdefault(tokenizer, {})
    except TypeError:
        per_setting = {}
    if skip_special_tokens not in per_setting:
        per_setting[skip_special_tokens] = TokenBytes(tokenizer, skip_special_tokens) if _joins_bytes(tokenizer) else None
    return per_setting[skip_special_tokens]


def _joins_bytes(tokenizer: Any) -> bool:
    try:
        from tokenizers.decoders import ByteLevel
        from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast
    except ImportError:
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and "decode" not in vars(tokenizer)
        and isinstance(getattr(tokenizer.backend_tokenizer, "decoder", None), ByteLevel)
    )
