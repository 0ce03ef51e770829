"""Loading a model directory's tokenizer through transformers (the optional ``text`` extra)."""

from __future__ import annotations

from pathlib import Path
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
