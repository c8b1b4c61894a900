"""The sampler through InputBatch.sampling_metadata, as the runner uses it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pagedserve.core.sched_output import NewRequestData
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.input_batch import InputBatch
from pagedserve.worker.sampler import Sampler

VOCAB = 50
EOS = 3


def batch_of(params: list[SamplingParams], outputs: list[list[int]] | None = None,
             prompts: list[list[int]] | None = None) -> tuple[InputBatch, list[int]]:
    ib = InputBatch(max_num_reqs=max(64, len(params)), max_model_len=64, block_size=16, vocab_size=VOCAB,
                    device=torch.device("cpu"), eos_token_id=EOS)
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [7, 8]
        out = outputs[i] if outputs else []
        ib.add_request(NewRequestData(f"r{i}", prompt, out, p, [1], 0))
    return ib, [ib.req_id_to_row[f"r{i}"] for i in range(len(params))]


def sample(params, logits, outputs=None, prompts=None, seed=0):
    ib, rows = batch_of(params, outputs, prompts)
    return Sampler(torch.Generator().manual_seed(seed))(logits, ib.sampling_metadata(rows))


def rand_logits(n, seed=0):
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_is_argmax_and_skips_everything():
    logits = rand_logits(6)
    ib, rows = batch_of([SamplingParams(temperature=0)] * 6)
    md = ib.sampling_metadata(rows)
    assert md.all_greedy and md.temperature is None and md.top_k is None and md.max_num_logprobs is None
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.sampled_logprobs is None


def test_mixed_greedy_and_random_rows():
    logits = rand_logits(8)
    params = [SamplingParams(temperature=0 if i % 2 else 1.5) for i in range(8)]
    for seed in range(5):
        out = sample(params, logits, seed=seed).sampled_token_ids
        assert out[1::2].tolist() == logits[1::2].argmax(-1).tolist()


def draws(params: SamplingParams, logits_row: torch.Tensor, n: int = 400, **kw) -> set[int]:
    out = sample([params] * n, logits_row.expand(n, -1).clone(), **kw)
    return set(out.sampled_token_ids.tolist())


def test_top_k_top_p_min_p_restrict_the_support():
    row = rand_logits(1, seed=4)[0]
    order = row.argsort(descending=True)
    probs = row.softmax(-1)
    assert draws(SamplingParams(top_k=1), row) == {int(order[0])}
    got = draws(SamplingParams(top_k=4), row)
    assert got <= set(order[:4].tolist()) and len(got) > 1
    # top_p: the smallest prefix of the sorted distribution reaching p.
    cum = probs[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1].tolist())
    got = draws(SamplingParams(top_p=0.6), row)
    assert got <= nucleus and len(got) > 1
    got = draws(SamplingParams(min_p=0.2), row)
    assert got <= set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    # Both together, mixed with unrestricted rows in one batch.
    params = [SamplingParams(top_k=3, top_p=0.9), SamplingParams()] * 100
    out = sample(params, row.expand(200, -1).clone()).sampled_token_ids
    assert set(out[0::2].tolist()) <= set(order[:3].tolist())
    assert len(set(out[1::2].tolist())) > 3


def test_temperature_sharpens():
    row = rand_logits(1, seed=5)[0]
    assert len(draws(SamplingParams(temperature=0.05), row)) <= 2
    assert len(draws(SamplingParams(temperature=5.0), row)) > 10


def naive_penalties(logits, prompt, output, rep, freq, pres):
    logits = logits.clone()
    for t in set(prompt) | set(output):
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    for t in set(output):
        logits[t] -= freq * output.count(t) + pres
    return logits


def test_penalties_match_vllm_semantics():
    logits = rand_logits(4, seed=6)
    prompts = [[1, 2, 2, 9], [4, 5], [6], [7, 7]]
    outputs = [[2, 2, 11, 40], [5, 5, 5], [], [12]]
    knobs = [(1.3, 0.5, 0.25), (1.0, 1.0, 0.0), (0.7, 0.0, 1.5), (1.0, 0.0, 0.0)]
    params = [SamplingParams(temperature=0, repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
              for r, f, p in knobs]
    ib, rows = batch_of(params, outputs, prompts)
    md = ib.sampling_metadata(rows)
    got = Sampler.apply_penalties(logits.clone(), md)
    for i, (r, f, p) in enumerate(knobs):
        torch.testing.assert_close(got[i], naive_penalties(logits[i], prompts[i], outputs[i], r, f, p))
    # And greedy follows the penalised logits.
    out = Sampler()(logits, md).sampled_token_ids
    assert out.tolist() == got.argmax(-1).tolist()


def test_logit_bias_is_added_before_the_repetition_penalty_as_vllm():
    """vLLM v1 adds logit_bias before the penalties: a seen token at 1.0 biased by +10 is
    (1 + 10) / 2 = 5.5 under repetition_penalty 2, not 1 / 2 + 10; and a bias that turns
    a logit's sign turns whether the penalty divides or multiplies it."""
    logits = torch.full((1, VOCAB), -50.0)
    logits[0, 3], logits[0, 4], logits[0, 5] = 1.0, -2.0, 7.0
    params = [SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={3: 10.0, 4: 4.0}, logprobs=0)]
    ib, rows = batch_of(params, outputs=[[3, 4]])
    md = ib.sampling_metadata(rows)
    edited = logits.clone()
    Sampler.apply_logit_edits(edited, md)
    edited = Sampler.apply_penalties(edited, md)
    assert edited[0, 3].item() == 5.5 and edited[0, 4].item() == 1.0
    # 5.5 < 7.0: token 5 wins (with the penalty first, 1 / 2 + 10 = 10.5 would have)
    assert sample(params, logits.clone(), outputs=[[3, 4]]).sampled_token_ids.tolist() == [5]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 10
    logits[:, 20] = 9
    logits[:, 21] = 8
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[20]),  # 1 output so far: banned
        SamplingParams(temperature=0, min_tokens=1),  # reached
        SamplingParams(temperature=0, min_tokens=5, ignore_eos=True),  # EOS not a stop: allowed
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[20]),
    ]
    out = sample(params, logits, outputs=[[30], [30], [], []]).sampled_token_ids.tolist()
    assert out == [21, EOS, EOS, 21]


def test_seed_is_reproducible_regardless_of_batch_composition():
    seeded = SamplingParams(temperature=1.0, seed=77)
    target = rand_logits(1, seed=8)

    def run(others: list[SamplingParams], position: int, steps: int = 6) -> list[int]:
        params = list(others)
        params.insert(position, seeded)
        ib, rows = batch_of(params)
        sampler = Sampler(torch.Generator().manual_seed(len(others)))
        toks = []
        for step in range(steps):
            logits = rand_logits(len(params), seed=100 + step)
            logits[position] = target[0] + step
            toks.append(int(sampler(logits, ib.sampling_metadata(rows)).sampled_token_ids[position]))
        return toks

    alone = run([], 0)
    assert len(set(alone)) > 1
    assert run([SamplingParams(temperature=0.9)] * 3, 2) == alone
    assert run([SamplingParams(temperature=0), SamplingParams(seed=5, top_k=3)], 1) == alone
    assert run([SamplingParams(top_p=0.5)] * 7, 4) == alone


def test_logprobs_are_raw_with_ranks_and_top_k():
    logits = rand_logits(3, seed=9)
    params = [SamplingParams(temperature=0.3, logprobs=5, repetition_penalty=1.5),
              SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=2.0)]
    out = sample(params, logits, outputs=[[1, 2, 3], [], []])
    raw = logits.log_softmax(-1)
    for i in range(3):
        tok = int(out.sampled_token_ids[i])
        assert out.sampled_logprobs[i] == pytest.approx(float(raw[i, tok]), abs=1e-6)
        assert int(out.sampled_ranks[i]) == int((raw[i] > raw[i, tok]).sum()) + 1
    assert out.topk_token_ids.shape == (3, 5)
    torch.testing.assert_close(out.topk_logprobs, raw.topk(5).values)
    assert int(out.sampled_ranks[1]) == 1


@pytest.mark.parametrize("temperatures", [[0.0] * 4, [1.0] * 4, [0.0, 0.7, 0.0, 1.3]])
def test_rows_that_are_not_distributions_are_flagged_not_raised(temperatures):
    logits = rand_logits(4)
    logits[1, 5] = float("nan")
    logits[2] = float("-inf")
    logits[3, 7] = float("inf")
    params = [SamplingParams(temperature=t, top_p=0.9, min_p=0.05, seed=i if t else None, logprobs=2)
              for i, t in enumerate(temperatures)]
    out = sample(params, logits)  # a categorical draw on these rows would raise: it must not
    assert out.invalid.tolist() == [False, True, True, True]
    assert out.no_token.tolist() == [False, False, True, False]  # only row 2 had nothing left: not the model's fault
    assert out.sampled_token_ids[1:].tolist() == [0, 0, 0]  # a valid id for the next step's gather
    assert 0 <= out.sampled_token_ids[0] < VOCAB


def test_logit_bias_allowed_tokens_and_bad_words():
    logits = rand_logits(3)
    biased = SamplingParams(temperature=0, logit_bias={11: 100.0, 12: -100.0})
    allowed = SamplingParams(temperature=0, allowed_token_ids=[20, 21, 20])  # (a repeated id: once)
    bad = SamplingParams(temperature=0)
    bad.bad_words_token_ids = [[30], [7, 8, 9]]  # the engine fills this from bad_words
    ib, rows = batch_of([biased, allowed, bad], outputs=[[], [], [7, 8]])
    out = Sampler()(logits.clone(), ib.sampling_metadata(rows))
    assert out.sampled_token_ids[0] == 11
    assert out.sampled_token_ids[1] == (20 if logits[1, 20] >= logits[1, 21] else 21)
    edited = logits[2].clone()
    edited[[30, 9]] = float("-inf")  # a one-token bad word always, [7, 8, 9] after 7, 8
    assert out.sampled_token_ids[2] == edited.argmax()
    # Without the 7, 8 prefix only the one-token bad word is banned.
    ib, rows = batch_of([bad], outputs=[[7, 1]])
    md = ib.sampling_metadata(rows)
    assert md.banned_tokens.tolist() == [30]


def test_draws_follow_the_distribution_and_never_a_token_of_no_mass():
    """A draw is one uniform through the row's cumulative mass (not torch.multinomial,
    which for one sample draws vocab-many exponentials): frequencies match the row's
    probabilities, unnormalised rows are fine, and a token of mass 0 is never drawn, even
    at the uniform's ends."""
    from pagedserve.worker.sampler import SamplingMetadata, _inverse_cdf

    probs = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0]])  # total 4, unnormalised
    n = 40_000
    md = SamplingMetadata(all_greedy=False, all_random=True, temperature=torch.ones(n))
    draws = Sampler(torch.Generator().manual_seed(0)).draw(probs.expand(n, -1), md)
    freq = torch.bincount(draws, minlength=6).double() / n
    assert freq.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.25, 0.25, 0.0], abs=0.01)
    ends = torch.tensor([0.0, 1.0 - 2.0 ** -53, 0.5, 0.75 - 1e-12], dtype=torch.float64)
    assert _inverse_cdf(probs.expand(4, -1), ends).tolist() == [1, 4, 3, 3]
    # u * total rounded up to the total itself (odds 2^-53) would be past every token: the
    # target stays below it, on the last token with mass (the row's last one has none)
    assert _inverse_cdf(probs, torch.tensor([1.0], dtype=torch.float64)).tolist() == [4]
    # A row of NaN (a temperature float32 cannot hold made one) found no index: the draw was
    # the vocabulary's size, and gathering its logprob took the server down.
    nan = torch.full((1, 6), float("nan"))
    assert 0 <= _inverse_cdf(nan, torch.tensor([0.5], dtype=torch.float64)).item() < 6


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 4), width=st.sampled_from([5, 50, 3000, 20000]),
       scale=st.sampled_from([0.3, 1.0, 4.0, 15.0, 40.0]),
       top_p=st.one_of(st.floats(0.05, 1.0), st.sampled_from([1.0, 0.9999999])), with_k=st.booleans())
@example(seed=607101, n=2, width=3000, scale=1.0, top_p=1.0, with_k=False)
@example(seed=10, n=1, width=20000, scale=0.3, top_p=0.05, with_k=False)
def test_top_p_keeps_what_the_sorted_rule_keeps(seed, n, width, scale, top_p, with_k):
    """Candidates only, however flat the row (a flat one needs more than the first guess
    of TOP_P_CANDIDATES) or sharp (a tail below float64's resolution; top_p 1): the same
    tokens as sorting the whole row (the CUDA path, HF's rule), each row with its own top_p.
    Tokens of equal logits are interchangeable: where such a tie straddles the cut, either
    rule may keep either one (both sorts break ties arbitrarily), so each row's kept logits
    are compared as a sorted list (seed 607101: tokens 521 and 1327 of row 1 tie there).
    The sorted rule's float32 running sum may cut one token off where the exact mass of
    the most likely tokens lies within its rounding of top_p (seed 10 under AVX2: the 518
    most likely hold 0.0500003 of 0.05): one token apart, at such a cut, is allowed."""
    from pagedserve.worker.sampler import _apply_top_k_top_p, _top_k_top_p_sorted

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, width, generator=g) * scale
    top_p_t = torch.tensor([top_p, 0.5, 1.0, 0.95][:n])
    top_k = torch.randint(1, width + 5, (n,), generator=g) if with_k else None
    got_all, want_all = _apply_top_k_top_p(logits, top_k, top_p_t), _top_k_top_p_sorted(logits, top_k, top_p_t)
    for r in range(n):
        got, want = (x[r].sort(descending=True).values for x in (got_all, want_all))
        kept_got, kept_want = (int((x.isfinite() & (x.softmax(-1) > 0)).sum()) for x in (got, want))  # (mass > 0)
        if kept_got != kept_want:
            assert abs(kept_got - kept_want) == 1, (r, kept_got, kept_want)
            row = logits[r] if top_k is None else logits[r].masked_fill(
                logits[r] < logits[r].topk(min(int(top_k[r]), width)).values[-1], float("-inf"))
            mass = row.double().softmax(-1).sort(descending=True).values.cumsum(0)[min(kept_got, kept_want) - 1]
            assert abs(float(mass) - float(top_p_t[r])) < 1e-5 * max(1.0, width / 1000), (r, float(mass))
            continue
        torch.testing.assert_close(got.softmax(-1), want.softmax(-1), rtol=1e-5, atol=1e-7)
        assert torch.equal(got.isfinite() & (got.softmax(-1) > 0), want.isfinite() & (want.softmax(-1) > 0))


def test_top_logprobs_of_a_wide_vocabulary_are_torchs_topk():
    """Over a vocabulary wide enough for the block path (layers/vocab_reduce.py), the top-k
    logprobs are topk's values, largest first, each beside its own token."""
    from pagedserve.worker.sampler import SamplerOutput

    raw = torch.randn(3, 70000, generator=torch.Generator().manual_seed(5)).log_softmax(-1)
    raw[1, 1000:1010] = raw[1].max() + 1  # ten tied largest: any five of them
    out = SamplerOutput(torch.zeros(3, dtype=torch.long))
    Sampler.gather_logprobs(raw, torch.tensor([0, 1, 2]), 5, out)
    assert torch.equal(out.topk_logprobs, raw.topk(5).values)
    assert torch.equal(raw.gather(1, out.topk_token_ids), out.topk_logprobs)
    assert set(out.topk_token_ids[1].tolist()) < set(range(1000, 1010))


def test_a_tie_the_top_p_cut_splits_is_kept_by_token_id_whatever_the_batch() -> None:
    """Four equally likely tokens, top_k 4 (a tie keeps all four) and top_p 0.6 (three
    stay): which three depended on how wide topk looked, the batch's widest top_k, so a
    seeded request sampled otherwise beside another (fuzzing found it)."""
    from pagedserve.worker.sampler import _apply_top_k_top_p

    row = torch.full((100,), -30.0)
    row[[70, 30, 90, 10]] = 5.0
    other = torch.randn(100)
    alone = _apply_top_k_top_p(row[None], torch.tensor([4]), torch.tensor([0.6]))
    batched = _apply_top_k_top_p(torch.stack([row, other]), torch.tensor([4, 60]), torch.tensor([0.6, 0.9]))
    assert torch.equal(alone[0], batched[0])
    assert torch.isfinite(alone[0]).nonzero().flatten().tolist() == [10, 30, 70]
