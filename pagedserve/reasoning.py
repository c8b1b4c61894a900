"""A thinking model's reasoning block ("<think>...</think>") as the engine sees it: the
tags (every reasoning parser here splits on them), and the thinking budget.

`SamplingParams.thinking_token_budget` (vLLM's field; Anthropic's `thinking.budget_tokens`
becomes it) caps the tokens an answer spends inside reasoning blocks: once it has spent
that many, the next token is forced to be the block's end tag, and the answer goes on
after it.  The budget counts the whole answer's reasoning (a block opened again after it
was spent is closed at once), the tags themselves not included.  Where the answer starts
inside a block is read from the prompt's tokens once (answer_starts_inside): a template
that opens the block in the prompt (DeepSeek-R1's) ends with the start tag; Qwen3's with
`enable_thinking: false` closes an empty block there, so its answer starts outside one.
Both tags must be single tokens of the vocabulary (they are for the thinking models
served here); the engine refuses the field by name otherwise.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

START, END = "<think>", "</think>"


def answer_starts_inside(prompt: Sequence[int], start_id: int, end_id: int, special_ids: Container[int]) -> bool:
    """Whether the answer continues a block the prompt opened: its last start tag comes
    after its last end tag, with no special token after it (a template's turn markers
    after a user's text that quotes "<think>" make that block the text's, not the answer's)."""
    ids = np.asarray(prompt)
    starts, ends = np.flatnonzero(ids == start_id), np.flatnonzero(ids == end_id)
    if len(starts) == 0 or (len(ends) and ends[-1] > starts[-1]):
        return False
    return not any(int(t) in special_ids for t in ids[starts[-1] + 1:])


@dataclass
class ThinkingBudget:
    """One request's progress through its reasoning, as its tokens arrive: whether the
    answer is inside a block and how many tokens it has spent in blocks."""

    budget: int
    start_id: int
    end_id: int
    inside: bool = False  # (where the answer starts: answer_starts_inside)
    spent: int = 0

    def read(self, tokens: Iterable[int]) -> None:
        """Take the answer's next tokens."""
        for t in tokens:
            self.inside, self.spent = self._after(self.inside, self.spent, int(t))

    def must_end(self, pending: int | None = None) -> bool:
        """Whether the next token must be the end tag (after `pending`, a token sampled
        but not yet read, under overlap scheduling)."""
        inside, spent = self.inside, self.spent
        if pending is not None:
            inside, spent = self._after(inside, spent, pending)
        return inside and spent >= self.budget

    def _after(self, inside: bool, spent: int, token: int) -> tuple[bool, int]:
        if inside:
            return (False, spent) if token == self.end_id else (True, spent + 1)
        return token == self.start_id, spent
