"""Which running requests get drafts this step, and from where: the scheduler's part of
speculative decoding.  A request with a predicted output (core/prediction_drafter.py)
asked for speculation itself: it drafts from its prediction whatever the engine's
setting or batch size, and by prompt lookup while its prediction has nothing to
propose; the others from the engine's drafter (n-gram, or a draft model's, asked in one
batch so that a draft model runs them together)."""

from __future__ import annotations

from pagedserve.core.ngram_proposer import Drafter, NgramProposer
from pagedserve.core.request import Request


def may_speculate(request: Request) -> bool:
    """Drafts can be verified exactly for this request (see SamplingParams.allows_speculation;
    the InputProcessor refuses a prediction on a request that could not use it)."""
    return (request.grammar is None and len(request.output_token_ids) >= request.min_tokens
            and request.sampling_params.allows_speculation)


def propose_drafts(running: list[Request], drafter: Drafter | None,
                   prompt_lookup: NgramProposer) -> dict[str, list[int]]:
    """Drafts by request id for every running request that decodes one token this step
    and may speculate (`drafter`: None while the engine's drafter is off)."""
    proposals: dict[str, list[int]] = {}
    wanted = []
    for r in running:
        if r.num_tokens_to_compute != 1 or not may_speculate(r):
            continue
        if r.prediction is not None:
            drafts = r.prediction.propose(r.output_token_ids) or prompt_lookup.propose(r.all_token_ids,
                                                                                        r.max_draft_tokens)
            if drafts:
                proposals[r.request_id] = drafts
        elif drafter is not None:
            wanted.append((r.request_id, r.all_token_ids, r.max_draft_tokens))
    if wanted:
        assert drafter is not None
        proposals.update(drafter.propose_batch(wanted))
    return proposals
