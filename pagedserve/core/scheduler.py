"""Continuous batching: every step, hand each request the tokens it still lacks.

A step's token budget goes first to running requests (in order), then to waiting
ones while budget, max_num_seqs and KV blocks allow, so one step freely mixes
decodes with prefill chunks.  When a running request cannot get a block the
scheduler preempts by recomputation (FCFS: the newest running request; priority:
the worst (priority, arrival_time)) rather than swapping: on one device that is
simpler and, for short sequences, about as cheap.  Under the priority policy
`running` is kept sorted, so "the worst" is simply the last one and requests
already scheduled this step are never victims.

Async (overlap) scheduling, `SchedulerConfig.async_scheduling`: the engine schedules
step N+1 before step N's sampled tokens reach the host, and hands N's results to
`update_from_output` one step late.  A token sampled by an in-flight step is a
placeholder (`Request.num_output_placeholders`): scheduling counts it (the runner
reads the real id on the device), stop checks wait for it.  So a request that
stops at step N may already be in step N+1; that extra token is dropped, and the
blocks of a request that finishes while a step using them is in flight are freed
only once that step's results are in.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.request_queue import create_request_queue
from pagedserve.core.sched_output import (
    CachedRequestData,
    EngineCoreOutput,
    NewRequestData,
    SchedulerOutput,
)

_RUNNING = RequestStatus.RUNNING
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


def _sched_key(request: Request) -> tuple:
    return request.sched_key


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.scheduler_config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        # A per-request chunk cap only makes sense when prompts may be chunked.
        self.long_prefill_token_threshold = (
            scheduler_config.long_prefill_token_threshold if self.enable_chunked_prefill else 0
        )
        self.policy = scheduler_config.policy
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(); told to the runner next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self._next_seq = 0
        self.async_scheduling = bool(getattr(scheduler_config, "async_scheduling", False))
        # Async: scheduled steps whose results are not processed yet, oldest first, each
        # with the requests it holds (by object: an id may be reused after an abort).
        self._inflight: deque[tuple[SchedulerOutput, dict[str, Request]]] = deque()
        # Finished requests whose blocks an in-flight step still uses.
        self._deferred_free: dict[str, Request] = {}

    # ------------------------------------------------------------ admission
    def add_request(self, request: Request) -> None:
        """Queue a request, refusing one that could never run to completion."""
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already in use by an unfinished request")
        old = self._deferred_free.pop(req_id, None)
        if old is not None:
            # The block tables are keyed by id.  Freeing early is safe: the device runs
            # steps in launch order, so the in-flight step is done with these blocks
            # before any later step can write them.
            self.kv_cache_manager.free(old)
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {req_id!r} is not a fresh request (status {request.status.name})")
        num_prompt = request.num_prompt_tokens
        if num_prompt + 1 > self.max_model_len:
            raise ValueError(
                f"request {req_id!r}: the prompt has {num_prompt} tokens, but max_model_len is "
                f"{self.max_model_len}, which leaves no room to generate a token"
            )
        max_len = self.max_model_len
        if request.max_tokens is not None:
            max_len = min(max_len, num_prompt + request.max_tokens)
        # The last sampled token never needs a KV slot.
        kvm = self.kv_cache_manager
        if not kvm.can_ever_fit(max_len - 1):
            raise ValueError(
                f"request {req_id!r}: up to {max_len - 1} tokens of KV cache are needed "
                f"({num_prompt} prompt + up to {max_len - num_prompt} generated), more than the whole "
                f"KV cache holds ({(kvm.num_blocks - 1) * kvm.block_size} tokens); "
                "lower max_tokens or shorten the prompt"
            )
        request.max_num_tokens = max_len
        request.sched_key = (request.priority, request.arrival_time, self._next_seq)
        self._next_seq += 1
        self.requests[req_id] = request
        self.waiting.add_request(request)

    # ------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        kvm = self.kv_cache_manager
        allocate_slots = kvm.allocate_slots
        token_budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        num_scheduled_tokens: dict[str, int] = {}
        cached = CachedRequestData()
        c_req_ids, c_new_tokens = cached.req_ids, cached.new_token_ids
        c_new_blocks, c_computed = cached.new_block_ids, cached.num_computed_tokens
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()

        running = self.running
        i = 0
        while i < len(running) and token_budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            n = len(request._all_token_ids) + request.num_output_placeholders - num_computed
            if 0 < threshold < n:
                n = threshold
            if n > token_budget:
                n = token_budget
            # max_num_tokens <= max_model_len; only binds under async scheduling, when
            # the in-flight tokens already complete the request.
            if n > request.max_num_tokens - 1 - num_computed:
                n = request.max_num_tokens - 1 - num_computed
            if n <= 0:
                i += 1
                continue
            while True:
                new_blocks = allocate_slots(request, n)
                if new_blocks is not None:
                    break
                victim = running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            req_id = request.request_id
            num_scheduled_tokens[req_id] = n
            token_budget -= n
            c_req_ids.append(req_id)
            outputs = request._output_token_ids
            sent = request.num_output_tokens_sent
            if len(outputs) > sent:
                c_new_tokens.append(outputs[sent:])
                request.num_output_tokens_sent = len(outputs)
            else:
                c_new_tokens.append([])
            c_new_blocks.append([b.block_id for b in new_blocks] if new_blocks else [])
            c_computed.append(num_computed)
            request.num_computed_tokens = num_computed + n
            i += 1

        # A step that had to preempt is out of memory: admitting more would only
        # preempt again next step.
        if not preempted:
            token_budget = self._schedule_waiting(token_budget, num_scheduled_tokens, new_reqs)

        finished, self.finished_req_ids = self.finished_req_ids, set()
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            preempted_req_ids=preempted,
            finished_req_ids=finished,
        )
        if self.async_scheduling and num_scheduled_tokens:
            self._add_placeholders(out)
        return out

    def _add_placeholders(self, out: SchedulerOutput) -> None:
        """Async: every request whose known and pending tokens are all computed after
        this step samples one more, which stays a placeholder until the step's results
        are processed."""
        requests = self.requests
        held: dict[str, Request] = {}
        for req_id in out.num_scheduled_tokens:
            request = held[req_id] = requests[req_id]
            if request.num_computed_tokens == len(request._all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1
        self._inflight.append((out, held))

    def _schedule_waiting(
        self, token_budget: int, num_scheduled_tokens: dict[str, int], new_reqs: list[NewRequestData]
    ) -> int:
        """Admit waiting requests in queue order; returns the budget left."""
        kvm = self.kv_cache_manager
        waiting, running = self.waiting, self.running
        threshold = self.long_prefill_token_threshold
        while waiting and token_budget > 0 and len(running) < self.max_num_seqs:
            request = waiting.peek_request()
            if request.num_output_placeholders:
                break  # preempted while its last sample was in flight: resume once it lands
            computed_blocks, num_hit = kvm.get_computed_blocks(request)
            n = request.num_tokens - num_hit
            if 0 < threshold < n:
                n = threshold
            if n > token_budget:
                if not self.enable_chunked_prefill:
                    break  # the whole prompt must go in one step
                n = token_budget
            new_blocks = kvm.allocate_slots(request, n, num_hit, computed_blocks)
            if new_blocks is None:
                break  # head-of-line: later requests must not overtake it
            waiting.pop_request()
            if self.policy == "priority":
                bisect.insort(running, request, key=_sched_key)
            else:
                running.append(request)
            req_id = request.request_id
            if request.status == RequestStatus.WAITING:  # first admission, not a resumption
                request.num_cached_tokens = num_hit
            request.status = _RUNNING
            outputs = request._output_token_ids
            new_reqs.append(
                NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(outputs),
                    sampling_params=request.sampling_params,
                    block_ids=kvm.get_block_ids(req_id),
                    num_computed_tokens=num_hit,
                )
            )
            request.num_output_tokens_sent = len(outputs)
            num_scheduled_tokens[req_id] = n
            token_budget -= n
            request.num_computed_tokens = num_hit + n
        return token_budget

    def _preempt(self, request: Request) -> None:
        """Recompute later: free the KV, keep the tokens, go back to the queue head."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend_request(request)

    # --------------------------------------------------------------- update
    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop rules, release finished requests."""
        if self.async_scheduling:
            return self._update_from_output_async(scheduler_output, sampled_token_ids)
        outputs: list[EngineCoreOutput] = []
        append_output = outputs.append
        requests = self.requests
        get_sampled = sampled_token_ids.get
        num_finished = 0
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is None:
                continue  # finished or aborted after this step was scheduled
            all_ids = request._all_token_ids
            if request.num_computed_tokens < len(all_ids) or request.status is not _RUNNING:
                continue  # a prompt chunk: its sample is meaningless
            token_ids = get_sampled(req_id)
            if not token_ids:
                continue
            out_ids = request._output_token_ids
            status = None
            if len(token_ids) == 1:
                tok = token_ids[0]
                out_ids.append(tok)
                all_ids.append(tok)
                new_ids = [tok]
                if tok in request.finish_token_ids and len(out_ids) >= request.min_tokens:
                    status = _STOPPED
                    if tok != request.eos_for_stop:
                        request.stop_reason = tok
                elif len(all_ids) >= request.max_num_tokens:
                    status = _LENGTH_CAPPED
            else:
                new_ids = []
                for tok in token_ids:
                    out_ids.append(tok)
                    all_ids.append(tok)
                    new_ids.append(tok)
                    status = self._check_stop(request, tok)
                    if status is not None:
                        break
            if status is None:
                append_output(EngineCoreOutput(req_id, new_ids, False, None, None, request.num_cached_tokens))
                continue
            request.status = status
            self._release(request)
            num_finished += 1
            append_output(
                EngineCoreOutput(
                    req_id, new_ids, True, _FINISH_REASONS[status], request.stop_reason, request.num_cached_tokens
                )
            )
        if num_finished:
            self.running[:] = [r for r in self.running if r.status is _RUNNING]
        return outputs

    def _update_from_output_async(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]
    ) -> list[EngineCoreOutput]:
        """The oldest in-flight step's results: each token fills a placeholder of the
        request object that step held; tokens of requests finished meanwhile (stopped
        one step late, aborted, or a reused id) are dropped."""
        if not self._inflight or self._inflight[0][0] is not scheduler_output:
            raise RuntimeError("async scheduling: results must be processed once each, in the order "
                               "the steps were scheduled")
        _, held = self._inflight.popleft()
        outputs: list[EngineCoreOutput] = []
        any_running_finished = False
        for req_id, request in held.items():
            token_ids = sampled_token_ids.get(req_id)
            if not token_ids or not request.num_output_placeholders:
                continue  # a prompt chunk: nothing sampled
            request.num_output_placeholders -= 1
            if request.is_finished():
                continue
            new_ids = []
            status = None
            for tok in token_ids:
                request._output_token_ids.append(tok)
                request._all_token_ids.append(tok)
                new_ids.append(tok)
                status = self._check_stop(request, tok)
                if status is not None:
                    break
            if status is None:
                outputs.append(EngineCoreOutput(req_id, new_ids, False, None, None, request.num_cached_tokens))
                continue
            if request.status == _RUNNING:
                any_running_finished = True
            else:  # preempted after this step was scheduled: it waits in the queue
                self.waiting.remove_request(request)
            request.status = status
            self._release(request)
            outputs.append(EngineCoreOutput(
                req_id, new_ids, True, _FINISH_REASONS[status], request.stop_reason, request.num_cached_tokens))
        if any_running_finished:
            self.running[:] = [r for r in self.running if r.status is _RUNNING]
        if self._deferred_free:
            self._free_deferred()
        return outputs

    def _in_flight(self, request: Request) -> bool:
        req_id = request.request_id
        return any(held.get(req_id) is request for _, held in self._inflight)

    def _free_deferred(self) -> None:
        for req_id, request in list(self._deferred_free.items()):
            if not self._in_flight(request):
                del self._deferred_free[req_id]
                self.kv_cache_manager.free(request)

    @property
    def num_inflight_steps(self) -> int:
        return len(self._inflight)

    @staticmethod
    def _check_stop(request: Request, tok: int) -> RequestStatus | None:
        """Stop rules for the token just appended: EOS/stop ids (held back until
        min_tokens), then max_tokens / max_model_len."""
        if tok in request.finish_token_ids and request.num_output_tokens >= request.min_tokens:
            if tok != request.eos_for_stop:
                request.stop_reason = tok
            return _STOPPED
        if request.num_tokens >= request.max_num_tokens:
            return _LENGTH_CAPPED
        return None

    def _release(self, request: Request) -> None:
        if self._inflight and self._in_flight(request):
            self._deferred_free[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); unknown ids are ignored."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        any_running = False
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == _RUNNING:
                any_running = True
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._release(request)
        if any_running:
            self.running[:] = [r for r in self.running if r.status == _RUNNING]

    # -------------------------------------------------------------- queries
    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting)."""
        return len(self.running), len(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
