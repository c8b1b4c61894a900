"""Turning cumulative engine outputs into per-choice stream deltas.

The engine reports the full text so far, and while a request runs that text already
leaves out anything that could still become a stop string (the detokenizer holds it
back), so it only ever grows: a stream sends each new suffix once.  A choice's
finish_reason goes only in its last chunk; nothing is sent for it afterwards.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve.outputs import CompletionOutput


@dataclass
class TextOffsets:
    """Where each token starts in a completion's text (the legacy API's `text_offset`),
    token after token, across a stream's chunks.  A token holding part of a character
    (its text U+FFFD, its bytes not that) moves the offset only when its character
    completes: each counted one U+FFFD, and a stream advanced by its "bytes:\\xNN" form,
    so later offsets pointed past the text."""

    offset: int = 0
    _utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    def start(self, text: str, raw: bytes) -> int:
        """The offset of the token (`text`, `raw` its bytes); the next one starts after it."""
        at = self.offset
        if ("\ufffd" in text and raw != text.encode()) or self._utf8.getstate()[0]:
            self.offset += len(self._utf8.decode(raw))
        else:
            self.offset += len(text)
        return at


@dataclass
class ChoiceStream:
    sent_chars: int = 0
    sent_tokens: int = 0
    done: bool = False
    text_offsets: TextOffsets = field(default_factory=TextOffsets)  # completions logprobs

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


async def calls_after_text(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """A chat stream with each choice's tool calls held to its finishing chunk. A chat
    message has no order between its content and its tool_calls, and an answer may go
    on in text after a call; the APIs that give the answer as ordered items (Responses'
    output, Anthropic's content blocks) say the non-streamed message as its text, then
    its calls, and a stream must say the same items: so its text comes first whole."""
    held: dict[int, list[dict]] = {}
    async for chunk in chunks:
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            held.setdefault(choice.get("index", 0), []).extend(delta.pop("tool_calls", None) or [])
            if choice.get("finish_reason") is not None and held.get(choice.get("index", 0)):
                choice["delta"] = {**delta, "tool_calls": held.pop(choice.get("index", 0))}
        yield chunk
