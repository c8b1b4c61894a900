"""Continuous batching: every step, hand each request the tokens it still lacks.

A step's token budget goes first to running requests (in order), then to waiting ones while
budget, max_num_seqs and KV blocks allow, so one step freely mixes decodes with prefill chunks.
When a running request cannot get a block the scheduler preempts one (FCFS: the newest running
request; priority: the worst (priority, arrival_time)): by default its KV is freed and recomputed
on resumption (what the prefix cache and the KV tier still hold is not); with
preemption_mode="swap" the KV-cache manager first copies it to the KV tier, and the resumption
loads it back.  Under the priority policy `running` is kept sorted, so "the worst" is simply the
last one and requests already scheduled this step are never victims.

Drafts (n-gram, a draft model's, or a request's own predicted output: core/prediction_drafter.py)
are scheduled and given KV slots like any token; `update_from_output` takes back the rejected
ones'.  A chunk that reaches a prompt's image needs its encoder output held
(core/encoder_cache_manager.py).  A LongRoPE model's request that outgrows the original context
starts again with the long factors at every position, as HF's generate does (`long_rope_original`).

The update path is one loop (`update_from_output`) with three hooks that `AsyncScheduler`
(core/async_scheduler.py) overrides for overlap scheduling: whether a sampled token belongs to
the request now holding its id, what happens after a step is scheduled, and when a finished
request's blocks can be freed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from typing import Any

from pagedserve.config import SchedulerConfig, SpeculativeConfig
from pagedserve.core.block_pool import KVCacheBlock
from pagedserve.core.draft_proposals import propose_drafts
from pagedserve.core.encoder_cache_manager import EncoderCacheManager
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.ngram_proposer import Drafter, NgramProposer, SpecDecodingStats
from pagedserve.core.request import Request, RequestStatus, check_stop, prompt_length_error
from pagedserve.core.request_queue import create_request_queue
from pagedserve.core.sched_output import CachedRequestData, EngineCoreOutput, NewRequestData, SchedulerOutput
from pagedserve.core.snapshot import KVSnapshot, take_snapshot
from pagedserve.core.step_budget import StepTimeBudget
from pagedserve.errors import InvalidRequestError

_RUNNING = RequestStatus.RUNNING
_STOPPED = RequestStatus.FINISHED_STOPPED
_ERROR = RequestStatus.FINISHED_ERROR
GRAMMAR_REFUSED = ("the structured-output grammar refused a token its own mask allowed: the grammar library cannot "
                   "follow this constraint (simplify the regex, schema or grammar)")
_WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM
_finish_reason = RequestStatus.get_finished_reason


def _sched_key(request: Request) -> tuple:
    return request.sched_key



class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 speculative_config: SpeculativeConfig | None = None, drafter: Drafter | None = None,
                 max_loras: int = 0, long_rope_original: int | None = None) -> None:
        """`drafter`: a draft model's proposer (method "draft_model", built by the engine);
        the n-gram one is built here.  `max_loras`: most distinct LoRA adapters among the
        running requests (the slots the model holds; 0: no adapters).  `long_rope_original`:
        a LongRoPE model's original context (layers/rotary_embedding.long_rope_original)."""
        self.scheduler_config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        # A per-request chunk cap only makes sense when prompts may be chunked.
        self.long_prefill_token_threshold = scheduler_config.long_prefill_token_threshold if \
            self.enable_chunked_prefill else 0
        self.policy = scheduler_config.policy
        self.max_loras = max_loras
        self.long_rope_original = long_rope_original
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(); told to the runner next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self._next_seq = 0
        self.num_grammar_requests = 0  # unfinished requests with a grammar
        self.num_prediction_requests = 0  # unfinished requests with a predicted output
        self.step_budget = (StepTimeBudget(scheduler_config.max_step_ms / 1000, self.max_num_batched_tokens)
                            if scheduler_config.max_step_ms else None)
        # Speculative decoding: drafts proposed here, at schedule time, for decoding requests
        # whose sampling allows exact verification, while the batch is small enough.
        self.speculative_config = speculative_config
        if speculative_config is None:
            drafter = None
        elif drafter is None:
            if speculative_config.method != "ngram":
                raise ValueError(f"speculative method {speculative_config.method!r} needs its drafter "
                                 "(the engine builds the draft model's)")
            drafter = NgramProposer(speculative_config)
        self.drafter = drafter
        # Where a request with a prediction drafts when its prediction has nothing to propose.
        self.prompt_lookup = NgramProposer(speculative_config if speculative_config is not None
                                           and speculative_config.method == "ngram" else SpeculativeConfig())
        # Image input: which encoder outputs the runner holds, and how chunks meet images.
        self.encoder_cache = EncoderCacheManager(scheduler_config.encoder_cache_rows,
                                                 scheduler_config.disable_chunked_mm_input)
        self.spec_stats = SpecDecodingStats(
            num_accepted_tokens_per_pos=[0] * (speculative_config.num_speculative_tokens if speculative_config else 0))

    # ------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Queue a request, refusing one that could never run to completion."""
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already in use by an unfinished request")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {req_id!r} is not a fresh request (status {request.status.name})")
        if request.grammar is not None and not request.grammar.is_ready():
            request.status = _WAITING_FOR_FSM
        num_prompt = request.num_prompt_tokens
        pooling = request.pooling_params is not None  # a prompt alone: nothing is generated
        if (error := prompt_length_error(num_prompt, self.max_model_len, pooling)) is not None:
            raise error
        max_len = num_prompt + 1 if pooling else self.max_model_len
        if request.max_tokens is not None and not pooling:
            max_len = min(max_len, num_prompt + request.max_tokens)
        # The last sampled token never needs a KV slot (a pooling request's last prompt token does).
        kvm = self.kv_cache_manager
        if not kvm.can_ever_fit(max_len - 1, self.max_num_batched_tokens):
            raise InvalidRequestError(
                f"request {req_id!r}: up to {max_len - 1} tokens of KV cache are needed "
                f"({num_prompt} prompt + up to {max_len - num_prompt} generated), "
                f"{kvm.blocks_needed(max_len - 1, self.max_num_batched_tokens)} blocks, more than the whole "
                f"KV cache holds ({kvm.num_blocks - 1} blocks of {kvm.block_size} tokens); "
                "lower max_tokens or shorten the prompt", param="max_tokens")
        request.max_num_tokens = max_len
        if self.drafter is not None or request.prediction is not None:
            request.max_draft_tokens = (self.drafter if request.prediction is None else self.prompt_lookup).max_drafts
        request.sched_key = (request.priority, request.arrival_time, self._next_seq)
        self._next_seq += 1
        self._admit(request)
        self.requests[req_id] = request
        self.num_grammar_requests += request.grammar is not None
        self.num_prediction_requests += request.prediction is not None
        self.waiting.add_request(request)

    def _admit(self, request: Request) -> None:
        """Hook: a request has passed every check and is about to be queued."""

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        token_budget = step_budget = self._step_token_budget()
        self.encoder_cache.begin_step()
        num_scheduled_tokens: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}
        token_budget = self._schedule_running(token_budget, num_scheduled_tokens, cached, preempted, spec_tokens)
        # A step that had to preempt is out of memory: admitting more would only
        # preempt again next step.
        if not preempted:
            token_budget = self._schedule_waiting(token_budget, num_scheduled_tokens, new_reqs)

        finished, self.finished_req_ids = self.finished_req_ids, set()
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=step_budget - token_budget,
            preempted_req_ids=preempted,
            finished_req_ids=finished,
            scheduled_spec_decode_tokens=spec_tokens,
            kv_transfers=self.kv_cache_manager.take_transfers(),
            free_encoder_ids=self.encoder_cache.take_freed(),
        )
        if self.num_grammar_requests and num_scheduled_tokens:
            out.structured_output_rows = self._structured_output_rows(num_scheduled_tokens)
        if num_scheduled_tokens:
            self._after_schedule(out)
        return out

    def _schedule_running(self, token_budget: int, num_scheduled_tokens: dict[str, int], cached: CachedRequestData,
                          preempted: set[str], spec_tokens: dict[str, list[int]]) -> int:
        """Running requests first, in order, each the tokens it lacks (and its drafts)
        within the budget; when the pool runs out of blocks, requests are preempted
        from the back of `running` (into `preempted`).  Returns the budget left."""
        proposals = self._propose_drafts()
        running = self.running
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            if self._outgrew_short_rope(request):
                self._preempt(request, out_of_memory=False)
                running.pop(i)
                preempted.add(request.request_id)
                continue
            n, drafts = self._running_tokens(request, proposals, token_budget, len(running) - i - 1)
            if n <= 0:
                i += 1
                continue
            new_blocks = self._allocate_or_preempt(request, n, preempted)
            if new_blocks is None:
                break  # the request itself was preempted: it was the last one
            req_id = request.request_id
            if drafts and n > 1:  # the budgets may have cut some drafts
                spec_tokens[req_id] = drafts[: n - 1]
            num_scheduled_tokens[req_id] = n
            token_budget -= n
            self._add_cached_request(cached, request, new_blocks, n)
            i += 1
        return token_budget

    def _running_tokens(self, request: Request, proposals: dict[str, list[int]],
                        token_budget: int, reserve: int = 0) -> tuple[int, list[int] | None]:
        """Tokens a running request computes this step (its drafts too, if it decodes one token,
        leaving `reserve` later running requests a token each: they starved), and those drafts."""
        n = request.num_tokens_to_compute
        drafts = proposals.get(request.request_id) if n == 1 else None
        if drafts:
            drafts = drafts[: max(0, token_budget - reserve - n)]
            n += len(drafts)
        threshold = self.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        if n > token_budget:
            n = token_budget
        # (max_num_tokens <= max_model_len: binds under async scheduling, in-flight tokens complete it)
        left = request.max_num_tokens - 1 - request.num_computed_tokens
        if self.long_rope_original is not None and not request.long_rope:  # (short factors below it only)
            left = min(left, self.long_rope_original - request.num_computed_tokens)
        if n > left:
            n = left
        return (self.encoder_cache.fit(request, request.num_computed_tokens, n) if request.images else n), drafts

    def _allocate_or_preempt(self, request: Request, n: int, preempted: set[str]) -> list[KVCacheBlock] | None:
        """KV slots for `n` more tokens of a running request, preempting the last running
        request until they fit; None when that preempted the request itself."""
        running = self.running
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, n)
            if new_blocks is not None:
                return new_blocks
            victim = running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None

    @staticmethod
    def _add_cached_request(cached: CachedRequestData, request: Request, new_blocks: list[KVCacheBlock],
                            n: int) -> None:
        """The runner holds the request already: it gets the deltas (output tokens it
        has not seen, new block ids), and the request counts `n` more tokens computed."""
        cached.req_ids.append(request.request_id)
        outputs = request.output_token_ids
        sent = request.num_output_tokens_sent
        if len(outputs) > sent:
            cached.new_token_ids.append(outputs[sent:])
            request.num_output_tokens_sent = len(outputs)
        else:
            cached.new_token_ids.append([])
        cached.new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else [])
        cached.num_computed_tokens.append(request.num_computed_tokens)
        request.num_computed_tokens += n

    def _propose_drafts(self) -> dict[str, list[int]]:
        """This step's drafts (core/draft_proposals.py): the drafter's none while more than
        `disable_by_batch_size` requests run."""
        drafter = self.drafter
        if drafter is not None and self.finished_req_ids:
            drafter.forget(self.finished_req_ids)
        if drafter is not None and len(self.running) > self.speculative_config.disable_by_batch_size:
            drafter = None
        if drafter is None and not self.num_prediction_requests:
            return {}
        return propose_drafts(self.running, drafter, self.prompt_lookup)

    def _step_token_budget(self) -> int:
        """The step's token budget: max_num_batched_tokens, or under a step-time target
        (max_step_ms) while some running request streams its output (its next token waits
        for this step), what fits the target: every running request, and at least a block
        of prefill progress.  With no stream to protect a prompt prefills at full speed."""
        budget = self.step_budget
        if budget is None or not any(r.num_output_tokens for r in self.running):
            return self.max_num_batched_tokens
        return budget.token_budget(len(self.running) + self.kv_cache_manager.block_size)

    def record_step_time(self, num_tokens: int, seconds: float) -> None:
        """A step's duration, for the time budget (max_step_ms)."""
        if self.step_budget is not None:
            self.step_budget.observe(num_tokens, seconds)

    def _after_schedule(self, out: SchedulerOutput) -> None:
        """Hook: a step with tokens is about to be launched."""

    def _structured_output_rows(self, num_scheduled_tokens: dict[str, int]) -> dict[str, int]:
        """The constrained requests that sample this step, with their row among all the
        requests that sample (those whose known and pending tokens are all computed after
        it: the runner's rule), in step order."""
        rows: dict[str, int] = {}
        row = 0
        requests = self.requests
        for req_id in num_scheduled_tokens:
            request = requests[req_id]
            # (>=: a request with drafts counts them as computed, and samples too.)
            if request.num_computed_tokens >= len(request.all_token_ids) + request.num_output_placeholders:
                if request.grammar is not None:
                    rows[req_id] = row
                row += 1
        return rows

    def _schedule_waiting(
        self, token_budget: int, num_scheduled_tokens: dict[str, int], new_reqs: list[NewRequestData]
    ) -> int:
        """Admit waiting requests in queue order; returns the budget left.  A request whose
        grammar is still compiling, or whose LoRA adapter would be one more than the model
        holds at once, is stepped over (and keeps its place), so a slow schema or a busy
        adapter holds up nothing but itself."""
        kvm = self.kv_cache_manager
        waiting, running = self.waiting, self.running
        stepped_over: list[Request] = []
        loras = {r.lora_request.lora_int_id for r in running if r.lora_request is not None} if self.max_loras else None
        while waiting and token_budget > 0 and len(running) < self.max_num_seqs:
            request = waiting.peek_request()
            if request.status is _WAITING_FOR_FSM:
                if not request.grammar.is_ready() or request.grammar.error is not None:
                    stepped_over.append(waiting.pop_request())  # (a failed one: the engine ends it)
                    continue
                request.status = RequestStatus.WAITING
            lora = request.lora_request
            if loras is not None and lora is not None and lora.lora_int_id not in loras:
                if len(loras) >= self.max_loras:
                    stepped_over.append(waiting.pop_request())
                    continue
            if request.num_output_placeholders:
                break  # preempted while its last sample was in flight: resume once it lands
            self._outgrew_short_rope(request)  # (a resumption past the context: long from here)
            computed_blocks, num_hit = kvm.get_computed_blocks(request)
            n = self._admission_tokens(request, num_hit, token_budget)
            if n <= 0:
                break  # head-of-line: later requests must not overtake it
            new_blocks = kvm.allocate_slots(request, n, num_hit, computed_blocks)
            if new_blocks is None:
                break  # head-of-line: later requests must not overtake it
            waiting.pop_request()
            if loras is not None and lora is not None:
                loras.add(lora.lora_int_id)
            if self.policy == "priority":
                bisect.insort(running, request, key=_sched_key)
            else:
                running.append(request)
            req_id = request.request_id
            if request.status == RequestStatus.WAITING:  # first admission, not a resumption
                request.num_cached_tokens = num_hit
            request.status = _RUNNING
            outputs = request.output_token_ids
            new_reqs.append(
                NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(outputs),
                    sampling_params=request.sampling_params,
                    block_ids=kvm.get_block_ids(req_id),
                    num_computed_tokens=num_hit,
                    pooling_params=request.pooling_params,
                    lora_request=request.lora_request,
                    images=request.images, mrope=request.mrope, long_rope=request.long_rope,
                )
            )
            request.num_output_tokens_sent = len(outputs)
            num_scheduled_tokens[req_id] = n
            token_budget -= n
            request.num_computed_tokens = num_hit + n
        for request in reversed(stepped_over):
            waiting.prepend_request(request)
        return token_budget

    def _admission_tokens(self, request: Request, num_hit: int, token_budget: int) -> int:
        """Tokens a waiting request computes in the step that admits it (0: it cannot run
        this step: its whole prompt must go in one step without chunked prefill, or its
        next image does not fit)."""
        n, threshold = request.num_tokens - num_hit, self.long_prefill_token_threshold
        if 0 < threshold < n:
            n = threshold
        if n > token_budget:
            if not self.enable_chunked_prefill:
                return 0
            n = token_budget
        return self.encoder_cache.fit(request, num_hit, n) if request.images else n

    def _outgrew_short_rope(self, request: Request) -> bool:
        """HF's LongRoPE: a sequence of more tokens than the original context is computed
        whole with the long factors (generate drops the cache it rotated with the short ones
        once the length passes it), so such a request's KV is freed, never swapped, and
        recomputed under new keys (Request.hash_salt)."""
        if self.long_rope_original is None or request.long_rope or request.num_tokens <= self.long_rope_original:
            return False
        request.long_rope, request.block_hashes = True, []
        return True

    def _preempt(self, request: Request, out_of_memory: bool = True) -> None:
        """Free the KV (swap mode: copied out to the tier first), keep the tokens, go
        back to the queue head; the resumption recomputes what the caches lack.  Not
        `out_of_memory` (a LongRoPE restart): freed, never swapped, and not counted."""
        if out_of_memory:
            self.kv_cache_manager.preempt(request)
            request.num_preemptions += 1
            self.num_preemptions_total += 1
        else:
            self.kv_cache_manager.free(request, keep_computed=False)
        self.encoder_cache.release_request(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.prepend_request(request)

    # --------------------------------------------------------------- update
    def update_from_output(self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]],
                           invalid_req_ids: Mapping[str, str | None] | None = None,
                           pooler_output: Mapping[str, Any] | None = None) -> list[EngineCoreOutput]:
        """Append each request's sampled tokens, apply the stop rules, release finished
        requests.  `invalid_req_ids`: requests the runner could not sample, each with
        the reason the client gets (None: the logits were not finite); they finish with
        "error" and the rest go on.  `pooler_output`: pooling requests whose prompt this
        step completed, with their result; they finish ("stop") with it."""
        invalid_req_ids = invalid_req_ids or {}
        self._begin_update(scheduler_output)
        outputs: list[EngineCoreOutput] = []
        append_output = outputs.append
        requests = self.requests
        any_running_finished = False
        for req_id, pooled in (pooler_output or {}).items():
            request = requests.get(req_id)
            if request is None or request.status is not _RUNNING:
                continue  # aborted since
            any_running_finished |= self._finish(request, _STOPPED)
            append_output(EngineCoreOutput(req_id, [], True, "stop", None, request.num_cached_tokens, pooled))
        get_sampled = sampled_token_ids.get
        takes_sample = self._takes_sample
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            token_ids = get_sampled(req_id)
            if not token_ids and req_id not in invalid_req_ids:
                continue  # a prompt chunk: nothing sampled
            request = requests.get(req_id)
            if request is None or not takes_sample(request, scheduler_output):
                continue  # finished or aborted since, or an older request's token
            if drafts_of and token_ids and req_id in drafts_of:
                self._settle_drafts(request, len(drafts_of[req_id]), len(token_ids) - 1)
            if not token_ids:
                status = _ERROR
                request.stop_reason = invalid_req_ids.get(req_id)
            elif len(token_ids) == 1:  # one token a step, the usual case, without the loop's overhead
                tok = token_ids[0]
                request.append_output_token_id(tok)
                status = check_stop(request, tok) if request.grammar is None else self._advance(request, tok)
            else:
                status = None
                for i, tok in enumerate(token_ids):
                    request.append_output_token_id(tok)
                    status = check_stop(request, tok) if request.grammar is None else self._advance(request, tok)
                    if status is not None:
                        token_ids = token_ids[: i + 1]
                        # The accepted drafts past the stop were counted computed: the
                        # request holds KV of its own tokens only (the radix tree keeps
                        # its last block by that count).
                        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                        break
            if status is None:
                out = EngineCoreOutput(req_id, token_ids, False, None, None, request.num_cached_tokens)
            else:
                any_running_finished |= self._finish(request, status)
                out = EngineCoreOutput(req_id, token_ids or [], True, _finish_reason(status),
                                       request.stop_reason, request.num_cached_tokens)
            if request.prediction is not None:
                out.predicted = request.prediction.keep(request.output_token_ids, len(token_ids or ()))
                out.prediction_counts = request.prediction.counts
            append_output(out)
        if any_running_finished:
            self.running[:] = [r for r in self.running if r.status is _RUNNING]
        self._end_update()
        return outputs

    def _settle_drafts(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """The runner verified `num_drafted` drafts and accepted the first `num_accepted`
        (it returns those plus one token of its own).  The step counted every draft as
        computed: the rejected ones' KV slots are taken back, to be overwritten."""
        request.num_computed_tokens -= num_drafted - num_accepted
        self.spec_stats.observe(num_drafted, num_accepted)
        prediction = request.prediction
        if prediction is None:
            request.max_draft_tokens = self.drafter.next_num_drafts(num_drafted, num_accepted)
        elif prediction.proposed:
            prediction.settle(num_drafted, num_accepted)
        else:
            request.max_draft_tokens = self.prompt_lookup.next_num_drafts(num_drafted, num_accepted)

    @staticmethod
    def _advance(request: Request, tok: int) -> RequestStatus | None:
        """check_stop for a constrained request: the grammar takes the token first; a
        token it refuses is an error, and a grammar at its end stops the request."""
        if not request.grammar.accept_token(tok):
            # Only a token the step's mask allowed is sampled, so the grammar library
            # contradicted itself (llguidance does for a regex with control characters):
            # the constraint cannot be followed, which the client hears (a 400), not a crash.
            request.stop_reason = GRAMMAR_REFUSED + (f" [{why}]" if (why := request.grammar.refusal) else "")
            return _ERROR
        status = check_stop(request, tok)
        if status is None and request.grammar.is_terminated():
            status = _STOPPED
        return status

    def _begin_update(self, scheduler_output: SchedulerOutput) -> None:
        """Hook: the results of `scheduler_output` are about to be applied."""

    def _takes_sample(self, request: Request, scheduler_output: SchedulerOutput) -> bool:
        """Hook: whether the token this step sampled for `request`'s id is its own (a
        sample after a prompt chunk that left part of the prompt uncomputed is not)."""
        return request.status is _RUNNING and request.num_computed_tokens >= len(request.all_token_ids)

    def _end_update(self) -> None:
        """Hook: a step's results are applied."""

    def _finish(self, request: Request, status: RequestStatus) -> bool:
        """Move a request to a finished status and release it; returns whether it was
        running (the caller then drops finished requests from `running` in one pass)."""
        was_running = request.status is _RUNNING
        if not was_running:
            self.waiting.remove_request(request)
        request.status = status
        self._release(request)
        return was_running

    def _release(self, request: Request) -> None:
        self._free_blocks(request)
        self.encoder_cache.release_request(request)
        self.num_grammar_requests -= request.grammar is not None
        self.num_prediction_requests -= request.prediction is not None
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def _free_blocks(self, request: Request) -> None:
        """Hook: free a finished request's KV blocks (now, on one device stream)."""
        self.kv_cache_manager.free(request)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); unknown ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        any_running = False
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is not None:
                any_running |= self._finish(request, finished_status)
        if any_running:
            self.running[:] = [r for r in self.running if r.status is _RUNNING]

    # -------------------------------------------------------------- queries
    @property
    def num_inflight_steps(self) -> int:
        """Steps scheduled whose results are not applied yet (always 0 here: the engine
        applies a step's results before scheduling the next)."""
        return 0

    @property
    def num_deferred_frees(self) -> int:
        """Finished requests whose blocks wait for an in-flight step (none here)."""
        return 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting)."""
        return len(self.running), len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        self.encoder_cache.reset()
        return self.kv_cache_manager.reset_prefix_cache()

    def watch_blocks(self, enabled: bool) -> None:
        """Record block changes for `snapshot` deltas (only while someone watches)."""
        self.kv_cache_manager.block_pool.track_changes(enabled)

    def snapshot(self, full: bool) -> KVSnapshot:
        """The block pool and the queues for the dashboard (see core/snapshot.py)."""
        kvm = self.kv_cache_manager
        return take_snapshot(kvm.block_pool, kvm.block_size, self.running, self.waiting, kvm.get_block_ids, full)

