"""Reasoning output (`--reasoning-parser`, vLLM's names): a thinking model's answer is
"<think>reasoning</think>content"; the chat API returns the two apart, the reasoning in
`reasoning_content` (and streamed as `reasoning_content` deltas), the content as the
message, where tool calls are then read.

- qwen3: the model opens the block itself, so an answer that does not start with
  "<think>" is all content (`enable_thinking: false`, whose template closes an empty
  block in the prompt), and one that never closes it is all reasoning.
- deepseek_r1: the template opens the block in the prompt (as Qwen3's thinking-only
  2507 models' do too), so everything up to "</think>" is reasoning (a leading
  "<think>" dropped), and an answer that never closes it is all reasoning.

While a request streams, text that could still become one of the tags (a "</thi" at
the end) is held back until the next token tells, so no tag ever leaks into either part.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.reasoning import END, START


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    template_opens: bool  # the chat template opens the block in the prompt (R1), or the model does (Qwen3)

    def split(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of the answer so far, the reasoning as the model wrote it
        between the tags, the content without the blank lines after "</think>"; while not
        `finished`, each is what can no longer change (both only grow as tokens arrive)."""
        stripped = text.lstrip()
        opened = stripped.startswith(START)
        if not finished and not opened and START.startswith(stripped):
            return "", ""  # "<thi", or blank so far: the block may be opening
        if opened:
            body = stripped[len(START):]
        elif not self.template_opens:
            return "", text  # Qwen3 without a block: all content
        else:
            body = text  # (the reasoning as written, its leading blank included)
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):].lstrip()
        held = 0 if finished else _partial_suffix(body, END)
        return body[: len(body) - held], ""


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", template_opens=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", template_opens=True),
}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
