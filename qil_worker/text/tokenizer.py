"""Loading a model directory's tokenizer through transformers (the optional ``text`` extra), and
what its configuration guarantees about encoding long texts (``encoding_traits``)."""

from __future__ import annotations

import json
import unicodedata
import weakref
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from qil_worker.errors import TokenizerUnavailableError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer_files(path: str | Path) -> bool:
    return any((Path(path) / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(path: str | Path) -> Any:
    """The ``AutoTokenizer`` of ``path``; a clear error when it or transformers is missing."""
    if not has_tokenizer_files(path):
        raise TokenizerUnavailableError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TokenizerUnavailableError(
            "text needs a tokenizer: install the text extra (pip install 'qil[text]')"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - every loading failure reads the same to a user
        raise TokenizerUnavailableError(f"could not load the tokenizer of {path}: {exc}") from None


def tokenizer_summary(tokenizer: Any, max_positions: int) -> dict[str, Any]:
    """What a remote user of the tokenizer needs to know of it (the answer of vLLM's
    ``/tokenizer_info``, which lm-eval's remote tokenizer reads): its class, its special tokens
    and its chat template."""
    summary: dict[str, Any] = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": max_positions}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        summary[name] = token if isinstance(token, str) else None
    template = getattr(tokenizer, "chat_template", None)
    summary["chat_template"] = template if isinstance(template, str) else None
    return summary


# Pre-tokenizer regexes under which a text split before a space or after a newline, each between
# two non-space characters (``prompt.piece_ends``), pre-tokenizes into the same pieces as the
# whole text: no match crosses such a boundary, and none depends on what precedes it.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITTABLE_REGEXES = frozenset({GPT2_REGEX, QWEN2_REGEX})
# Normalizers and how many input bytes one normalized byte can stand for at most, for a text not
# already in their form: NFC composes (a decomposed Hangul syllable, 9 bytes, becomes 3), and no
# character shrinks below a third.
NORMALIZER_SHRINK = {None: 1, "NFC": 3}


@dataclass(frozen=True)
class EncodingTraits:
    """What a tokenizer's configuration guarantees (nothing, by default).

    ``max_token_bytes``: the most UTF-8 bytes of (normalized) text one token stands for, so a
    text of B bytes has at least ceil(B / max_token_bytes) tokens (``min_tokens``); byte-level
    BPE only, whose tokens are byte strings (an unknown-token or word-piece model can swallow
    any length). 0: no bound. ``normal_form``: the normalizer (None or "NFC").
    ``splits_at_whitespace``: encoding the pieces of a text cut at ``prompt.piece_ends`` gives
    the ids of the whole text, concatenated.
    """

    max_token_bytes: int = 0
    normal_form: str | None = None
    splits_at_whitespace: bool = False


def min_tokens(texts: Sequence[str], max_token_bytes: int, normal_form: str | None = None) -> int:
    """A lower bound on the number of tokens of a text holding all of ``texts`` (0 when
    ``max_token_bytes`` is 0). Costs a copy of a text only when it is not ASCII."""
    if max_token_bytes <= 0:
        return 0
    size = sum(len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass")) for t in texts)
    if normal_form is not None and not all(t.isascii() or unicodedata.is_normalized(normal_form, t) for t in texts):
        size = -(-size // NORMALIZER_SHRINK[normal_form])
    return -(-size // max_token_bytes)


def min_tokens_of_sizes(sizes: Sequence[tuple[int, bool]], max_token_bytes: int, normal_form: str | None = None) -> int:
    """``min_tokens`` of texts known only by their UTF-8 sizes and whether each is ASCII (not
    decoded): a text that is not ASCII counts as not in ``normal_form``, so the bound may be
    below ``min_tokens``' but is a bound still."""
    if max_token_bytes <= 0:
        return 0
    size = sum(n for n, _ in sizes)
    if normal_form is not None and not all(ascii for _, ascii in sizes):
        size = -(-size // NORMALIZER_SHRINK[normal_form])
    return -(-size // max_token_bytes)


_TRAITS: "weakref.WeakKeyDictionary[Any, EncodingTraits]" = weakref.WeakKeyDictionary()


def encoding_traits(tokenizer: Any) -> EncodingTraits:
    """Read once per tokenizer from its ``tokenizer.json`` form (fast tokenizers only)."""
    try:
        return _TRAITS[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        traits = _traits(json.loads(tokenizer.backend_tokenizer.to_str()))
    except Exception:  # noqa: BLE001 - a slow or unusual tokenizer: no guarantees
        traits = EncodingTraits()
    try:
        _TRAITS[tokenizer] = traits
    except TypeError:
        pass
    return traits


def _traits(spec: dict[str, Any]) -> EncodingTraits:
    model, pre, normalizer = spec.get("model") or {}, spec.get("pre_tokenizer"), spec.get("normalizer")
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre] if pre else []
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    splits = [s for s in steps if s.get("type") == "Split"]
    normal_form = normalizer.get("type") if normalizer else None
    if model.get("type") != "BPE" or not byte_level or normal_form not in NORMALIZER_SHRINK:
        return EncodingTraits()
    added = spec.get("added_tokens") or []
    # a byte-level vocabulary spells each byte as one character; added tokens are plain text
    longest = max(
        max((len(t) for t in model.get("vocab", {})), default=1),
        max((len(t["content"].encode()) for t in added), default=1),
    )
    regex_ok = (
        (len(steps) == 1 and byte_level[0].get("use_regex", True))
        or (len(steps) == 2 and steps[1] is byte_level[0] and not steps[1].get("use_regex", True)
            and steps[0] in splits
            and (steps[0].get("pattern") or {}).get("Regex") in SPLITTABLE_REGEXES
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"))
    )
    plain_added = all(
        not (t.get("lstrip") or t.get("rstrip") or t.get("single_word"))
        and not any(c.isspace() for c in t["content"])
        for t in added
    )
    no_prefix_space = not any(s.get("add_prefix_space") for s in byte_level)
    return EncodingTraits(longest, normal_form, bool(regex_ok and plain_added and no_prefix_space))
