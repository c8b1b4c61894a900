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
