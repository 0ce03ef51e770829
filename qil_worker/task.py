"""What a server is for (``serve --task``): generation, embeddings or reranking scores, and
which requests each task serves (torch-free: the front checks every request against it).

``auto`` resolves from the checkpoint: an embedding checkpoint (headless, or a
sentence-transformers directory: ``model.embedding_checkpoint``) is served as ``embed``;
anything else as ``generate``, which keeps serving embeddings and scores beside generation.
An explicit task restricts: ``embed`` serves embeddings only, ``rerank`` scores only.
"""

from __future__ import annotations

from qil_worker.errors import ConfigError

TASKS = ("auto", "generate", "embed", "rerank")
# request kind → the resolved tasks that serve it ("generate": sampled tokens)
_SERVED_BY = {"generate": ("generate",), "embed": ("generate", "embed"), "score": ("generate", "rerank")}
_EXPLICIT = {"generate": ("generate",), "embed": ("embed",), "score": ("rerank",)}


def resolve(requested: str, embedding_checkpoint: bool, headless: bool) -> str:
    """The task a server runs (``ConfigError`` when the checkpoint cannot serve it): ``auto`` →
    ``embed`` for an embedding checkpoint, else ``generate``. A headless checkpoint has no LM
    head, so it can neither generate nor score."""
    if requested not in TASKS:
        raise ConfigError(f"task: expected one of {', '.join(TASKS)}, got {requested!r}")
    task = ("embed" if embedding_checkpoint else "generate") if requested == "auto" else requested
    if headless and task != "embed":
        raise ConfigError(
            f"task {task}: the checkpoint has no LM head (lm_head.weight), so it is an embedding "
            "model: serve it with --task embed (or auto)"
        )
    return task


def refusal(task: str, kind: str, explicit: bool) -> str | None:
    """Why a server of ``task`` refuses a request of ``kind`` ("generate", "embed" or "score"),
    or None when it serves it. ``explicit``: the task was asked for (a causal LM under ``auto``
    serves every kind)."""
    served = (_EXPLICIT if explicit else _SERVED_BY)[kind]
    if task in served:
        return None
    what = {"generate": "generation", "embed": "embeddings", "score": "scores (rerank)"}[kind]
    return f"this server's task is {task}: it does not serve {what}"
