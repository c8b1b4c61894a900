"""EngineCore: the loop that owns the scheduler, the model executor and the KV-cache
manager, and does only schedule -> execute -> update (vLLM v1's name and role).

A request reaches it already checked (`InputProcessor.process` made it an
`EngineCoreRequest`), so `add_request` only queues it and `step()` never sees bad input:
an exception from inside a step means a bug, not a user error.

With async (overlap) scheduling a step schedules and launches step N+1 before it waits
for step N's results, which it then applies: outputs arrive one step late (the first
step returns none), and the device never waits for the host's bookkeeping.  When no
request is left, the last in-flight step is applied at once, so the core is idle with
every block free.  The deque of launched steps is the one ledger of what is in flight.

Why the `OutputProcessor` runs here, beside the core and on its thread, in every client
(the in-process one and each Ray replica): a stop string is found while a step's tokens
are detokenized, and the request must leave the scheduler in that same step.  Found one
step later (vLLM v1 aborts from its front end), the request would run one more step, and
under overlap scheduling whether the last in-flight step drains at once depends on it:
outputs, KV usage and timings would change.  So a step's outputs leave the core as
finished `RequestOutput`s (cumulative snapshots), which is also what a replica streams.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.core.async_scheduler import AsyncScheduler
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.ngram_proposer import Drafter
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched_output import EngineCoreOutput, GrammarBitmask, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.input_processor import EngineCoreRequest
from pagedserve.engine.output_processor import OutputProcessor, ParentRequest
from pagedserve.errors import InvalidRequestError
from pagedserve.executor.abstract import ModelExecutor, PendingModelOutput
from pagedserve.layers.rotary_embedding import long_rope_original, rotates_long
from pagedserve.lora.peft import adapter_files_key, check_peft_config
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import EngineOutput, RequestMetrics
from pagedserve.platforms import is_cuda
from pagedserve.sampling_params import RequestOutputKind
from pagedserve.structured_output import StructuredOutputManager
from pagedserve.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger("pagedserve.engine")


@dataclass
class EngineStats:
    """A snapshot for loggers and /metrics; the token and preemption counters are cumulative."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    external_prefix_cache_queries: int
    external_prefix_cache_hits: int
    kv_offload_stored_blocks: int
    kv_offload_invalid_blocks: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_structured_requests: int
    grammar_compiles: int
    grammar_cache_hits: int
    grammar_compile_seconds: float
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # LoRA (vLLM's lora_requests_info): the adapters of running and of waiting requests, by
    # name, and how many may run in one step (0: LoRA off).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


class EngineCore:
    """Scheduler, executor and KV-cache manager, stepped by one thread (not thread-safe)."""

    def __init__(self, config: EngineConfig, model_executor: ModelExecutor, tokenizer: Any,
                 structured_output: StructuredOutputManager, eos_token_id: int | None,
                 drafter: Drafter | None = None) -> None:
        """`model_executor` has allocated its KV cache (config.cache_config.num_blocks is
        set); `structured_output` is shared with the InputProcessor (it compiles, the core
        fills masks); `drafter`: the draft model's proposer when speculative_config names one."""
        cache, sched = config.cache_config, config.scheduler_config
        if not cache.num_blocks or cache.num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got num_blocks={cache.num_blocks}")
        self.config = config
        self.model_executor = model_executor
        self.structured_output = structured_output
        self.eos_token_id = eos_token_id
        self.long_rope_original = long_rope_original(config.model_config.hf_config)  # (Phi-3's; else None)
        self.kv_cache_manager = KVCacheManager(
            cache.num_blocks, cache.block_size, sched.max_model_len, cache.enable_prefix_caching,
            cache.group_windows, model_executor.kv_tier, sched.preemption_mode == "swap",
            cache.prefix_caching_algo == "radix",
            store_computed=cache.kv_offload_dir is not None or cache.kv_offload_bytes is not None)
        sync_only = ("speculative_config" if config.speculative_config is not None
                     else "runner='pooling'" if config.model_config.runner == "pooling" else None)
        sched.async_scheduling = self.async_scheduling = resolve_async_scheduling(
            sched.async_scheduling, model_executor, sync_only)
        max_loras = config.lora_config.max_loras if config.lora_config is not None else 0
        if self.async_scheduling:
            self.scheduler: Scheduler = AsyncScheduler(sched, self.kv_cache_manager, max_loras, self.long_rope_original)
        else:
            self.scheduler = Scheduler(sched, self.kv_cache_manager, config.speculative_config, drafter, max_loras,
                                       self.long_rope_original)
        self.output_processor = OutputProcessor(tokenizer)  # beside the core: see the module docstring
        # LoRA adapters the executor has loaded and checked, by id, least recently used first.
        self._loras: OrderedDict[int, LoRARequest] = OrderedDict()
        # Each adapter's files as first loaded (peft.adapter_files_key), by what keys its
        # cached KV blocks (id, name, path: Request.hash_salt), for the engine's life: an
        # adapter read again (evicted, or removed and loaded anew) whose files changed is
        # refused, as its cached KV came from the old weights.
        self._lora_files: dict[tuple[int, str, str], tuple[int, ...]] = {}
        # The adapter each id names, from its first request until the caller removes it
        # (remove_lora): evicting it from host memory does not free the id, so that a
        # request reusing an id for another adapter is refused whatever is loaded or parked.
        self._lora_ids: dict[int, LoRARequest] = {}
        # Requests whose adapter has no room yet (max_cpu_loras loaded, each with unfinished
        # requests), oldest first: their parent is in the output processor, their
        # sequences join the scheduler when an adapter goes idle (see _admit_parked), so
        # host memory holds at most max_cpu_loras adapters whatever the requests name.
        self._parked: deque[EngineCoreRequest] = deque()
        # Async scheduling: launched steps whose results are not applied yet, oldest first
        # (at most one stays in flight between calls to step()).
        self._inflight: deque[tuple[SchedulerOutput, PendingModelOutput, float]] = deque()  # (, launched at)
        self._last_step_end = 0.0  # when the last launched step's output was ready (its successor started then)
        # Requests whose grammar was still compiling when they were added: parent id -> its
        # compilation (a failure ends the request with "error" at the next step).
        self._compiling: dict[str, Future] = {}
        self.busiest_snapshot: KVSnapshot | None = None  # see keep_busiest_snapshot
        self.busiest_usage = -1.0

    # ------------------------------------------------------------------ requests
    def add_request(self, request: EngineCoreRequest,
                    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Queue a request the InputProcessor has checked: its adapter loaded, its
        sequences in the scheduler, its parent in the output processor.  Raises
        ValueError (an id in use, a prompt the scheduler cannot fit); nothing changed then."""
        for rid in {request.request_id, *request.child_ids}:
            if rid in self.output_processor.parents or rid in self.scheduler.requests:
                raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        lora = request.lora_request
        if lora is not None:
            self._check_lora_id(lora)
        # Behind a parked request every adapter request waits its turn: otherwise requests
        # on the busy adapters could keep them busy for ever.
        if lora is not None and (self._parked or not self._has_room(lora)):
            # It loads later, in a step, where a refusal can only end it with "error": what
            # can be checked without the model is checked now, refused as when it loads at once.
            if lora.lora_int_id not in self._loras:
                assert self.config.lora_config is not None
                check_peft_config(lora.lora_path, self.config.lora_config.max_lora_rank)
            self._track(request, output_kind)
            self._parked.append(request)
            self._lora_ids.setdefault(lora.lora_int_id, lora)
            return
        self._admit(request)
        self._track(request, output_kind)

    def _admit(self, request: EngineCoreRequest) -> None:
        """The request's adapter loaded and its sequences in the scheduler; ValueError
        (an adapter that does not load, a prompt the scheduler cannot fit) changes nothing."""
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        params = request.sampling_params
        added: list[str] = []
        try:
            for cid, cparams in zip(request.child_ids, request.child_params, strict=True):
                grammar = self.structured_output.request(params.structured_outputs) if request.grammar else None
                self.scheduler.add_request(Request(cid, request.prompt_token_ids, cparams, self.eos_token_id,
                                                   request.arrival_time, request.priority, request.cache_salt,
                                                   grammar, request.pooling_params, request.lora_request,
                                                   request.prediction_token_ids, request.images or (),
                                                   request.mrope, self.long_rope_original is not None and
                                                   rotates_long(len(request.prompt_token_ids),
                                                                self.long_rope_original)))
                added.append(cid)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise

    def _track(self, request: EngineCoreRequest, output_kind: RequestOutputKind) -> None:
        """The request's parent in the output processor (and its grammar's compilation)."""
        parent = ParentRequest(request.request_id, request.prompt, request.prompt_token_ids, output_kind,
                               RequestMetrics(request.arrival_time), pooling=request.pooling_params is not None,
                               lora_request=request.lora_request)
        self.output_processor.add_request(parent, request.child_ids, request.child_params)
        if request.grammar is not None and not request.grammar.done():
            self._compiling[request.request_id] = request.grammar

    def abort_requests(self, request_ids: list[str]) -> None:
        """Drop requests (unknown or finished ids are ignored); their blocks are freed now."""
        child_ids = self.output_processor.abort_requests(list(request_ids))
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        if self._parked:
            self._parked = deque(r for r in self._parked if r.request_id in self.output_processor.parents)
        if self._inflight and not self.scheduler.has_unfinished_requests():
            self._apply_inflight(keep=0)  # only finished requests' extra tokens are left

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter the InputProcessor has checked (a no-op when this one is loaded);
        False when it was loaded already.  Beyond max_cpu_loras, the least recently used
        adapters without unfinished requests are unloaded to make room (one is read again
        when next named), so a step never reads an adapter's files and host memory holds
        at most max_cpu_loras adapters (a request waits for room: see _parked).
        ValueError names what is wrong: an id taken by another adapter, or the adapter
        itself (its files, rank, targets, shapes)."""
        lora_config = self.config.lora_config
        assert lora_config is not None  # InputProcessor.check_lora refuses a request when LoRA is off
        lora_id = lora_request.lora_int_id
        known = self._loras.get(lora_id)
        if known == lora_request:
            self._loras.move_to_end(lora_id)
            return False
        if known is not None:  # (removed, but still running its requests)
            raise_id_in_use(known)
        self._check_lora_id(lora_request)
        files, key = adapter_files_key(lora_request.lora_path), lora_request.cache_key
        if files is not None and self._lora_files.get(key, files) != files:  # (None: the load names what is missing)
            raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r} (id {lora_id}): its files changed "
                                      "since it was first loaded, and KV cached under this id came from the old "
                                      "weights; load the new files under a new id", param="model")
        if len(self._loras) >= lora_config.max_cpu_loras:
            # Adapters with unfinished requests stay (their steps must not read files).
            busy = self._busy_loras()
            idle = [i for i in self._loras if i not in busy]
            for victim in idle[: len(self._loras) - lora_config.max_cpu_loras + 1]:
                self._unload(victim)
        self.model_executor.add_lora(lora_request)
        self._loras[lora_id] = lora_request
        self._lora_ids.setdefault(lora_id, lora_request)
        if files is not None:  # (one entry per adapter key loaded: runtime loads are the admin's, behind the key)
            self._lora_files.setdefault(key, files)
        if len(self._loras) > lora_config.max_cpu_loras:
            # Loaded by name (not for a request) while every other adapter is busy: it
            # was checked, and it is read again when a request names it.
            self._unload(lora_id)
        return True

    def _check_lora_id(self, lora_request: LoRARequest) -> None:
        """InvalidRequestError when the adapter's id names another adapter (one loaded or
        parked for before, and not removed since)."""
        bound = self._lora_ids.get(lora_request.lora_int_id)
        if bound is not None and bound != lora_request:
            raise_id_in_use(bound)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter and free its id for another adapter (False: it was not
        loaded)."""
        self._lora_ids.pop(lora_id, None)
        return self._unload(lora_id)

    def _unload(self, lora_id: int) -> bool:
        """Unload an adapter (False: it was not loaded).  One with unfinished requests stays
        loaded until they end (their steps must not read files), first in line to go when
        another needs the room."""
        if lora_id not in self._loras:
            return False
        if lora_id in self._busy_loras():
            self._loras.move_to_end(lora_id, last=False)
            return True
        del self._loras[lora_id]
        self.model_executor.remove_lora(lora_id)
        return True

    def _has_room(self, lora_request: LoRARequest) -> bool:
        """Whether the adapter is loaded or can be without passing max_cpu_loras (an idle
        one makes room)."""
        assert self.config.lora_config is not None
        if lora_request.lora_int_id in self._loras or len(self._loras) < self.config.lora_config.max_cpu_loras:
            return True
        return bool(self._loras.keys() - self._busy_loras())

    def _admit_parked(self) -> list[EngineOutput]:
        """Parked requests join the scheduler, oldest first, while their adapters find
        room; one that cannot be admitted (its adapter's files no longer load) ends with
        "error", its message the reason."""
        failed: list[EngineCoreOutput] = []
        while self._parked and self._has_room(self._parked[0].lora_request):
            request = self._parked.popleft()
            if request.request_id not in self.output_processor.parents:  # its grammar failed meanwhile
                continue
            try:
                self._admit(request)
            except ValueError as e:
                failed += [EngineCoreOutput(cid, [], True, "error", str(e)) for cid in request.child_ids]
        return self.output_processor.process_outputs(failed, None, time.time())[0] if failed else []

    def _busy_loras(self) -> set[int]:
        """Ids of the adapters unfinished requests run with."""
        return {r.lora_request.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}

    def list_loras(self) -> list[LoRARequest]:
        return list(self._loras.values())

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[EngineOutput]:
        """One scheduling step; outputs for every request that progressed or finished.

        Synchronous: launch, wait, apply.  Overlap (async_scheduling): step N+1 is
        launched before step N's results are applied, so outputs come one step late
        (the first step returns none); once no request is left the last in-flight
        step is applied at once, leaving the engine idle with every block free."""
        outputs = self._fail_grammars() if self._compiling else []
        if self._parked:
            outputs += self._admit_parked()
        sched_out = self.scheduler.schedule()
        total = sched_out.total_num_scheduled_tokens
        if self.busiest_snapshot is not None and self.kv_cache_manager.usage > self.busiest_usage:
            self.busiest_usage = self.kv_cache_manager.usage
            self.busiest_snapshot = self.snapshot(full=True)
        if total:
            self.output_processor.mark_scheduled(sched_out.num_scheduled_tokens, time.time())
        elif not sched_out.finished_req_ids and sched_out.kv_transfers is None:  # (swap-outs must run)
            return outputs + self._apply_inflight(keep=0)
        if not self.async_scheduling:
            if sched_out.structured_output_rows:
                sched_out.grammar_bitmask = self._grammar_bitmask(sched_out)
            t0 = time.perf_counter()
            runner_out = self.model_executor.execute_model(sched_out)  # also drops finished requests' state
            self.scheduler.record_step_time(total, time.perf_counter() - t0)
            return outputs + (self._apply(sched_out, runner_out) if total else [])
        pending = self.model_executor.execute_model_async(sched_out)  # returns once launched
        if not total:
            return outputs + self._apply_inflight(keep=0)
        self._inflight.append((sched_out, pending, time.perf_counter()))
        outputs += self._apply_inflight(keep=1)
        if sched_out.structured_output_rows:
            # The launched step's grammar mask needs the tokens of the step just applied:
            # its forward already runs, its sampling waits for the mask.
            pending.sample(self._grammar_bitmask(sched_out))
        if not self.scheduler.has_unfinished_requests():
            outputs += self._apply_inflight(keep=0)
        return outputs

    def _grammar_bitmask(self, sched_out: SchedulerOutput) -> GrammarBitmask:
        requests = self.scheduler.requests
        grammars = {rid: requests[rid].grammar if rid in requests else None for rid in sched_out.structured_output_rows}
        return self.structured_output.fill_bitmask(sched_out.structured_output_rows, grammars)

    def _fail_grammars(self) -> list[EngineOutput]:
        """Requests whose grammar failed to compile after they were added end with "error"
        (the message as their stop_reason); they never held a KV block."""
        failed: list[EngineCoreOutput] = []
        for parent_id, compiled in list(self._compiling.items()):
            if not compiled.done():
                continue
            del self._compiling[parent_id]
            error = compiled.exception()
            parent = self.output_processor.parents.get(parent_id)
            if error is None or parent is None:
                continue
            child_ids = [c.request_id for c in parent.children]
            self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ERROR)
            failed += [EngineCoreOutput(cid, [], True, "error", str(error)) for cid in child_ids]
        return self.output_processor.process_outputs(failed, None, time.time())[0] if failed else []

    def _apply_inflight(self, keep: int) -> list[EngineOutput]:
        """Apply launched steps, oldest first, until `keep` are left in flight."""
        outputs: list[EngineOutput] = []
        while len(self._inflight) > keep:
            sched_out, pending, launched = self._inflight.popleft()
            runner_out = pending.get_output()
            # Its own duration for the time budget (max_step_ms): steps run one after
            # another, so it started when it was launched or its predecessor ended.
            end = time.perf_counter()
            self.scheduler.record_step_time(sched_out.total_num_scheduled_tokens,
                                            end - max(launched, self._last_step_end))
            self._last_step_end = end
            outputs += self._apply(sched_out, runner_out)
        return outputs

    def _apply(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineOutput]:
        """A step's results: tokens into the scheduler, text and stop strings out."""
        if runner_out.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(runner_out.prompt_logprobs)
        if runner_out.invalid_req_ids:
            self._name_own_constraints(runner_out.invalid_req_ids)
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids,
                                                         runner_out.invalid_req_ids, runner_out.pooler_output)
        outputs, stopped = self.output_processor.process_outputs(core_outputs, runner_out.logprobs, time.time())
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def _name_own_constraints(self, invalid: dict[str, str | None]) -> None:
        """The runner's "no token left" lists every kind of constraint; each client hears
        which of its own were in force (the usual case: a response format that can only
        end while min_tokens forbids ending, after the whole answer was computed)."""
        for req_id, reason in invalid.items():
            request = self.scheduler.requests.get(req_id)
            if reason is None or request is None:
                continue  # non-finite logits: a server error, not the request's constraints
            sp = request.sampling_params
            made = request.num_output_tokens
            own = [name for name, on in (("the grammar or response format", request.grammar is not None),
                                         ("allowed_token_ids", bool(sp.allowed_token_ids)),
                                         ("logit_bias", bool(sp.logit_bias)), ("bad_words", bool(sp.bad_words)),
                                         ("thinking_token_budget (its end tag, forced once spent)",
                                          sp.thinking_token_budget is not None),
                                         (f"min_tokens={sp.min_tokens} (which forbids ending before then)",
                                          made < sp.min_tokens)) if on]
            invalid[req_id] = f"{reason}, after {made} generated tokens" + (f"; this request's: {', '.join(own)}"
                                                                         if own else "")

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes, if any (idempotent; also runs at exit)."""
        self.structured_output.shutdown()
        self.model_executor.shutdown()

    @property
    def device(self) -> torch.device:
        """Where the model (and its KV cache) runs."""
        return self.model_executor.device

    def check_invariants(self) -> None:
        """Raise AssertionError if the KV cache's bookkeeping is broken
        (KVCacheManager.check_invariants); the server runs it when it pauses after work."""
        self.kv_cache_manager.check_invariants()

    def check_health(self) -> None:
        """Raise if the executor can run no further step (ModelExecutor.check_health)."""
        self.model_executor.check_health()

    def has_unfinished_requests(self) -> bool:
        return (self.output_processor.has_unfinished_requests() or self.scheduler.has_unfinished_requests()
                or bool(self._inflight))

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def get_num_waiting(self) -> int:
        """Sequences waiting: the scheduler's queue and the n-children parked for their
        parent's prompt.  The engine thread reads it after every step, without the rest of
        get_stats (which, with LoRA on, walks the queues for their adapters)."""
        return self.scheduler.get_request_counts()[1] + sum(len(r.child_ids) for r in self._parked)

    def get_stats(self) -> EngineStats:
        kvm, op, structured = self.kv_cache_manager, self.output_processor, self.structured_output
        spec = self.scheduler.spec_stats
        tier = self.model_executor.kv_tier
        num_running = self.scheduler.get_request_counts()[0]
        num_waiting = self.get_num_waiting()
        return EngineStats(
            num_running=num_running, num_waiting=num_waiting, kv_cache_usage=kvm.usage,
            prefix_cache_queries=kvm.prefix_cache_queries, prefix_cache_hits=kvm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions_total,
            external_prefix_cache_queries=kvm.tier_queries, external_prefix_cache_hits=kvm.tier_hits,
            kv_offload_stored_blocks=tier.num_stored if tier is not None else 0,
            kv_offload_invalid_blocks=tier.num_invalid if tier is not None else 0,
            num_prompt_tokens=op.num_prompt_tokens, num_generation_tokens=op.num_generation_tokens,
            num_structured_requests=self.scheduler.num_grammar_requests,
            grammar_compiles=structured.num_compiled, grammar_cache_hits=structured.num_cache_hits,
            grammar_compile_seconds=structured.compile_seconds,
            spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        """The adapters of running and waiting requests (LoRA on only: a walk of the queues)."""
        if self.config.lora_config is None:
            return {}
        return {"running_lora_adapters": _adapter_names(self.scheduler.running),
                "waiting_lora_adapters": _adapter_names([*self.scheduler.waiting, *self._parked]),
                "max_lora": self.config.lora_config.max_loras}

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    # ------------------------------------------------------------------ watching (the dashboard)
    def watch_blocks(self, enabled: bool) -> None:
        """Record which KV blocks change, so `snapshot(full=False)` can send only those."""
        self.scheduler.watch_blocks(enabled)

    def snapshot(self, full: bool) -> KVSnapshot:
        """The block pool and request queues now (core/snapshot.py)."""
        return self.scheduler.snapshot(full)

    def keep_busiest_snapshot(self) -> None:
        """From now on keep, in `busiest_snapshot`, a full snapshot of the step with the
        highest KV usage (`generate --show-blocks`; it costs a full snapshot whenever
        usage climbs, so it is for offline runs, not for serving)."""
        self.busiest_usage = -1.0
        self.busiest_snapshot = self.snapshot(full=True)

    def describe(self) -> dict[str, Any]:
        """The configuration people ask about first, for the dashboard."""
        mc, cache, sched = self.config.model_config, self.config.cache_config, self.config.scheduler_config
        spec = self.config.speculative_config
        return {
            "model": mc.model, "runner": mc.runner, "dtype": mc.dtype, "quantization": mc.quantization,
            "block_size": cache.block_size, "num_blocks": cache.num_blocks,
            "prefix_caching": "on" if cache.enable_prefix_caching else "off",
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_model_len": sched.max_model_len, "chunked_prefill": "on" if sched.enable_chunked_prefill else "off",
            "overlap_scheduling": "on" if self.async_scheduling else "off",
            "speculative_decoding": "off" if spec is None else (
                f"{spec.method}{f' ({spec.model})' if spec.model else ''}, k={spec.num_speculative_tokens}"),
            **self.model_executor.describe(),
        }


def resolve_async_scheduling(value: bool | None, executor: ModelExecutor, sync_only: str | None = None) -> bool:
    """None: on when the executor can launch a step without waiting for it and runs on
    CUDA (on CPU the step itself is the host's work: there is nothing to overlap), and
    nothing needs synchronous steps (`sync_only` names what does: speculative decoding,
    whose drafts need the previous step's tokens on the host, or the pooling runner)."""
    supported = executor.supports_async_scheduling
    if value is None:
        return supported and is_cuda(executor.device) and sync_only is None
    if value and sync_only is not None:
        raise ValueError(f"{sync_only} does not work with async_scheduling=True yet")
    if value and not supported:
        raise ValueError(f"async_scheduling=True needs a model executor that can launch steps asynchronously; "
                         f"{type(executor).__name__} cannot (tensor_parallel_size > 1 does not support it yet)")
    return bool(value)


def _adapter_names(requests: Iterable[Request | EngineCoreRequest]) -> tuple[str, ...]:
    """The distinct adapters of `requests` (the scheduler's, and those parked for host
    memory), by name, sorted."""
    return tuple(sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None}))


def raise_id_in_use(known: LoRARequest) -> None:
    """A request named adapter id `known.lora_int_id` for another adapter than `known`."""
    raise InvalidRequestError(f"LoRA id {known.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                              "remove it (remove_lora) before reusing the id", param="model")
