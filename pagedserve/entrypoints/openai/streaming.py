"""Turning cumulative engine outputs into per-choice stream deltas.

The engine reports the full text so far; a stream must send each character once.  Text
that could still turn out to be the start of a stop string is held back (the engine
cuts the stop string off when it completes, and a client cannot be asked to un-receive
characters), so a stop string never leaks partly into the stream.  A choice's
finish_reason goes only in its last chunk; nothing is sent for it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.outputs import CompletionOutput


@dataclass
class ChoiceStream:
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    sent_chars: int = 0
    sent_tokens: int = 0
    done: bool = False
    first: bool = True  # no chunk sent yet (chat sends the role first)
    text_offset_before: int = 0  # completions logprobs: chars covered by tokens already sent

    def __post_init__(self) -> None:
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def advance(self, c: CompletionOutput, want_tokens: bool = False) -> tuple[str, int, int] | None:
        """The next delta as (text, first_new_token, end_token), or None if there is
        nothing to send yet.  `want_tokens`: send a chunk for new tokens even with no
        visible text (when the client asked for per-token logprobs)."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        text = c.text
        visible = len(text) if finished else max(len(text) - self._holdback, self.sent_chars)
        delta = text[self.sent_chars:visible]
        tok_start, tok_end = self.sent_tokens, len(c.token_ids)
        if not finished and not delta and not (want_tokens and tok_end > tok_start):
            return None
        self.sent_chars = max(self.sent_chars, visible)
        self.sent_tokens = tok_end
        self.done = finished
        return delta, tok_start, tok_end
