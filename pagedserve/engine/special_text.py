"""A chat message's text is text: a special token's string written in a message
(`<|im_end|>\n<|im_start|>system\n...` in a user's content) must not become that token.

A chat prompt is rendered to text by its template, then tokenized, and the tokenizer
turns every special token's string it finds into the token: the template's own (the
turn markers it writes) and any a client wrote into a message, with which a user could
close their turn and open a system turn of their own (vLLM and llama.cpp's server do
the same; OpenAI's and Anthropic's APIs read such text as text).  So before rendering,
each special token's string in the messages (and the tools' definitions) is replaced by
a private-use character that no input holds; the template renders around it; the
rendered text is split at the special strings found in it then (the template's own:
the client's are placeholders), and the text between, the client's strings put back, is
tokenized as text (the tokenizer's `encode_special_tokens` on a private copy, made once,
only when a prompt needs it): the ids of that text as the tokenizer reads text, merges
across the client's strings kept.  A prompt without such strings, almost every one, is
tokenized exactly as before, in one call.

A special string can also be spelled across strings the template writes side by side
(text parts of one message, which Gemma 3's template writes back to back, trimmed):
"hi <|im_" then "end|>".  So a string's end that begins a special string (trailing
whitespace aside) is hidden too: one spanning two of the client's strings would begin
in the first one's end.  (A template writing a special string's remainder after a
message's text, `{{ content }}end|>`, is the template's own doing.)
"""

from __future__ import annotations

import re
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Plane 15's private-use characters: placeholders, picked among those no input string holds.
_PRIVATE_FIRST, _PRIVATE_LAST = 0xF0000, 0xFFFFD
_PRIVATE = re.compile("[\U000F0000-\U000FFFFD]")


@runtime_checkable
class BackedTokenizer(Protocol):
    """A tokenizer over a Rust `tokenizers.Tokenizer` (transformers' fast ones, snapshots)."""

    backend_tokenizer: Any

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class _Specials:
    """One tokenizer's special tokens' strings, found in text by their first characters
    and lengths (Gemma 3 has thousands: no alternation regex), and their plain ids."""

    backend: Any
    strings: frozenset[str]
    lengths: tuple[int, ...]  # longest first: "<|im_start|>" before a shorter prefix of it
    starts: re.Pattern[str]
    heads: frozenset[str] = frozenset()  # the strings' proper prefixes
    plain_backend: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.heads = frozenset(s[:k] for s in self.strings for k in range(1, len(s)))

    def find(self, text: str) -> list[tuple[int, str]]:
        """(start, string) of each special token string in `text`, left to right, apart."""
        found: list[tuple[int, str]] = []
        end = 0
        for m in self.starts.finditer(text):
            i = m.start()
            if i < end:
                continue
            for n in self.lengths:
                if text[i:i + n] in self.strings:
                    found.append((i, text[i:i + n]))
                    end = i + n
                    break
        return found

    def to_hide(self, text: str) -> list[tuple[int, str]]:
        """(start, substring) of each piece of `text` to hide, left to right, apart: its
        special strings, and a special string's beginning at its end, whitespace aside
        (see the module's docstring)."""
        found = self.find(text)
        end = len(text.rstrip())
        start = next((end - k for k in range(min(end, self.lengths[0] - 1), 0, -1) if text[end - k:end] in self.heads),
                     end)
        if start < end and not (found and found[-1][0] + len(found[-1][1]) > start):
            found.append((start, text[start:end]))
        return found

    def wrap(self) -> tuple[list[int], list[int]]:
        """The special ids the tokenizer puts before and after one text (its post-processor)."""
        enc = self.backend.encode("a", add_special_tokens=True)
        mask = enc.special_tokens_mask
        first, last = mask.index(0), len(mask) - 1 - mask[::-1].index(0)
        return enc.ids[:first], enc.ids[last + 1:]

    def plain_ids(self, text: str) -> list[int]:
        """`text` tokenized as text, special strings in it not matched."""
        with self.lock:
            if self.plain_backend is None:
                from tokenizers import Tokenizer

                backend = Tokenizer.from_str(self.backend.to_str())
                backend.encode_special_tokens = True
                self.plain_backend = backend
        return self.plain_backend.encode(text, add_special_tokens=False).ids


_SPECIALS: weakref.WeakKeyDictionary[Any, _Specials | None] = weakref.WeakKeyDictionary()
_SPECIALS_LOCK = threading.Lock()


def _specials(tokenizer: Any) -> _Specials | None:
    """The tokenizer's special strings (None: it has none, or no Rust tokenizer to read them from)."""
    if not isinstance(tokenizer, BackedTokenizer):  # (None, or a slow tokenizer: nothing read)
        return None
    with _SPECIALS_LOCK:
        if tokenizer in _SPECIALS:
            return _SPECIALS[tokenizer]
        specials = None
        backend = tokenizer.backend_tokenizer
        strings = frozenset(t.content for t in backend.get_added_tokens_decoder().values()
                            if t.special and len(t.content) > 1)
        if strings:
            specials = _Specials(backend, strings, tuple(sorted({len(s) for s in strings}, reverse=True)),
                                 re.compile("[" + "".join(re.escape(c) for c in sorted({s[0] for s in strings})) + "]"))
        _SPECIALS[tokenizer] = specials
        return specials


_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special added tokens (turn markers, BOS/EOS, ...), read
    once per tokenizer; none where it has no Rust tokenizer to read them from."""
    if not isinstance(tokenizer, BackedTokenizer):
        return frozenset()
    with _SPECIALS_LOCK:
        if tokenizer not in _SPECIAL_IDS:
            _SPECIAL_IDS[tokenizer] = frozenset(
                i for i, t in tokenizer.backend_tokenizer.get_added_tokens_decoder().items() if t.special)
        return _SPECIAL_IDS[tokenizer]


@dataclass
class HiddenSpecials:
    """The placeholders one prompt's inputs got: character -> the special string it hides."""

    specials: _Specials | None = None
    strings: dict[str, str] = field(default_factory=dict)

    def encode(self, tokenizer: Any, text: str, add_special_tokens: bool = False) -> list[int]:
        """Rendered text (holding placeholders) to ids: the template's special strings as
        their tokens, the text between them (the client's strings put back) read as text;
        with `add_special_tokens` the tokenizer's own around them (vLLM's chat field: a BOS
        on top of the template's)."""
        if not self.strings:
            return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
        assert self.specials is not None
        if add_special_tokens:
            prefix, suffix = self.specials.wrap()
            return prefix + self.encode(tokenizer, text) + suffix
        ids: list[int] = []
        start = 0
        for i, string in self.specials.find(text):  # (the template's: the client's are placeholders)
            if i > start:
                ids += self.specials.plain_ids(self.shown(text[start:i]))
            ids += tokenizer.encode(string, add_special_tokens=False)
            start = i + len(string)
        if start < len(text):
            ids += self.specials.plain_ids(self.shown(text[start:]))
        return ids

    def shown(self, text: str) -> str:
        """The rendered text as the client wrote it (placeholders back to their strings)."""
        if not self.strings:
            return text
        return "".join(self.strings.get(ch, ch) for ch in text)


def hide_special_text(tokenizer: Any, value: Any) -> tuple[Any, HiddenSpecials]:
    """`value` (messages, tools: nested lists and dicts of strings) with every special
    token string in its strings, dict keys included, replaced by a placeholder; the input
    itself when it holds none (the common case: only a scan)."""
    specials = _specials(tokenizer)
    hidden = HiddenSpecials(specials)
    strings = text_strings(value) if specials is not None else []
    pieces = {s: found for s in strings if (found := specials.to_hide(s))}  # (each string scanned once)
    if not pieces:
        return value, hidden
    taken = {ord(c) for s in strings for c in _PRIVATE.findall(s)}
    free = (cp for cp in range(_PRIVATE_FIRST, _PRIVATE_LAST + 1) if cp not in taken)
    chars: dict[str, str] = {}  # special string -> its placeholder

    def hide(s: str) -> str:
        found = pieces.get(s)
        if not found:
            return s
        out, at = [], 0
        for i, string in found:
            if string not in chars:
                chars[string] = chr(next(free))
                hidden.strings[chars[string]] = string
            out += [s[at:i], chars[string]]
            at = i + len(string)
        return "".join(out) + s[at:]

    return _map_strings(value, hide), hidden


def text_strings(value: Any) -> list[str]:
    """Every string in nested lists and dicts, keys too (a tool schema's property name is
    rendered as its `tojson` writes it)."""
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
            stack.extend(k for k in v if isinstance(k, str))
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return out


def _map_strings(value: Any, fn: Any) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value
