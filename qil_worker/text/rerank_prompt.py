"""Qwen3-Reranker's prompt: a yes/no judgement of one document against a query, whose P("yes")
at the end of the prompt is the document's relevance (torch-free: the fronts build it).

The template is the model card's: a system message fixing the answer to "yes" or "no", the
instruction, query and document in the user turn, and the assistant turn opened with an
empty think block, so the next token is the answer.
"""

from __future__ import annotations

from typing import Any

from qil_worker.errors import FeatureUnavailableError

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
ANSWERS = ("yes", "no")  # the tokens whose logits are compared, P(yes) the score

_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The text whose next token judges ``document`` against ``query``."""
    task = DEFAULT_INSTRUCTION if instruction is None else instruction
    return f"{_PREFIX}<Instruct>: {task}\n<Query>: {query}\n<Document>: {document}{_SUFFIX}"


def answer_token_ids(tokenizer: Any) -> tuple[int, int]:
    """(yes, no): the tokenizer's single tokens for the two answers; ``FeatureUnavailableError``
    when it has none (a byte-level demo vocabulary, say), as no score could be read then."""
    ids = tokenizer.convert_tokens_to_ids(list(ANSWERS)) if tokenizer is not None else [None, None]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if any(i is None or i == unknown for i in ids) or ids[0] == ids[1]:
        raise FeatureUnavailableError(
            f"scores need a tokenizer with the single tokens {ANSWERS[0]!r} and {ANSWERS[1]!r} "
            "(a Qwen3 tokenizer); this model's has none",
            field="documents",
        )
    return ids[0], ids[1]
