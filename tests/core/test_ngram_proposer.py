"""core/ngram_proposer.py: prompt-lookup drafts against a plain Python reference, and the
speculative config's checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.config import SpeculativeConfig
from pagedserve.core import ngram_proposer
from pagedserve.core.ngram_proposer import NgramProposer, SpecDecodingStats
from tests.hypothesis_budget import examples


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix n-gram first; its latest earlier occurrence; what followed it."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def proposer(k: int = 4, min_n: int = 2, max_n: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=min_n, prompt_lookup_max=max_n))


def test_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    p = proposer(k=3)
    #          0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6]
    assert p.propose(tokens, 3) == [1, 2, 5]  # "5 6" last seen at 5, not at 0
    assert p.propose(tokens, 1) == [1]
    assert p.propose([1, 2, 3, 4], 3) == []  # no suffix repeats
    assert p.propose([7, 7], 3) == []  # too short for a 2-gram to occur earlier
    # The longest n-gram wins over a more recent shorter one.
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    assert p.propose(tokens, 2) == [40, 9]


def test_a_byte_match_straddling_two_ids_is_not_a_match() -> None:
    # 256 packs as 00 01 00 00; the pattern [1, 0] packs as 01 00 00 00 00 00 00 00, which
    # occurs inside [256, 0, 0] at byte offset 1 (not a multiple of 4).
    p = proposer(k=2, min_n=2, max_n=2)
    tokens = [256, 0, 0, 9, 1, 0]
    assert reference(tokens, 2, 2, 2) == []
    assert p.propose(tokens, 2) == []


def test_a_run_of_straddling_hits_costs_a_bounded_number_of_searches(monkeypatch) -> None:
    """[16640, 16640] packs as 00 41 00 00 00 41 00 00, which 4-byte ids of a run of 65s
    hold one byte into every id: each such hit was one more search on the engine thread
    (thousands a step for a long prompt).  Past a few, the ids are searched as characters,
    with the same answers; ids too large for that keep the skipping search."""
    searches = 0

    class Counted(bytes):
        def rfind(self, *args) -> int:
            nonlocal searches
            searches += 1
            return super().rfind(*args)

    class CountedArray:
        def __init__(self, typecode: str, ids: list[int]) -> None:
            self.ids = ids

        def tobytes(self) -> bytes:
            from array import array
            return Counted(array("i", self.ids).tobytes())

    monkeypatch.setattr(ngram_proposer, "array", CountedArray)
    p = proposer(k=3, min_n=2, max_n=4)
    for tokens in ([65] * 2000 + [16640] * 3, [65] * 2000 + [16640] * 2, [16640, 16640, 7] + [65] * 2000 + [16640] * 2):
        searches = 0
        assert p.propose(tokens, 3) == reference(tokens, 3, 2, 4)
        assert searches <= 3 * (8 + 2), searches  # (MAX_STRADDLING_HITS, 8, skips at most)
    tokens = [2**24] + [65] * 50 + [16640] * 3  # (an id past the characters: skipped one at a time, still right)
    assert p.propose(tokens, 3) == reference(tokens, 3, 2, 4)


@settings(max_examples=examples(300), deadline=None)
@given(tokens=st.lists(st.sampled_from([0, 1, 2, 256, 65536, 2**24, 2**31 - 1]), min_size=0, max_size=40),
       k=st.integers(1, 6), min_n=st.integers(1, 3), extra=st.integers(0, 3))
def test_matches_the_reference(tokens: list[int], k: int, min_n: int, extra: int) -> None:
    max_n = min_n + extra
    assert proposer(k, min_n, max_n).propose(tokens, k) == reference(tokens, k, min_n, max_n)


def test_number_of_drafts_adapts_to_acceptance() -> None:
    p = proposer(k=4)
    assert p.next_num_drafts(4, 0) == 1  # a miss: draft one next time
    assert p.next_num_drafts(1, 1) == 2  # a full hit grows it
    assert p.next_num_drafts(4, 4) == 4  # never past num_speculative_tokens
    assert p.next_num_drafts(3, 2) == 3


def test_stats_count_acceptances_by_position() -> None:
    s = SpecDecodingStats(num_accepted_tokens_per_pos=[0, 0, 0])
    s.observe(3, 2)
    s.observe(2, 0)
    s.observe(3, 3)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 8, 5)
    assert s.num_accepted_tokens_per_pos == [2, 2, 1]
    assert s.acceptance_rate == pytest.approx(5 / 8)


@pytest.mark.parametrize(("values", "message"), [
    ({"method": "eagle"}, "speculative_config.method"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 16}, "at most 15"),
    ({"prompt_lookup_max": 33}, "prompt_lookup_max must be at most 32"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"method": "draft_model"}, "speculative_config.model: method 'draft_model' needs"),
    ({"method": "draft_model", "model": ""}, "speculative_config.model: method 'draft_model' needs"),
    ({"method": "ngram", "model": "some/draft"}, "speculative_config.model is for method 'draft_model'"),
    ({"num_spec_tokens": 3}, "unknown field"),
    ([1, 2], "must be a dict"),
])
def test_bad_config_is_refused_naming_the_field(values: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(values)


def test_a_model_means_draft_model_and_no_model_means_ngram() -> None:
    assert SpeculativeConfig.from_dict({"model": "some/draft"}).method == "draft_model"
    assert SpeculativeConfig.from_dict({}).method == "ngram"


def test_propose_batch_is_propose_per_request() -> None:
    p = proposer()
    tokens = [5, 6, 1, 2, 5, 6]
    assert p.propose_batch([("a", tokens, 2), ("b", [1, 2, 3], 2)]) == {"a": [1, 2], "b": []}
