"""Embedding checkpoints: what marks a directory as an embedding model, read from its files
alone (no tensor data).

Two marks: a headless checkpoint (an untied config whose weights carry no ``lm_head.weight``,
as Qwen3-Embedding-4B/8B ship, in either tensor layout), and a sentence-transformers directory
(``modules.json``). The latter's pooling must be the one qil computes — the last token's
final hidden state — so any other mode is refused naming its file and key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qil_worker.config import Qwen3Config
from qil_worker.errors import ConfigError
from qil_worker.model.loader import TIED_HEAD, read_headers, shard_files, with_model_prefix

MODULES_FILE = "modules.json"
POOLING_TYPE = "sentence_transformers.models.Pooling"
NORMALIZE_TYPE = "sentence_transformers.models.Normalize"
LAST_TOKEN = "pooling_mode_lasttoken"
# every pooling mode sentence-transformers knows but last-token, which is the one we compute
OTHER_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
               "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class EmbeddingCheckpoint:
    """Why a directory is an embedding model: ``headless`` (no LM head in its weights),
    ``sentence_transformers`` (a last-token-pooling module list; ``normalize``: it ends in a
    Normalize module)."""

    headless: bool
    sentence_transformers: bool
    normalize: bool = True


def has_lm_head(directory: Path, config: Qwen3Config) -> bool:
    """Whether the weights carry the LM head (a tied config's head is the embedding: always)."""
    if config.tie_word_embeddings:
        return True
    found, _ = with_model_prefix(read_headers(shard_files(directory)))
    return TIED_HEAD in found


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not readable JSON ({exc})") from None


def sentence_transformers_modules(directory: Path) -> bool | None:
    """A sentence-transformers directory's ``normalize`` (whether a Normalize module follows
    the pooling); None when ``modules.json`` is absent. Refuses (``ConfigError`` naming file and
    key) a module list without a last-token pooling module."""
    modules_path = directory / MODULES_FILE
    if not modules_path.exists():
        return None
    modules = _json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ConfigError(f"{modules_path}: expected a list of module objects")
    pooling = [m for m in modules if m.get("type") == POOLING_TYPE]
    if not pooling:
        raise ConfigError(f"{modules_path}: no {POOLING_TYPE} module; qil pools the last token")
    config_path = directory / str(pooling[0].get("path", "1_Pooling")) / "config.json"
    raw = _json(config_path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path}: expected a JSON object")
    others = [key for key in OTHER_MODES if raw.get(key)]
    if others or raw.get(LAST_TOKEN) is not True:
        found = ", ".join(f"{key}: true" for key in others) or f"{LAST_TOKEN} not true"
        raise ConfigError(
            f"{config_path}: {found}; qil implements only last-token pooling ({LAST_TOKEN}: true)"
        )
    return any(m.get("type") == NORMALIZE_TYPE for m in modules)


def detect(directory: str | Path, config: Qwen3Config | None = None) -> EmbeddingCheckpoint | None:
    """The directory's embedding marks, or None for a causal LM (see module docstring)."""
    directory = Path(directory)
    config = config or Qwen3Config.from_directory(directory)
    normalize = sentence_transformers_modules(directory)
    headless = not has_lm_head(directory, config)
    if normalize is None and not headless:
        return None
    return EmbeddingCheckpoint(headless=headless, sentence_transformers=normalize is not None,
                               normalize=True if normalize is None else normalize)
