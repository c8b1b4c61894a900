"""Draft-model speculation: a small model that shares the target's tokenizer proposes
each decoding request's next k tokens greedily; the target verifies them in one forward,
exactly as it verifies n-gram drafts (worker/rejection_sampler.py).

Greedy drafts are a fixed function of the context, so the verifier's rule (accept a
draft with the target's probability of it, else resample from the target's distribution
without it) keeps sampling exact at any temperature, and greedy outputs identical.

The draft model runs in a ModelRunner of its own, with its own small KV cache, driven
here by hand-made SchedulerOutputs (the scheduler proposes at schedule time, before the
target's forward).  One proposal round for the requests that may draft:

1. every request is (re)added with its committed tokens and the draft blocks it holds,
   `num_computed_tokens` = how many of them the draft model has computed before; the
   step computes only the rest (the accepted drafts and the target's token since the
   last round, or the whole prompt the first time) and samples draft 1;
2. each draft is fed back as a one-token step, until the request has its k drafts.

Rejected drafts need no undo: the next round re-adds the request from its committed
tokens and their KV slots are written again.  Blocks come from a free list; a request
that lacks blocks takes them from requests not drafting this round, least recently
used first, or, when even that would not make room, gets no drafts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve.core.ngram_proposer import DraftRequest, next_num_drafts
from pagedserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.layers.rotary_embedding import rotates_long
from pagedserve.sampling_params import SamplingParams
from pagedserve.utils import cdiv
from pagedserve.worker.model_runner import ModelRunner

# The draft model's sampling: greedy (see the module docstring for why that is exact).
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class _DraftState:
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading committed tokens whose KV the draft cache holds
    long_rope: bool = False  # a LongRoPE draft model's long factors throughout (NewRequestData.long_rope)


class DraftModelProposer:
    """A `Drafter` (core/ngram_proposer.py) backed by a draft model's ModelRunner, whose
    KV cache has `num_blocks` blocks (block 0 is its null block) and which takes at most
    `max_num_seqs` requests per step."""

    def __init__(self, runner: ModelRunner, num_blocks: int, max_num_seqs: int, max_drafts: int,
                 long_rope_original: int | None = None) -> None:
        """`long_rope_original`: a LongRoPE draft model's original context (rotary_embedding.long_rope_original)."""
        self.runner = runner
        self.block_size = runner.block_size
        self.max_model_len = runner.max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_drafts = max_drafts
        self.free_block_ids = list(range(1, num_blocks))
        self.states: OrderedDict[str, _DraftState] = OrderedDict()  # least recently drafted first
        self.held: set[str] = set()  # requests the runner holds state for (dropped each round)
        self.long_rope_original = long_rope_original

    def next_num_drafts(self, num_drafted: int, num_accepted: int) -> int:
        return next_num_drafts(self.max_drafts, num_drafted, num_accepted)

    def forget(self, request_ids: Iterable[str]) -> None:
        for req_id in request_ids:
            state = self.states.pop(req_id, None)
            if state is not None:
                self.free_block_ids.extend(state.block_ids)

    def _reserve(self, state: _DraftState, num_tokens: int, busy: set[str]) -> bool:
        """Blocks for `num_tokens` KV slots, evicting requests outside `busy` if needed."""
        need = cdiv(num_tokens, self.block_size) - len(state.block_ids)
        if need > len(self.free_block_ids) + sum(len(s.block_ids) for r, s in self.states.items() if r not in busy):
            return False  # evicting would not make room: keep the others' KV
        while need > len(self.free_block_ids):
            victim = next((rid for rid in self.states if rid not in busy), None)
            if victim is None:
                return False
            self.forget([victim])
        if need > 0:
            state.block_ids.extend(self.free_block_ids[-need:])
            del self.free_block_ids[-need:]
        return True

    def propose_batch(self, requests: list[DraftRequest]) -> dict[str, list[int]]:
        rounds: list[tuple[str, list[int], int, _DraftState]] = []
        busy = {req_id for req_id, _, _ in requests}
        for req_id, token_ids, num_drafts in requests[: self.max_num_seqs]:
            # Draft i is written at position len + i - 1: stay inside the draft model's context.
            num_drafts = min(num_drafts, self.max_drafts, self.max_model_len - len(token_ids) + 1)
            if num_drafts <= 0:
                continue
            state = self.states.get(req_id)
            if state is None:  # (its tokens are the prompt and the first answer token: decided once, as the engine)
                state = self.states[req_id] = _DraftState(long_rope=self.long_rope_original is not None and rotates_long(
                    len(token_ids) - 1, self.long_rope_original))
            self.states.move_to_end(req_id)
            state.num_computed = min(state.num_computed, len(token_ids) - 1)
            if self._reserve(state, len(token_ids) + num_drafts - 1, busy):
                rounds.append((req_id, token_ids, num_drafts, state))
        if not rounds:
            return {}
        # 1: catch up on the committed tokens and sample draft 1.
        new_reqs = [NewRequestData(req_id, list(tokens), [], _GREEDY, list(state.block_ids), state.num_computed,
                                   long_rope=state.long_rope) for req_id, tokens, _, state in rounds]
        num_scheduled = {req_id: len(tokens) - state.num_computed for req_id, tokens, _, state in rounds}
        finished, self.held = self.held, {req_id for req_id, _, _, _ in rounds}
        out = self.runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens=num_scheduled, total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids=set(), finished_req_ids=finished))
        drafts = {req_id: list(out.sampled_token_ids.get(req_id, [])[:1]) for req_id, _, _, _ in rounds}
        for _, tokens, _, state in rounds:
            state.num_computed = len(tokens)
        # 2: one-token steps until every request has its drafts.
        for i in range(1, max(k for _, _, k, _ in rounds)):
            going = [(req_id, tokens) for req_id, tokens, k, _ in rounds if k > i and len(drafts[req_id]) == i]
            if not going:
                break
            cached = CachedRequestData(req_ids=[r for r, _ in going], new_token_ids=[[drafts[r][-1]] for r, _ in going],
                                       new_block_ids=[[] for _ in going],
                                       num_computed_tokens=[len(tokens) + i - 1 for _, tokens in going])
            out = self.runner.execute_model(SchedulerOutput(
                scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens=dict.fromkeys(cached.req_ids, 1),
                total_num_scheduled_tokens=len(going), preempted_req_ids=set(), finished_req_ids=set()))
            for req_id in cached.req_ids:
                drafts[req_id].extend(out.sampled_token_ids.get(req_id, [])[:1])
        return drafts
