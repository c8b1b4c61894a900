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
request, kept on `Request.prediction`; the counts of drafts accepted and rejected are
what the server reports as `accepted_prediction_tokens` / `rejected_prediction_tokens`.
"""

from __future__ import annotations

from array import array

from pagedserve.config import MAX_SPECULATIVE_TOKENS

# Suffix lengths tried when the place is lost: long enough that a match is rarely by
# chance, short enough that the place is found a few tokens after an edit.
RESYNC_MAX_N = 6
RESYNC_MIN_N = 2
# How far past the last agreed position a single token may re-find the place.
NEAR_WINDOW = 8


class PredictionDrafter:
    """One request's place in its prediction, and its draft counts."""

    def __init__(self, token_ids: list[int], max_drafts: int = MAX_SPECULATIVE_TOKENS) -> None:
        self.token_ids = list(token_ids)
        self.max_drafts = max_drafts
        # 4-byte ids, so `bytes.find` searches the prediction in C (a hit must start on a
        # multiple of 4: one that straddles two ids is skipped).
        self._packed = array("i", self.token_ids).tobytes()
        self.pos: int | None = 0  # the prediction index the next output token should be; None: lost
        self.anchor = 0  # where output and prediction last agreed: searches start here
        self.num_seen = 0  # output tokens already walked
        # Drafts to propose next: all it may while they are accepted, one more than were
        # accepted after a miss (a rejected draft costs a verified position).
        self.num_drafts = max_drafts
        self.proposed = False  # whether this step's drafts came from here (else from n-gram)
        self.num_accepted = 0
        self.num_rejected = 0

    @property
    def counts(self) -> tuple[int, int]:
        """(drafts accepted, drafts rejected) so far."""
        return self.num_accepted, self.num_rejected

    def propose(self, output_token_ids: list[int]) -> list[int]:
        """The prediction's next tokens after `output_token_ids` (the request's output so
        far), at most `num_drafts`; [] when the place is lost or the prediction is used up."""
        self._follow(output_token_ids)
        pos = self.pos
        drafts = self.token_ids[pos: pos + self.num_drafts] if pos is not None else []
        self.proposed = bool(drafts)
        return drafts

    def settle(self, num_drafted: int, num_accepted: int) -> None:
        """The runner verified `num_drafted` of this step's drafts and kept `num_accepted`."""
        self.num_accepted += num_accepted
        self.num_rejected += num_drafted - num_accepted
        self.num_drafts = self.max_drafts if num_accepted == num_drafted else max(1, num_accepted + 1)

    def keep(self, num_predicted: int, num_kept: int) -> int:
        """A step's first `num_predicted` tokens were accepted drafts, of which a stop (a
        token, the length) kept `num_kept` at most: the rest are not in the completion, so
        they count as rejected (OpenAI: prediction tokens that do not appear in it).
        Returns how many of the kept tokens are accepted drafts."""
        cut = max(num_predicted - num_kept, 0)
        self.num_accepted -= cut
        self.num_rejected += cut
        return num_predicted - cut

    def _follow(self, output: list[int]) -> None:
        """Walk the output tokens not seen yet: advance while they match, else lose the
        place and look for it again."""
        pred, pos = self.token_ids, self.pos
        end = len(pred)
        for i in range(self.num_seen, len(output)):
            if pos is None:
                continue
            if pos < end and pred[pos] == output[i]:
                pos += 1
            else:
                self.anchor, pos = pos, None
        if self.num_seen < len(output) and pos is None:
            pos = self._resync(output)
        self.num_seen = len(output)
        self.pos = pos
        if pos is not None:
            self.anchor = pos

    def _resync(self, output: list[int]) -> int | None:
        """Where the prediction continues the output's last tokens, if anywhere."""
        packed, anchor = self._packed, self.anchor * 4
        tail = array("i", output[-RESYNC_MAX_N:]).tobytes()
        for n in range(min(RESYNC_MAX_N, len(output)), RESYNC_MIN_N - 1, -1):
            pattern = tail[len(tail) - 4 * n:]
            at = self._find(pattern, anchor, len(packed))
            if at < 0:
                at = self._find(pattern, 0, anchor + len(pattern) - 4)
            if at >= 0:
                return at // 4 + n
        at = self._find(tail[-4:], anchor, min(len(packed), anchor + 4 * NEAR_WINDOW))
        return at // 4 + 1 if at >= 0 else None

    def _find(self, pattern: bytes, start: int, stop: int) -> int:
        """Byte offset of the first id-aligned occurrence of `pattern` in [start, stop), or -1."""
        packed = self._packed
        at = packed.find(pattern, start, stop)
        while at >= 0 and at % 4:
            at = packed.find(pattern, at + 1, stop)
        return at
