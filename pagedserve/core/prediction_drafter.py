"""Predicted outputs (OpenAI's `prediction`): the text a client expects back, used as
that one request's draft source for speculative decoding.

A client editing a file sends the file as its prediction: most of the answer copies it,
with a few changes (a renamed variable, a line added).  So the request keeps its place
in the prediction: while its output tokens match the prediction they advance the
place, and the drafts are the prediction's next tokens from there.  When the output
leaves the prediction (the edit) the place is lost, and found again once the output's
last few tokens occur in the prediction: the longest such suffix (`RESYNC_MAX_N` down
to `RESYNC_MIN_N` tokens), preferring its first occurrence at or after where the two
last agreed (edits move forward through a file); failing that, the last output token
alone a few tokens past that point (a substituted token or two: a rename).

Drafts are only proposals: the model runner verifies them exactly as it verifies
n-gram drafts, so a wrong place costs a wasted verified position and never changes the
output.  Every proposal is a contiguous slice of the prediction.  Pure Python, per
request, kept on `Request.prediction`.

It also counts what the server reports as OpenAI's usage: `accepted_prediction_tokens`,
the prediction's tokens that appear in the completion (each output token that matched
the prediction at its place, or whose match found the place again, marks that
prediction token, once), and `rejected_prediction_tokens`, the rest of the prediction;
the two add up to the prediction's length.  Draft verdicts (`settle`) only size the
next drafts: the first token and each step's bonus token count as well when they match.
"""

from __future__ import annotations

from pagedserve.config import MAX_SPECULATIVE_TOKENS

# Suffix lengths tried when the place is lost: long enough that a match is rarely by
# chance, short enough that the place is found a few tokens after an edit.
RESYNC_MAX_N = 6
RESYNC_MIN_N = 2
# How far past the last agreed position a single token may re-find the place.
NEAR_WINDOW = 8


def pack_ids(token_ids: list[int]) -> bytes:
    """Token ids (below 2**28, any vocabulary's) as 4 bytes each, 7 bits a byte, the first
    with its high bit set and the others clear: a packed sequence can only occur in another
    at a multiple of 4, so `bytes.find` searches whole ids in C.  (Plain 4-byte ints also
    matched across two ids, each such hit another search: a prediction of one low id
    repeated cost thousands of calls per output token on the engine thread.)"""
    out = bytearray()
    for t in token_ids:
        out += bytes((0x80 | t >> 21 & 0x7F, t >> 14 & 0x7F, t >> 7 & 0x7F, t & 0x7F))
    return bytes(out)


class PredictionDrafter:
    """One request's place in its prediction, and its draft counts."""

    def __init__(self, token_ids: list[int], max_drafts: int = MAX_SPECULATIVE_TOKENS) -> None:
        self.token_ids = list(token_ids)
        self.max_drafts = max_drafts
        self._packed = pack_ids(self.token_ids)  # (searched in C)
        self.pos: int | None = 0  # the prediction index the next output token should be; None: lost
        self.anchor = 0  # where output and prediction last agreed: searches start here
        self.num_seen = 0  # output tokens already walked
        # Drafts to propose next: all it may while they are accepted, one more than were
        # accepted after a miss (a rejected draft costs a verified position).
        self.num_drafts = max_drafts
        self.proposed = False  # whether this step's drafts came from here (else from n-gram)
        self.used = bytearray(len(self.token_ids))  # prediction tokens the completion has matched
        self.num_used = 0
        self.matched = bytearray()  # per output token walked: whether it matched a prediction token

    @property
    def counts(self) -> tuple[int, int]:
        """OpenAI's (accepted, rejected) prediction tokens so far: the prediction's tokens
        the completion matched, and the others."""
        return self.num_used, len(self.token_ids) - self.num_used

    def propose(self, output_token_ids: list[int]) -> list[int]:
        """The prediction's next tokens after `output_token_ids` (the request's output so
        far), at most `num_drafts`; [] when the place is lost or the prediction is used up."""
        self._follow(output_token_ids)
        pos = self.pos
        drafts = self.token_ids[pos: pos + self.num_drafts] if pos is not None else []
        self.proposed = bool(drafts)
        return drafts

    def settle(self, num_drafted: int, num_accepted: int) -> None:
        """The runner verified `num_drafted` of this step's drafts and kept `num_accepted`:
        all of them again next step while they are kept, else one more than were."""
        self.num_drafts = self.max_drafts if num_accepted == num_drafted else max(1, num_accepted + 1)

    def keep(self, output_token_ids: list[int], num_new: int) -> bytes:
        """The step's tokens kept (the last `num_new` of the output: a stop cut any past
        it), walked now: for each of the output's last tokens this step may have marked
        (the new ones, and up to RESYNC_MAX_N - 1 before them that a suffix re-finding
        the place marks), whether it matched a prediction token (`merge_matched` lays
        them over the tokens reported before)."""
        self._follow(output_token_ids)
        end = len(output_token_ids)
        return bytes(self.matched[max(0, end - num_new - RESYNC_MAX_N + 1):end])

    def _follow(self, output: list[int]) -> None:
        """Walk the output tokens not seen yet, one at a time (so the counts are the
        prediction's and the completion's alone, however the steps cut the output):
        advance while they match, else lose the place and look for it again after each
        token until found."""
        pred, pos, matched = self.token_ids, self.pos, self.matched
        end = len(pred)
        for i in range(self.num_seen, len(output)):
            if pos is not None and pos < end and pred[pos] == output[i]:
                matched.append(self._use(pos))
                pos += 1
                continue
            if pos is not None:
                self.anchor, pos = pos, None
            matched.append(0)
            found = self._resync(output[max(0, i + 1 - RESYNC_MAX_N):i + 1])
            if found is not None:
                pos, n = found
                for k in range(n):  # the tokens that found the place match the ones before it
                    if not matched[i - k]:
                        matched[i - k] = self._use(pos - 1 - k)
        self.num_seen = len(output)
        self.pos = pos

    def _use(self, p: int) -> int:
        """Prediction token `p` appears in the completion: 1 the first time, 0 after."""
        if self.used[p]:
            return 0
        self.used[p] = 1
        self.num_used += 1
        return 1

    def _resync(self, tail: list[int]) -> tuple[int, int] | None:
        """(where the prediction continues the output's last tokens `tail`, how many of
        those tokens matched there), if anywhere."""
        packed, anchor = self._packed, self.anchor * 4
        packed_tail = pack_ids(tail)
        for n in range(min(RESYNC_MAX_N, len(tail)), RESYNC_MIN_N - 1, -1):
            pattern = packed_tail[len(packed_tail) - 4 * n:]
            at = packed.find(pattern, anchor)
            if at < 0:
                at = packed.find(pattern, 0, anchor + len(pattern) - 4)
            if at >= 0:
                return at // 4 + n, n
        at = packed.find(packed_tail[-4:], anchor, min(len(packed), anchor + 4 * NEAR_WINDOW))
        return (at // 4 + 1, 1) if at >= 0 else None


def merge_matched(matched: bytearray, num_new: int, tail: bytes) -> None:
    """`matched` (per output token reported so far: whether it matched a prediction token)
    after a step that added `num_new` tokens and reported `tail` (PredictionDrafter.keep:
    the marks of the output's last len(tail) tokens, new ones and re-marked ones)."""
    matched.extend(bytes(num_new))
    k = min(len(tail), len(matched))
    matched[len(matched) - k:] = tail[len(tail) - k:]
