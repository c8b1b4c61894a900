"""The seed a request's generator gets (worker/input_batch.py)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.worker.input_batch import generator_seed

CPU = torch.device("cpu")


@given(st.integers(0, 2**32 - 1))
def test_a_32_bit_seed_seeds_as_itself(seed: int) -> None:
    assert generator_seed(seed, CPU) == seed


@given(st.integers(-(2**63), 2**63 - 1))
def test_cuda_takes_every_seed_as_it_is(seed: int) -> None:
    """(CUDA's Philox keeps all 64 bits: nothing to mix.)"""
    assert generator_seed(seed, torch.device("cuda")) == seed


@given(st.integers(-(2**63), 2**63 - 1), st.integers(1, 2**31 - 1))
def test_seeds_2_to_the_32_apart_sample_apart(seed: int, k: int) -> None:
    """torch's CPU generator keeps a seed's low 32 bits: 1 and 1 + 2**32 sampled alike, and
    an n > 1 child of seed 2**32 - 1 (its seed + 1) like a request of seed 0.  (Two mixed
    seeds meet with probability 2**-32 a pair: hypothesis's hundred pairs do not.)"""
    other = seed + k * 2**32
    if other > 2**63 - 1:
        other = seed - k * 2**32
    assert 0 <= generator_seed(seed, CPU) < 2**32
    assert generator_seed(seed, CPU) != generator_seed(other, CPU)


def test_the_generators_differ_where_torch_alone_would_not() -> None:
    def draws(seed: int) -> torch.Tensor:
        return torch.rand(4, generator=torch.Generator().manual_seed(generator_seed(seed, CPU)))

    assert torch.equal(torch.rand(4, generator=torch.Generator().manual_seed(1)),
                       torch.rand(4, generator=torch.Generator().manual_seed(1 + 2**32)))  # (torch's own)
    assert not torch.equal(draws(1), draws(1 + 2**32)) and not torch.equal(draws(0), draws(2**32))


def _thinking_batch():
    from pagedserve.core.sched_output import CachedRequestData, NewRequestData
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.worker.input_batch import InputBatch

    ib = InputBatch(max_num_reqs=4, max_model_len=64, block_size=16, vocab_size=32, device=torch.device("cpu"))
    budget = SamplingParams(max_tokens=20, thinking_token_budget=2, allowed_token_ids=[3, 4])
    budget.thinking_tags = (7, 8, True)  # (the prompt opened the block)
    ib.add_request(NewRequestData("a", [1, 7], [], budget, [0], 0))  # the prompt opened the block
    ib.add_request(NewRequestData("b", [1, 2], [], SamplingParams(max_tokens=20), [1], 0))
    return ib, CachedRequestData


def test_a_spent_thinking_budget_allows_only_the_end_tag_on_its_own_row() -> None:
    ib, cached = _thinking_batch()
    rows = [ib.req_id_to_row["b"], ib.req_id_to_row["a"]]
    md = ib.sampling_metadata(rows)
    assert sorted(zip(*(t.tolist() for t in md.allowed_pairs), strict=True)) == [(1, 3), (1, 4)]  # its own list
    ib.update_cached(cached(["a"], [[5, 6]], [[]], [3]))  # two thinking tokens: spent
    md = ib.sampling_metadata(rows)
    assert md.allowed_rows.tolist() == [1] and list(zip(*(t.tolist() for t in md.allowed_pairs), strict=True)) == [(1, 8)]
    ib.update_cached(cached(["a"], [[8]], [[]], [4]))  # closed: free again (its own list)
    assert ib.sampling_metadata(rows).allowed_pairs[1].tolist() == [3, 4]


def test_a_pending_token_is_read_before_deciding_the_end() -> None:
    """Under overlap scheduling a row's newest token is still on the device: the second
    thinking token spends the budget, an end tag closes the block."""
    ib, cached = _thinking_batch()
    ib.update_cached(cached(["a"], [[5]], [[]], [2]))
    row = ib.req_id_to_row["a"]
    for token, forced in ((6, True), (8, False)):
        md = ib.sampling_metadata([row], pending=([0], torch.tensor([token])))
        assert (md.allowed_pairs[1].tolist() == [8]) is forced
