"""worker/rejection_sampler.py: greedy verification is the argmax run, and random
verification leaves the distribution of every emitted token exactly the sampler's."""

from __future__ import annotations

import pytest
import torch

from pagedserve.worker.rejection_sampler import DraftVerdict, verify_drafts
from pagedserve.worker.sampler import Sampler, SamplingMetadata

VOCAB = 8
# Chi-square critical value for 7 degrees of freedom at p = 0.001.
CHI2_CRIT_7 = 24.32


def test_greedy_accepts_the_argmax_run_and_replaces_the_first_miss() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, VOCAB)
    top = logits.argmax(-1).tolist()
    drafts = [[top[0], top[1], (top[2] + 1) % VOCAB], [top[3], top[4]], [(top[5] + 1) % VOCAB]]
    verdicts = verify_drafts(Sampler(), logits, SamplingMetadata(all_greedy=True, all_random=False), drafts)
    assert verdicts == [DraftVerdict(2, top[2]), DraftVerdict(2, None), DraftVerdict(0, top[5])]


def test_a_row_that_is_not_a_distribution_fails_its_request_only() -> None:
    logits = torch.randn(3, VOCAB)
    logits[1, 0] = float("nan")
    top = logits.argmax(-1).tolist()
    verdicts = verify_drafts(Sampler(), logits, SamplingMetadata(all_greedy=True, all_random=False),
                             [[top[0], 1], [top[2]]])
    assert verdicts[0].invalid and not verdicts[1].invalid


def _random_md(n: int, temperature: float, top_k: int | None, top_p: float | None) -> SamplingMetadata:
    return SamplingMetadata(
        all_greedy=False, all_random=True, temperature=torch.full((n,), temperature),
        top_k=None if top_k is None else torch.full((n,), top_k, dtype=torch.long),
        top_p=None if top_p is None else torch.full((n,), top_p))


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "draft"), [
    (1.0, None, None, 2),  # a likely draft
    (1.0, None, None, 7),  # an unlikely one
    (0.7, 5, 0.9, 3),  # processed distribution
    (0.7, 5, 0.9, 0),  # a draft outside top-k: probability 0, never accepted
])
def test_emitted_token_has_the_sampler_distribution(temperature: float, top_k: int | None, top_p: float | None,
                                                    draft: int) -> None:
    """20,000 verifications of one draft each: the emitted token (the draft if accepted,
    else the replacement) must follow the processed distribution p (chi-square, p=0.001)."""
    n = 20_000
    row = torch.tensor([0.1, 1.5, 1.2, 0.8, 0.3, -0.5, 0.9, -1.0])
    logits = row.expand(n, VOCAB).clone()
    md = _random_md(n, temperature, top_k, top_p)
    gen = torch.Generator().manual_seed(1234)
    sampler = Sampler(gen)
    verdicts = verify_drafts(sampler, logits, md, [[draft]] * n)
    emitted = torch.tensor([draft if v.replacement is None else v.replacement for v in verdicts])
    p = Sampler.processed_probs(row[None].clone(), _random_md(1, temperature, top_k, top_p))[0]
    counts = torch.bincount(emitted, minlength=VOCAB).double()
    expected = p.double() * n
    support = expected > 0
    assert counts[~support].sum() == 0, "a token outside the distribution was emitted"
    chi2 = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    assert chi2 < CHI2_CRIT_7, (chi2, counts.tolist(), expected.tolist())
    accepted = sum(v.num_accepted for v in verdicts) / n
    assert accepted == pytest.approx(float(p[draft]), abs=0.015)  # accepted with probability p(draft)


def test_mixed_greedy_and_random_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB)
    top = logits.argmax(-1).tolist()
    md = SamplingMetadata(all_greedy=False, all_random=False, temperature=torch.tensor([1.0, 1.0]),
                          greedy=torch.tensor([True, False]))
    wrong = (top[0] + 1) % VOCAB
    verdicts = verify_drafts(Sampler(torch.Generator().manual_seed(0)), logits, md, [[wrong], [top[1]]])
    assert verdicts[0] == DraftVerdict(0, top[0])  # the greedy row: argmax, no chance involved


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_a_seeded_request_emits_what_it_would_one_token_at_a_time(accepted: int) -> None:
    """Drafts verified for a seeded request emit the tokens its generator gives one token
    at a time, and leave the generator where one token at a time would: after the
    verdict and the ordinary sampler's draw for the last position, it has given one draw
    per emitted token, so the tokens after this step match too."""
    k, seed = 4, 99
    torch.manual_seed(1)
    logits = torch.randn(k + 1, VOCAB) * 0.3  # flat: a wrong draft is likely to be drawn against
    one_md = _random_md(1, 1.0, None, None)
    alone = torch.Generator().manual_seed(seed)
    one_md.generators = {0: alone}
    singly = [int(Sampler().draw(Sampler.processed_probs(logits[j:j + 1].clone(), one_md), one_md))
              for j in range(k + 1)]
    drafts = singly[:accepted] + [(t + 1) % VOCAB for t in singly[accepted:k]]
    gen = torch.Generator().manual_seed(seed)
    md = _random_md(k, 1.0, None, None)
    md.generators = dict.fromkeys(range(k), gen)
    sampler = Sampler(torch.Generator().manual_seed(0))
    verdict = verify_drafts(sampler, logits[:k], md, [drafts])[0]
    last_md = _random_md(1, 1.0, None, None)
    last_md.generators = {0: gen}
    bonus = int(sampler.draw(Sampler.processed_probs(logits[k:].clone(), last_md), last_md))
    emitted = drafts[:verdict.num_accepted] + [bonus if verdict.replacement is None else verdict.replacement]
    assert verdict.num_accepted == accepted
    assert emitted == singly[:accepted + 1]
    replay = torch.Generator().manual_seed(seed)
    torch.rand(accepted + 1, generator=replay, dtype=torch.float64)
    assert torch.equal(gen.get_state(), replay.get_state())
