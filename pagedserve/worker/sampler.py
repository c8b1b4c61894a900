"""Batched sampling with vLLM semantics: one pass over [N, vocab] logits, greedy and
random rows mixed.

Order (as vLLM v1): raw logprobs are taken first, from the unmodified logits; then
allowed_token_ids, bad words, min_tokens masking and logit_bias, then the penalties (a
bias that turns a logit's sign turns whether repetition_penalty divides or multiplies
it); greedy rows take the argmax of that; random
rows go on through temperature, min_p, top-k/top-p and a categorical draw.  A
seeded row draws from its own generator, one draw per sampled token, so its tokens
do not depend on which other requests share the batch.

Every optional stage is skipped when no row in the batch uses it: an all-greedy
batch without penalties costs one argmax.

A row whose logits are not a distribution (a NaN or +inf anywhere, or every logit
-inf) is reported in `SamplerOutput.invalid` instead of reaching the categorical
draw, which would raise and take the whole batch (and the engine) down with it; that
request fails alone.  Finding such rows costs nothing extra for greedy rows: the
max that gives the argmax also tells whether the row is finite.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.core.sched_output import GrammarBitmask
from pagedserve.layers.vocab_reduce import row_max, row_topk_indices


@dataclass
class SamplingMetadata:
    """Per-row sampling knobs for the rows sampled this step, as device tensors.
    A field is None when no row needs that stage."""

    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None = None  # [N] float32, 1.0 on greedy rows
    greedy: torch.Tensor | None = None  # [N] bool; None when all_greedy or all_random
    top_k: torch.Tensor | None = None  # [N] int64, vocab size where disabled
    top_p: torch.Tensor | None = None  # [N] float32, 1.0 where disabled
    min_p: torch.Tensor | None = None  # [N] float32, 0.0 where disabled
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    # Penalties (vLLM semantics: repetition over prompt + output, the others over output).
    presence_penalty: torch.Tensor | None = None  # [N, 1]
    frequency_penalty: torch.Tensor | None = None  # [N, 1]
    repetition_penalty: torch.Tensor | None = None  # [N, 1]
    prompt_token_ids: torch.Tensor | None = None  # [N, P] int64, padded with vocab_size
    output_token_ids: torch.Tensor | None = None  # [N, O] int64, padded with vocab_size
    # min_tokens and bad words: (row, token id) pairs to forbid this step, and whether
    # each holds (None: all do; a bad word whose prefix ends in a token still on the
    # device, under overlap scheduling, holds when that token is the one it needs).
    banned_rows: torch.Tensor | None = None
    banned_tokens: torch.Tensor | None = None
    banned_if: torch.Tensor | None = None  # [pairs] bool
    # logit_bias: (row, token id, bias) triples added to the logits.
    bias_rows: torch.Tensor | None = None
    bias_tokens: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # allowed_token_ids: the rows that have a list, and the (row, token id) pairs it allows.
    allowed_rows: torch.Tensor | None = None
    allowed_pairs: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int | None = None  # None: no row wants logprobs


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64 (0 on invalid rows: still a valid id to gather)
    # With logprobs requested (rows that did not ask simply ignore theirs):
    sampled_logprobs: torch.Tensor | None = None  # [N] float32
    sampled_ranks: torch.Tensor | None = None  # [N] int64, 1-based
    topk_token_ids: torch.Tensor | None = None  # [N, K]
    topk_logprobs: torch.Tensor | None = None  # [N, K]
    invalid: torch.Tensor | None = None  # [N] bool: the row's logits were not a distribution
    # [N] bool, the invalid rows whose every token was -inf: the request's own constraints
    # (grammar, allowed_token_ids, logit_bias, bad words, min_tokens) left nothing to
    # sample -- the client's doing, not the model's.
    no_token: torch.Tensor | None = None


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Noise for unseeded random rows; seeded from ModelConfig.seed by the runner so
        # that whole runs are reproducible.
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(-1) if metadata.max_num_logprobs is not None else None
        self.apply_logit_edits(logits, metadata)
        logits = self.apply_penalties(logits, metadata)
        best, argmax = row_max(logits)
        # NaN anywhere, +inf, or nothing left to sample: best - best is NaN for each, 0 otherwise
        # (two ops where ~isfinite is five, each ~10-60 us in a CPU step)
        invalid = (best - best) != 0
        if metadata.all_greedy:
            sampled = argmax
        else:
            sampled = self.sample_random(logits, metadata, invalid)
            if metadata.greedy is not None:
                sampled = torch.where(metadata.greedy, argmax, sampled)
        out = SamplerOutput(sampled.masked_fill(invalid, 0), invalid=invalid, no_token=best == float("-inf"))
        if raw_logprobs is not None:
            self.gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs, out)
        return out

    @staticmethod
    def apply_logit_edits(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        """logit_bias, allowed_token_ids and forbidden tokens (min_tokens, bad words), in
        place; each is skipped when no row uses it."""
        if metadata.bias_rows is not None:
            logits.index_put_((metadata.bias_rows, metadata.bias_tokens), metadata.bias_values, accumulate=True)
        if metadata.allowed_rows is not None:
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[metadata.allowed_pairs] = True
            outside = ~keep[metadata.allowed_rows]
            logits[metadata.allowed_rows] = logits[metadata.allowed_rows].masked_fill(outside, float("-inf"))
        if metadata.banned_rows is not None and metadata.banned_if is None:
            logits[metadata.banned_rows, metadata.banned_tokens] = float("-inf")
        elif metadata.banned_rows is not None:  # (added: a pair twice, held once, stays forbidden)
            ban = torch.zeros(metadata.banned_if.shape, dtype=logits.dtype, device=logits.device)
            logits.index_put_((metadata.banned_rows, metadata.banned_tokens),
                              ban.masked_fill(metadata.banned_if, float("-inf")), accumulate=True)

    @staticmethod
    def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        n, vocab = logits.shape
        if metadata.repetition_penalty is not None:
            seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
            for ids in (metadata.prompt_token_ids, metadata.output_token_ids):
                if ids is not None:
                    seen.scatter_(1, ids, True)
            seen = seen[:, :vocab]
            pen = metadata.repetition_penalty
            penalised = torch.where(logits > 0, logits / pen, logits * pen)
            logits = torch.where(seen, penalised, logits)
        if metadata.frequency_penalty is not None or metadata.presence_penalty is not None:
            ids = metadata.output_token_ids
            counts = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=logits.device)
            if ids is not None:
                counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
            counts = counts[:, :vocab]
            if metadata.frequency_penalty is not None:
                logits = logits - metadata.frequency_penalty * counts
            if metadata.presence_penalty is not None:
                logits = logits - metadata.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata,
                      invalid: torch.Tensor | None = None) -> torch.Tensor:
        """One categorical draw per row; `invalid` rows draw from a uniform stand-in
        (their token is discarded) so that the draw itself cannot fail."""
        return self.draw(self.processed_probs(logits, metadata, invalid), metadata)

    @staticmethod
    def processed_probs(logits: torch.Tensor, metadata: SamplingMetadata,
                        invalid: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution a random row samples from: temperature, min_p, top-k/top-p."""
        logits = logits / metadata.temperature[:, None]
        if invalid is not None:
            logits.masked_fill_(invalid[:, None], 0.0)
        if metadata.min_p is not None:
            probs = logits.softmax(-1)
            threshold = probs.amax(-1, keepdim=True) * metadata.min_p[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if metadata.top_p is not None:
            logits = _apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        elif metadata.top_k is not None:
            logits = _apply_top_k(logits, metadata.top_k)
        return logits.softmax(-1)

    def draw(self, probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """One token per row from `probs` (rows need not be normalised, but need some
        mass), seeded rows from their own generators: one uniform per row, from the
        generators `uniform` uses, through the row's cumulative distribution.

        Not torch.multinomial: for one sample it draws vocab-many exponentials whatever
        `replacement` says, 1.0 ms a row for SmolLM2's 49,152 tokens on Zen 4 (AVX-512
        with native bf16): an eighth of a one-request decode step, and 32 ms a step at 32
        sampled requests.  The distribution is the same; which token a given seed
        draws is not what torch.multinomial drew."""
        return _inverse_cdf(probs, self.uniform(metadata, probs.device))

    def uniform(self, metadata: SamplingMetadata, device: torch.device) -> torch.Tensor:
        """One uniform draw in [0, 1) per row (float64: a token's share of the mass is
        resolved to 2^-53, not float32's 2^-24), seeded rows from their own generators."""
        n = len(metadata.temperature) if metadata.temperature is not None else 0
        u = torch.rand(n, generator=self.generator, device=device, dtype=torch.float64)
        for row, gen in metadata.generators.items():
            u[row] = torch.rand(1, generator=gen, device=device, dtype=torch.float64)[0]
        return u

    @staticmethod
    def rewind(gen: torch.Generator, state: torch.Tensor, draws: int) -> None:
        """Put a seeded row's generator back to `state` advanced by `draws` of `uniform`'s
        draws (a run of them gives the same values as one at a time): where drawing one
        token at a time would have left it."""
        gen.set_state(state)
        if draws:
            torch.rand(draws, generator=gen, device=gen.device, dtype=torch.float64)

    @staticmethod
    def gather_logprobs(raw: torch.Tensor, sampled: torch.Tensor, k: int, out: SamplerOutput) -> None:
        token_lp = raw.gather(1, sampled[:, None])
        out.sampled_logprobs = token_lp.squeeze(1)
        out.sampled_ranks = (raw > token_lp).sum(-1) + 1
        if k > 0:  # (the k largest found by block maxima, then ordered: layers/vocab_reduce.py)
            ids = row_topk_indices(raw, k)
            out.topk_logprobs, order = raw.gather(1, ids).sort(dim=-1, descending=True, stable=True)
            out.topk_token_ids = ids.gather(1, order)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the first index whose cumulative mass exceeds u times the row's total:
    index i with probability probs[i] / total, never one of mass 0 (its prefix equals the
    one before it).  The target stays below the total, which u * total can round up to.
    No host sync (GPU steps stay asynchronous).  torch.cumsum sums a float32 row in
    float64 and rounds each prefix once; a float64 row's cumsum took 14x as long."""
    cdf = probs.float().cumsum(-1).double()
    total = cdf[:, -1:]
    target = torch.minimum(u.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    # (a row of NaN finds no index: clamped into the vocabulary, never one past it, which
    # crashed the step that gathered its logprob)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (rows with k >= vocab are untouched)."""
    vocab = logits.shape[1]
    max_k = int(top_k.max())
    if max_k >= vocab:  # some row is unrestricted: only restrict the others
        rows = (top_k < vocab).nonzero().squeeze(1)
        if rows.numel() == 0:
            return logits
        logits = logits.clone()
        logits[rows] = _apply_top_k(logits[rows], top_k[rows])
        return logits
    values = logits.topk(max_k, dim=-1).values
    kth = values.gather(1, (top_k - 1).clamp(min=0)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


# Top-p's first guess at how many of a row's most likely tokens can hold its nucleus; a row
# whose top TOP_P_CANDIDATES hold too little mass looks at 8x as many, up to the whole row.
TOP_P_CANDIDATES = 1024


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens outside top-k, then the least likely tokens whose total mass is at most
    1 - top_p (the most likely token always stays): HF's rule, which sorts the whole
    row ascending and drops where the running sum is <= 1 - top_p.

    Only the most likely tokens can stay, so only they are sorted: a token stays when the
    mass of the tokens above it is below total - (1 - top_p), and every token outside the
    candidates is dropped once the candidates' mass reaches that.  A full sort of
    262,144 logits took 18 ms a row (Gemma 3's vocabulary, 2 threads on a Zen 5; 3.1 ms
    for SmolLM2's 49,152), longer than the model's step.  The running sums are float64
    (a kept set can differ from the float32 full sort's only where a sum lies within
    rounding of the threshold)."""
    if logits.is_cuda:  # (a GPU sorts fast, and the candidates' loop would wait on the device)
        return _top_k_top_p_sorted(logits, top_k, top_p)
    if top_k is not None:
        logits = _apply_top_k(logits, top_k)  # (the same kept set as masking the sorted row)
    probs = logits.softmax(-1)
    vocab = probs.shape[1]
    bound = probs.double().sum(-1, keepdim=True) - (1 - top_p.double()[:, None])
    # top_p 1 drops nothing (the sorted rule drops only tokens of probability 0, which a
    # float64 running sum cannot tell from those below its resolution).
    bound = bound.masked_fill(top_p[:, None] >= 1, float("inf"))
    # (after top-k only about max(top_k) tokens have any mass: its ties may add a few)
    width = min(vocab, TOP_P_CANDIDATES if top_k is None else max(1, min(TOP_P_CANDIDATES, int(top_k.max()))))
    while True:
        values, order = probs.topk(width, dim=-1)  # descending
        mass = values.double().cumsum(-1)
        keep = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=1) < bound  # by the mass above each
        keep[:, 0] = True
        # Done when every row's cut lies inside the window, and the value it stops at
        # (a tie's, whichever member) is not the window's last, which ties outside may share.
        last_kept = values.masked_fill(~keep, 2.0).amin(-1, keepdim=True)
        if width == vocab or bool(((mass[:, -1:] >= bound) & (values[:, -1:] < last_kept)).all()):
            break
        width = min(vocab, width * 8)
    if bool((values.masked_fill(keep, -1.0).amax(-1, keepdim=True) == last_kept).any()):
        # The cut splits a tie: its members by token id, so which it keeps does not depend
        # on the width (the batch's widest top_k) and a seeded row samples alike alone or
        # batched (topk orders a tie by how wide it looks).
        order, by_id = order.sort(dim=-1)
        values, at = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        order = order.gather(1, at)
        mass = values.double().cumsum(-1)
        keep = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=1) < bound
        keep[:, 0] = True
    kept = logits.gather(1, order).masked_fill_(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, kept)


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor) -> torch.Tensor:
    """_apply_top_k_top_p's rule as HF writes it: the whole row sorted ascending, top-k's
    k-th largest as the floor, then the prefix whose running sum is <= 1 - top_p dropped."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab))[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    drop = sorted_logits.softmax(-1).cumsum(-1) <= (1 - top_p)[:, None]
    drop[:, -1] = False
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask) -> None:
    """Forbid, in place, every token the grammar's bitmask clears, on the constrained rows
    only (xgrammar's kernel: C++ on CPU, CUDA on GPU; both backends fill this one layout)."""
    import xgrammar as xgr

    bitmask = grammar.bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=grammar.rows, vocab_size=grammar.vocab_size)
