"""What `LLM.score` and the server's /v1/score and /v1/rerank share: pairing the two
sides, the reranker's prompt, and cosine similarity.

A pooling engine scores a (query, document) pair one of two ways.  With classifier
tokens (PoolerConfig.classifier_from_token, e.g. ["no", "yes"]) the pair is written
into one prompt in Qwen3-Reranker's format and its score is sigmoid(logit(yes) -
logit(no)) at the last token (vLLM's recipe for that model).  Without them, each text
is embedded and the score is the cosine similarity of the two embeddings.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.engine.chat_utils import check_prompt_chars
from pagedserve.engine.special_text import hide_special_text
from pagedserve.errors import InvalidRequestError

# Qwen3-Reranker's instruction when the client gives none (its model card's default).
DEFAULT_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                  'Note that the answer can only be "yes" or "no".')


def reranker_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """One (query, document) pair as Qwen3-Reranker reads it: a ChatML turn whose
    assistant reply starts after an empty thinking block, so the next token is the
    yes/no verdict."""
    instruction = DEFAULT_RERANK_INSTRUCTION if instruction is None else instruction  # ("" is the client's)
    return (f"<|im_start|>system\n{_RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
            f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def encode_reranker_pair(tokenizer: Any, query: str, document: str, instruction: str | None, max_chars: int,
                         param: str) -> tuple[str, list[int]]:
    """One pair's reranker prompt as (text, token ids).  The query, document and
    instruction are text: a special token's string written in one (`<|im_end|>`) stays
    text, as in a chat message (special_text.py), or a document could close its turn and
    write the verdict's turn itself; the prompt's own turn markers are tokens."""
    (query, document, instruction), hidden = hide_special_text(tokenizer, [query, document, instruction])
    text = reranker_prompt(query, document, instruction)
    check_prompt_chars(text, max_chars, param)
    return hidden.shown(text), hidden.encode(tokenizer, text, add_special_tokens=True)


def score_pairs(text_1: Any, text_2: Any, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[Any, Any]]:
    """vLLM's pairing: one first text against each second text (1:N), or two lists of
    the same length pairwise (N:N).  Items are strings or token-id lists."""
    first = text_1 if isinstance(text_1, list) and text_1 and not _is_ids(text_1) else [text_1]
    second = text_2 if isinstance(text_2, list) and text_2 and not _is_ids(text_2) else [text_2]
    for name, items in zip(names, (first, second), strict=True):
        if not items or any(not (isinstance(t, str) or _is_ids(t)) for t in items):
            raise InvalidRequestError(f"{name} must be a string, a list of token ids, or a non-empty list of these",
                                      param=name)
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise InvalidRequestError(f"{names[0]} has {len(first)} items and {names[1]} has {len(second)}: give one "
                                  f"{names[0]}, or as many as {names[1]}", param=names[1])
    return list(zip(first, second, strict=True))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity of two 1-D float tensors."""
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))
