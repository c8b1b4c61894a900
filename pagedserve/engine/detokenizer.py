"""Incremental detokenization with stop strings, one instance per sequence.

Decoding one token at a time is wrong for most tokenizers: a byte-level BPE token
may hold half of a UTF-8 character, and SentencePiece drops a word's leading space
when it starts a decode.  So, as vLLM does, we decode a short sliding window twice
-- `tokens[prefix_offset:read_offset]` (already emitted) and
`tokens[prefix_offset:]` -- and emit the difference, but only once it no longer
ends in U+FFFD (an incomplete character waits for the bytes that finish it).

Stop strings can span tokens, so they are searched in the newly decoded characters
plus the `len(stop) - 1` characters before them.  The text a caller may show
(`get_text(finished=False)`) holds back `len(longest stop) - 1` characters, so a
stop string that is still being written never leaks into a stream; it only ever
grows, which lets streaming layers send plain suffix deltas.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedserve.sampling_params import SamplingParams

# Prompt tokens used as left context, so the first output token decodes with the
# spacing it has in the full text (vLLM uses the same number).
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def decoder_of(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=...)`, exactly.

    For a fast (Rust) tokenizer whose class keeps transformers' own decode and does not
    clean up spaces, that decode is the Rust tokenizer's, plus ~6 us of Python argument
    handling per call; the detokenizer calls it twice per token per sequence (at batch
    256, 5.4 ms of a step's host time).  Such tokenizers, and tokenizer snapshots (the
    same Rust tokenizer without transformers), are called directly; any other (a class
    with its own decode, space clean-up) goes through decode as before."""
    from pagedserve.model_loader.tokenizer_snapshot import SnapshotTokenizer

    if isinstance(tokenizer, SnapshotTokenizer):
        return _backend_decoder(tokenizer.backend_tokenizer, skip_special_tokens)
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and not tokenizer.clean_up_tokenization_spaces
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode):  # noqa: SLF001 - the method it replaces
        return _backend_decoder(tokenizer.backend_tokenizer, skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _backend_decoder(backend: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer if params.detokenize else None  # (None: token ids alone, no text)
        tokenizer = self.tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self._decode = decoder_of(tokenizer, params.skip_special_tokens) if tokenizer is not None else None
        self.stop_strings = list(params.stop_strings)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        longest = max((len(s) for s in self.stop_strings), default=0)
        # A stop string included in the output can never be taken back: no hold-back needed.
        self.stop_buffer_length = 0 if self.include_stop_str_in_output else max(longest - 1, 0)

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A window whose left edge falls inside a character (the prompt ends in a run of
        # byte tokens, SentencePiece's byte fallback: Gemma's emoji, runes, rare CJK) reads
        # that whole run as one U+FFFD per byte, and every output byte token continuing it
        # too: the edge moves right past the leftover bytes.
        while context and self._decode is not None and self._decode(context).startswith(_REPLACEMENT_CHAR):
            context.pop(0)
        self.token_ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.num_output_tokens = 0
        self.tokens_after_stop = 0  # of the last update's tokens, those past its stop string
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string that ended the sequence

    def _decode_pending(self, force: bool = False) -> str:
        """Text of tokens past read_offset, or "" while it ends in a partial character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) and not force:
            return ""
        if full_text.endswith(_REPLACEMENT_CHAR) and not force:
            return ""
        # Slicing by length (not by prefix match) tolerates a window whose left edge
        # starts inside a character, as vLLM's does.  Text that does not extend the
        # prefix's because the prefix now reads as U+FFFDs (SentencePiece's byte fallback
        # reads a run of bytes holding an invalid one, or ending in a partial character at
        # a forced flush, as one U+FFFD per byte, the complete character before it too)
        # comes from the pending tokens alone: the slice gave one U+FFFD per byte of the
        # whole run past the first character.
        reread = not full_text.startswith(prefix_text) and _REPLACEMENT_CHAR in full_text[:len(prefix_text)]
        if reread or force and not full_text.startswith(prefix_text):
            new_text = self._decode(self.token_ids[self.read_offset :])
        else:
            new_text = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text

    def update(self, new_token_ids: list[int], skip_last: bool = False) -> str | None:
        """Decode `new_token_ids`; return the stop string if one now matches.

        skip_last: the last token ended the sequence as EOS or a stop token id; like
        vLLM, it is kept in token_ids but not in the text (unless the caller asks
        for stop strings in the output).
        """
        if self.tokenizer is None or self.stop_reason is not None:
            self.num_output_tokens += len(new_token_ids)
            return None
        to_decode = new_token_ids[:-1] if skip_last and not self.include_stop_str_in_output else new_token_ids
        # Checked after each token, so that when several arrive at once (speculative
        # decoding) a stop string ends the output at the token that completed it; the
        # caller drops the `tokens_after_stop` that came after.
        self.tokens_after_stop = 0
        for i, tid in enumerate(to_decode):
            stop = self._append(tid)
            if stop is not None:
                self.tokens_after_stop = len(new_token_ids) - 1 - i
                return stop
        self.num_output_tokens += len(new_token_ids) - len(to_decode)
        return None

    def _append(self, tid: int) -> str | None:
        """Decode one more token and check the stop strings."""
        self.token_ids.append(tid)
        self.num_output_tokens += 1
        piece = self._decode_pending()
        self.output_text += piece
        return self._check_stop(len(piece))

    def finish(self) -> None:
        """The sequence ended without a stop string: flush any undecodable tail, so the
        final text equals what `tokenizer.decode(output_ids)` gives (except that a byte
        run holding an invalid byte keeps its complete characters, where SentencePiece's
        byte fallback makes every byte of the run a U+FFFD)."""
        if self.tokenizer is None or self.stop_reason is not None:
            return
        if self.read_offset < len(self.token_ids):
            piece = self._decode_pending(force=True)
            self.output_text += piece
            self._check_stop(len(piece))

    def _check_stop(self, new_chars: int) -> str | None:
        if not self.stop_strings or new_chars == 0 or self.num_output_tokens <= self.min_tokens:
            return None
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            # Only an occurrence that ends in the new characters (vLLM's window, per stop
            # string): with the longest's window a shorter one found again an occurrence
            # skipped under min_tokens, and cut the text back, below what was streamed.
            idx = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        end = idx + len(stop) if self.include_stop_str_in_output else idx
        self.output_text = text[:end]
        self.stop_reason = stop
        return stop

    def get_text(self, finished: bool) -> str:
        """Text safe to show now: while running, minus a possible partial stop string."""
        if finished or self.stop_buffer_length == 0:
            return self.output_text
        return self.output_text[: max(len(self.output_text) - self.stop_buffer_length, 0)]
