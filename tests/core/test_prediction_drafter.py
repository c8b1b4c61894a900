"""The predicted-output drafter (core/prediction_drafter.py): it follows the output
through the prediction, loses the place at an edit and finds it again after, and
every proposal is a contiguous slice of the prediction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.config import MAX_SPECULATIVE_TOKENS
from pagedserve.core.prediction_drafter import PredictionDrafter, merge_matched, pack_ids
from tests.hypothesis_budget import examples

PRED = list(range(100, 140))  # 40 distinct tokens


def test_aligned_output_proposes_what_follows_and_advances() -> None:
    d = PredictionDrafter(PRED)
    assert d.propose([]) == PRED[:MAX_SPECULATIVE_TOKENS]
    d.settle(MAX_SPECULATIVE_TOKENS, MAX_SPECULATIVE_TOKENS)
    out = PRED[:16]  # every draft accepted, plus the bonus token
    assert d.propose(out) == PRED[16:31]
    d.settle(15, 15)
    assert d.propose(PRED[:32]) == PRED[32:40]  # the prediction's tail, shorter than the limit
    assert d.propose(PRED) == []  # used up
    assert d.counts == (40, 0)  # (OpenAI's: every prediction token appears in the completion)


def test_a_miss_shrinks_the_next_drafts_and_a_full_hit_restores_them() -> None:
    d = PredictionDrafter(PRED)
    d.propose([])
    d.settle(15, 3)
    assert d.num_drafts == 4 and d.counts == (0, 40)  # (verdicts size drafts; tokens count once walked)
    assert len(d.propose(PRED[:4])) == 4
    d.settle(4, 4)
    assert d.num_drafts == MAX_SPECULATIVE_TOKENS


def test_an_inserted_line_loses_the_place_and_the_following_tokens_find_it() -> None:
    d = PredictionDrafter(PRED)
    out = PRED[:10] + [7, 8, 9]  # an insertion after the tenth token
    assert d.propose(out) == [] or d.pos is not None  # lost (or found by chance nearby)
    out += PRED[10:12]  # the original resumes: its last two tokens re-find the place
    assert d.propose(out)[:3] == PRED[12:15]


def test_a_renamed_token_is_skipped_by_the_next_one() -> None:
    d = PredictionDrafter(PRED)
    out = PRED[:5] + [999]  # PRED[5] renamed
    assert d.propose(out) == []
    out.append(PRED[6])  # the token after the rename: one token near the old place suffices
    assert d.propose(out)[:2] == PRED[7:9]


def test_a_deleted_run_is_found_further_on() -> None:
    d = PredictionDrafter(PRED)
    out = PRED[:5] + PRED[20:23]  # 15 tokens dropped
    assert d.propose(out)[:2] == PRED[23:25]


def test_a_repeated_phrase_prefers_the_occurrence_after_the_last_agreement() -> None:
    pred = [1, 2, 3, 50, 51, 4, 5, 6, 50, 51, 7, 8]
    d = PredictionDrafter(pred)
    out = [1, 2, 3, 50, 51, 4, 5, 6, 99, 50, 51]  # an insertion before the second "50 51"
    assert d.propose(out)[:2] == [7, 8]


def test_text_that_never_meets_the_prediction_proposes_nothing() -> None:
    d = PredictionDrafter(PRED)
    assert d.propose([1, 2, 3, 4, 5]) == []
    assert d.propose([1, 2, 3, 4, 5, 6, 7]) == []


def test_ids_that_straddle_packed_bytes_never_match() -> None:
    # 256, 0, 0 pack to bytes in which the ids 1, 0 appear one byte in: only whole ids count.
    d = PredictionDrafter([256, 0, 0, 7, 1, 0, 3, 4, 5])
    assert d.propose([42, 1, 0]) == [3, 4, 5]


@settings(max_examples=examples(200), deadline=None)
@given(ids=st.lists(st.integers(0, 2**28 - 1) | st.sampled_from([0, 1, 65, 256, 16640, 2**21]), max_size=20),
       pattern=st.lists(st.integers(0, 2**28 - 1) | st.sampled_from([0, 1, 65, 256, 16640, 2**21]), min_size=1,
                        max_size=3))
def test_packed_ids_only_occur_at_whole_ids(ids, pattern) -> None:
    """Every occurrence of a packed id sequence in another starts at a whole id (a search
    that skipped the others one find at a time cost thousands per token: 65s and 16640s)."""
    packed, needle = pack_ids(ids), pack_ids(pattern)
    hits = [at for at in range(len(packed) - len(needle) + 1) if packed.startswith(needle, at)]
    assert all(at % 4 == 0 for at in hits)
    assert [at // 4 for at in hits] == [i for i in range(len(ids) - len(pattern) + 1) if ids[i:i + len(pattern)] == pattern]


@settings(max_examples=examples(200), deadline=None)
@given(pred=st.lists(st.integers(0, 6), max_size=30), outputs=st.lists(st.integers(0, 6), max_size=40),
       steps=st.lists(st.integers(1, 5), min_size=1, max_size=12),
       verdicts=st.lists(st.integers(0, 15), min_size=12, max_size=12))
def test_proposals_are_always_a_contiguous_slice_of_the_prediction(pred, outputs, steps, verdicts) -> None:
    d = PredictionDrafter(pred)
    seen = 0
    for i, k in enumerate(steps):
        seen = min(len(outputs), seen + k)
        drafts = d.propose(outputs[:seen])
        assert len(drafts) <= MAX_SPECULATIVE_TOKENS
        if drafts:
            assert any(pred[j:j + len(drafts)] == drafts for j in range(len(pred) - len(drafts) + 1))
            # an aligned place: the drafts start where the prediction continues the output
            assert d.pos is not None and pred[d.pos:d.pos + len(drafts)] == drafts
            accepted = min(verdicts[i], len(drafts))
            d.settle(len(drafts), accepted)
    accepted, rejected = d.counts
    assert accepted >= 0 and rejected >= 0 and accepted + rejected == len(pred)
    assert accepted <= seen  # (each matched prediction token is an output token's)


def test_usage_counts_the_predictions_tokens_that_appear_in_the_completion() -> None:
    """OpenAI's accepted_prediction_tokens: the prediction's tokens that appear in the
    completion; rejected: the others.  They were draft verdicts: the first token and each
    bonus token never counted, and a prediction never drafted counted nowhere (an unrelated
    one reported 0 / 0, as an empty one)."""
    def usage(pred: list[int], out: list[int], step: int = 3) -> tuple[int, int]:
        d, matched = PredictionDrafter(pred), bytearray()
        for end in range(step, len(out) + step, step):
            kept = out[:end]
            num_new = len(kept) - len(matched)
            merge_matched(matched, num_new, d.keep(kept, num_new))
        assert sum(matched) == d.counts[0]
        return d.counts

    assert usage(PRED, PRED) == (40, 0)  # the answer itself
    assert usage(PRED, list(range(500, 530))) == (0, 40)  # unrelated
    assert usage(PRED * 5, PRED) == (40, 160)  # five times the answer: four copies unused
    assert usage(PRED, PRED[:20]) == (20, 20)  # the answer stopped halfway
    renamed = PRED[:10] + [999] + PRED[11:]
    accepted, rejected = usage(PRED, renamed)
    assert (accepted, rejected) == (39, 1)  # (the renamed token alone: those after it re-found the place)
    assert usage([], [1, 2, 3]) == (0, 0)


@settings(max_examples=examples(300), deadline=None)
@given(pred=st.lists(st.integers(0, 8), max_size=40), out=st.lists(st.integers(0, 8), max_size=50),
       steps=st.lists(st.integers(1, 9), min_size=1, max_size=60))
def test_the_usage_counts_do_not_depend_on_how_steps_cut_the_output(pred, out, steps) -> None:
    """The same completion reported different accepted/rejected counts with another
    --speculative-config (or under load): the place was looked for once per step, after
    its last token, so which tokens matched depended on where steps ended."""
    def walk(sizes: list[int]) -> tuple[tuple[int, int], bytes]:
        d, matched, seen = PredictionDrafter(pred), bytearray(), 0
        for size in sizes:
            if seen >= len(out):
                break
            seen = min(len(out), seen + size)
            d.propose(out[:seen - 1])  # (a step starts from the output before it, as the scheduler's)
            merge_matched(matched, seen - len(matched), d.keep(out[:seen], seen - len(matched)))
        if seen < len(out):
            merge_matched(matched, len(out) - seen, d.keep(out, len(out) - seen))
        assert sum(matched) == d.counts[0]
        return d.counts, bytes(matched)

    assert walk(steps) == walk([1] * len(out))
