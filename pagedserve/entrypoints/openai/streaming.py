"""Turning cumulative engine outputs into per-choice stream deltas.

The engine reports the full text so far, and while a request runs that text already
leaves out anything that could still become a stop string (the detokenizer holds it
back), so it only ever grows: a stream sends each new suffix once.  A choice's
finish_reason goes only in its last chunk; nothing is sent for it afterwards.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagedserve.outputs import CompletionOutput


@dataclass
class ChoiceStream:
    sent_chars: int = 0
    sent_tokens: int = 0
    done: bool = False
    text_offset_before: int = 0  # completions logprobs: chars covered by tokens already sent

    def advance(self, c: CompletionOutput, want_tokens: bool = False) -> tuple[str, int, int] | None:
        """The next delta as (text, first_new_token, end_token), or None if there is
        nothing to send yet.  `want_tokens`: send a chunk for new tokens even with no
        visible text (when the client asked for per-token logprobs)."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        delta = c.text[self.sent_chars:]
        tok_start, tok_end = self.sent_tokens, len(c.token_ids)
        if not finished and not delta and not (want_tokens and tok_end > tok_start):
            return None
        self.sent_chars += len(delta)
        self.sent_tokens = tok_end
        self.done = finished
        return delta, tok_start, tok_end


async def sse_dicts(frames: AsyncIterator[str]) -> AsyncIterator[dict]:
    """An SSE stream's chunks as dicts (an in-band error as {"error": {...}}), for the
    APIs that re-say an OpenAI stream in their own events (Responses, Anthropic's
    Messages, Ollama's NDJSON)."""
    async for frame in frames:
        data = frame.removeprefix("data: ").strip()
        if data != "[DONE]":
            yield json.loads(data)
