"""N-gram (prompt lookup) drafting for speculative decoding, on the host, per request.

Text that copies (an edited code snippet given back, a summary that quotes, JSON that
echoes its input) repeats runs of the sequence so far.  Take the sequence's last n
tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`), find their latest
earlier occurrence, and propose the tokens that followed it.  The search runs in C
(`NgramSearch`).

How many drafts a request gets adapts to how many were accepted (`next_num_drafts`):
a draft that is rejected costs a verified position in the next forward and buys
nothing, so after a miss a request drafts fewer, and after a full hit more, up to
`num_speculative_tokens`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve.config import SpeculativeConfig

# Hits that straddle two packed ids a search skips one at a time (each skip one more
# search, on the engine thread) before it searches the ids as characters instead.
MAX_STRADDLING_HITS = 8
CHARACTERS = 0x110000  # ids below it are each one character of a str

# What the scheduler asks a drafter about one decoding request: its id, its tokens so
# far (prompt and output), and how many drafts it may get.
DraftRequest = tuple[str, list[int], int]


def next_num_drafts(max_drafts: int, num_drafted: int, num_accepted: int) -> int:
    """Drafts to allow a request next: one more than were accepted (so a full hit grows
    it), at least one, at most `max_drafts`; a rejected draft costs a verified position
    and buys nothing.  Every drafter uses this rule."""
    return max(1, min(max_drafts, num_accepted + 1))


class Drafter(Protocol):
    """What proposes drafts to the scheduler: `NgramProposer` here, or a draft model
    (worker/draft_model.py, which the engine hands in: core never runs a model)."""

    max_drafts: int

    def propose_batch(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        """Drafts for each request (an id missing or [] : none this step)."""
        ...

    def next_num_drafts(self, num_drafted: int, num_accepted: int) -> int:
        """Drafts to allow a request next, after `num_accepted` of `num_drafted` were accepted."""
        ...

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests finished: drop whatever is kept for them."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.max_drafts = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], num_drafts: int) -> list[int]:
        """Up to `num_drafts` tokens that followed the latest earlier occurrence of the
        longest suffix n-gram of `token_ids`; [] when no suffix of at least `min_n`
        tokens occurs earlier."""
        length = len(token_ids)
        if num_drafts <= 0 or length <= self.min_n:
            return []
        search = NgramSearch(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            if (at := search.latest(n)) >= 0:
                return token_ids[at + n: at + n + num_drafts]
        return []

    def propose_batch(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        return {req_id: self.propose(token_ids, n) for req_id, token_ids, n in requests}

    def next_num_drafts(self, num_drafted: int, num_accepted: int) -> int:
        return next_num_drafts(self.max_drafts, num_drafted, num_accepted)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Nothing is kept per request."""


class NgramSearch:
    """Where a sequence's last n ids occur latest, ending before its last id (so that
    something follows them).  The ids packed as 4-byte integers, `bytes.rfind` finds the
    packed n-gram; a hit one to three bytes in straddles two ids and is skipped.  Past
    MAX_STRADDLING_HITS of them (a run of one low id: [16640, 16640] sits one byte into
    every id of a run of 65s, thousands of searches a step for a long prompt), the ids as
    one character each, where they fit, and `str.rfind`, which matches whole ones."""

    def __init__(self, token_ids: list[int]) -> None:
        self.ids = token_ids
        self.packed = array("i", token_ids).tobytes()
        self.text: str | None = None
        self.fits_text: bool | None = None  # every id below CHARACTERS (asked once, when needed)

    def latest(self, n: int) -> int:
        """The index of the latest such occurrence of the last `n` ids, or -1."""
        length = len(self.ids)
        if self.text is not None:
            return self.text.rfind(self.text[length - n:], 0, length - 1)
        packed = self.packed
        pattern = packed[(length - n) * 4:]
        pos, skipped = packed.rfind(pattern, 0, (length - 1) * 4), 0
        while pos > 0 and pos % 4:
            if (skipped := skipped + 1) > MAX_STRADDLING_HITS:
                if self.fits_text is None:
                    self.fits_text = max(self.ids) < CHARACTERS
                if self.fits_text:
                    self.text = "".join(map(chr, self.ids))
                    return self.latest(n)
            pos = packed.rfind(pattern, 0, pos + len(pattern) - 1)
        return pos // 4 if pos >= 0 else -1


@dataclass
class SpecDecodingStats:
    """Cumulative counts, vLLM's spec_decode metrics: verification steps with drafts,
    drafts proposed, drafts accepted, and acceptances by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_accepted:
            per_pos.extend([0] * (num_accepted - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
