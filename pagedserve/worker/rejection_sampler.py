"""Verify draft tokens (speculative decoding) so that the output distribution is exactly
the model's.

A request with k drafts d_1..d_k is run with k + 1 query tokens; the hidden state at
query j gives the target distribution p_j for the token after it.  Drafts are checked in
order, and the first one rejected ends the run:

* greedy: d_j is accepted while it is the argmax of p_(j-1), and the argmax replaces
  the first draft that is not: token for token what one-at-a-time decoding produces;
* random: drafts are deterministic (n-gram lookups and a draft model's greedy picks: a
  point mass q = 1 on d_j), so standard speculative sampling (accept with probability
  min(1, p/q), on rejection draw from the normalised max(0, p - q)) is the same as
  drawing the position's token t_j from p_(j-1) as the ordinary sampler would and
  accepting d_j when t_j == d_j (probability p(d_j)); the first t_j that differs
  replaces the draft (distributed as p without d_j).  Every emitted token has
  distribution p exactly, and because each position uses the sampler's own draw, a
  seeded request emits the very tokens it would one token at a time: its generator is
  wound back after the verdict so that it has given exactly one draw per emitted token
  (the bonus or next token's draw is the ordinary sampler's, which follows).

When every draft is accepted the request keeps the token the ordinary sampler drew
from the last position (the "bonus" token), so a full hit yields k + 1 tokens.  Only
requests whose distribution is the same at every position draft at all
(SamplingParams.allows_speculation), so p_j here is the ordinary sampler's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.layers.vocab_reduce import row_max
from pagedserve.worker.sampler import Sampler, SamplingMetadata


@dataclass
class DraftVerdict:
    """One request's verification: how many drafts it keeps, the token that replaces
    the first rejected one (None when all were accepted: the bonus token follows), and
    whether a position's logits were not a distribution (the request then fails)."""

    num_accepted: int
    replacement: int | None
    invalid: bool = False


def verify_drafts(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata,
                  drafts: list[list[int]]) -> list[DraftVerdict]:
    """`logits`: [sum of len(d) for d in drafts, vocab], the rows that predict each draft,
    request by request; `md`: their sampling knobs (a request's row repeated per draft)."""
    logits = logits.float()
    flat = [t for d in drafts for t in d]
    targets = torch.tensor(flat, dtype=torch.long, device=logits.device)
    best, argmax = row_max(logits)
    invalid = ~torch.isfinite(best)
    before = {id(g): g.get_state() for g in metadata.generators.values()}  # seeded rows' generators
    if metadata.all_greedy:
        accept, replacement = argmax == targets, argmax
    else:
        probs = sampler.processed_probs(logits, metadata, invalid)
        replacement = sampler.draw(probs, metadata)
        accept = replacement == targets
        if metadata.greedy is not None:
            accept = torch.where(metadata.greedy, argmax == targets, accept)
            replacement = torch.where(metadata.greedy, argmax, replacement)
    accept_l, repl_l, invalid_l = accept.tolist(), replacement.tolist(), invalid.tolist()
    verdicts: list[DraftVerdict] = []
    row = 0
    for d in drafts:
        k = len(d)
        a = 0
        while a < k and accept_l[row + a] and not invalid_l[row + a]:
            a += 1
        bad = any(invalid_l[row: row + min(a + 1, k)])
        verdicts.append(DraftVerdict(a, repl_l[row + a] if a < k else None, bad))
        gen = metadata.generators.get(row)
        if gen is not None and a < k:
            sampler.rewind(gen, before[id(gen)], a)
        row += k
    return verdicts
