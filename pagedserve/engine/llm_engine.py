"""LLMEngine: tokenizer + scheduler + model runner + output processing, one step at a time.

Everything a user can get wrong is checked in `add_request`, before the request
touches the scheduler: a bad request raises ValueError and leaves every other
request exactly as it was.  `step()` then never sees bad input, so an exception
from inside the model means a bug, not a user error.

With async (overlap) scheduling a step schedules and launches step N+1 before it
waits for step N's results, which it then processes: outputs arrive one step late
(the first step returns none), and the device never waits for the host's
bookkeeping.  When no request is left, the last in-flight step is drained at once,
so the engine is idle with every block free.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pagedserve.config import MAX_SPECULATIVE_TOKENS, EngineConfig, PoolerConfig
from pagedserve.core.async_scheduler import AsyncScheduler
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.ngram_proposer import Drafter
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched_output import EngineCoreOutput, GrammarBitmask, SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.input_processor import EngineCoreRequest, InputProcessor
from pagedserve.engine.output_processor import OutputProcessor, ParentRequest, RequestOutputKind
from pagedserve.errors import InvalidRequestError
from pagedserve.executor.abstract import ModelExecutor, PendingModelOutput
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import EngineOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from pagedserve.platforms import is_cuda
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import StructuredOutputManager
from pagedserve.utils import cdiv, record_startup, startup_breakdown
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

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def start_cpu_kernel_builds() -> None:
    """Build (first run on a machine, ~20 s each) or load our three C++ CPU kernels in
    background threads, so the compiler runs while the config, tokenizer and weights
    load; whoever needs a kernel first waits for its thread (the builders hold locks).
    Not daemons: a process that is done before a build is (a short `generate`) waits for
    it at exit, so the next run finds the kernel built instead of starting again."""
    from pagedserve.attention.cpu_paged import paged_decode
    from pagedserve.layers.cpu_fused import fused_kernel_error
    from pagedserve.layers.quantization import quant_kernel_error

    if torch.cuda.is_available():
        return
    for name, target in (("attention", paged_decode), ("quantized linear", quant_kernel_error),
                         ("fused elementwise", fused_kernel_error)):
        threading.Thread(target=target, name=f"build {name} kernel").start()


def build_draft_proposer(config: EngineConfig, engine_args: EngineArgs, device: torch.device,
                         tokenizer: Any) -> Drafter:
    """Load speculative_config.model beside the target, with its own small KV cache sized
    for `disable_by_batch_size` requests of max_model_len tokens (drafting stops past that
    batch size), and check it shares the target's vocabulary."""
    from pagedserve.model_loader import get_model, load_tokenizer
    from pagedserve.worker.draft_model import DraftModelProposer
    from pagedserve.worker.model_runner import ModelRunner

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    assert config.parallel_config.tensor_parallel_size == 1  # EngineArgs refuses a draft model under TP
    sched, cache = config.scheduler_config, config.cache_config
    max_len, num_seqs = sched.max_model_len, spec.disable_by_batch_size
    num_blocks = num_seqs * cdiv(max_len + MAX_SPECULATIVE_TOKENS, cache.block_size) + 1
    try:
        draft_config = engine_args.replace(
            model=spec.model, tokenizer=None, speculative_config=None, chat_template=None, quantization="auto",
            tensor_parallel_size=1, async_scheduling=False, enable_prefix_caching=False, max_model_len=max_len,
            max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * max_len, num_gpu_blocks_override=num_blocks,
            kv_cache_memory_bytes=None, max_step_ms=None, kv_offload_dir=None, kv_offload_bytes=None,
            preemption_mode="recompute", prefix_caching_algo="hash", enable_lora=False).create_engine_config()
        draft_tokenizer = load_tokenizer(draft_config.model_config)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from None
    draft_vocab = draft_config.model_config.hf_config.vocab_size
    target_vocab = config.model_config.hf_config.vocab_size
    if draft_vocab != target_vocab or (tokenizer is not None and draft_tokenizer is not None
                                       and tokenizer.get_vocab() != draft_tokenizer.get_vocab()):
        raise ValueError(f"speculative_config.model {spec.model!r}: its vocabulary ({draft_vocab} tokens) is not the "
                         f"target's ({target_vocab} tokens, {config.model_config.model}); a draft model must share "
                         "the target's tokenizer")
    runner = ModelRunner(draft_config, get_model(draft_config.model_config, device), device)
    if runner.num_kv_groups > 1:  # the proposer keeps one block table per request
        raise ValueError(f"speculative_config.model {spec.model!r}: a draft model with sliding-window layers "
                         "(several KV-cache groups) is not supported yet")
    runner.initialize_kv_cache()
    logger.info("draft model %s: %d KV blocks for %d requests, up to %d drafts each", spec.model, num_blocks,
                num_seqs, spec.num_speculative_tokens)
    return DraftModelProposer(runner, num_blocks, num_seqs, spec.num_speculative_tokens)


class BatchProgress(Protocol):
    """What `LLMEngine.run_batch` reports to (a progress bar)."""

    def finished_one(self) -> None: ...

    def tick(self) -> None: ...


class LLMEngine:
    def __init__(self, config: EngineConfig, model_executor: ModelExecutor, tokenizer: Any = None,
                 vocab_size: int | None = None, extra_eos_token_ids: list[int] | None = None,
                 drafter: Drafter | None = None) -> None:
        """`model_executor` has allocated its KV cache (config.cache_config.num_blocks is set);
        `drafter`: the draft model's proposer when speculative_config names one."""
        self.config = config
        self.model_config = config.model_config
        self.model_executor = model_executor
        self.tokenizer = tokenizer
        self._batch_ids = itertools.count()  # request ids of run_batch
        hf_config = config.model_config.hf_config
        self.vocab_size = vocab_size or getattr(hf_config, "vocab_size", None)
        if self.vocab_size is None:
            raise ValueError("the model config has no vocab_size")
        cache, sched = config.cache_config, config.scheduler_config
        if not cache.num_blocks or cache.num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got num_blocks={cache.num_blocks}")
        self.max_model_len = sched.max_model_len
        self.kv_cache_manager = KVCacheManager(
            cache.num_blocks, cache.block_size, sched.max_model_len, cache.enable_prefix_caching,
            cache.group_windows, model_executor.kv_tier, sched.preemption_mode == "swap",
            cache.prefix_caching_algo == "radix",
            store_computed=cache.kv_offload_dir is not None or cache.kv_offload_bytes is not None)
        sync_only = ("speculative_config" if config.speculative_config is not None
                     else "runner='pooling'" if self.model_config.runner == "pooling" else None)
        sched.async_scheduling = self.async_scheduling = resolve_async_scheduling(
            sched.async_scheduling, model_executor, sync_only)
        max_loras = config.lora_config.max_loras if config.lora_config is not None else 0
        if self.async_scheduling:
            self.scheduler: Scheduler = AsyncScheduler(sched, self.kv_cache_manager, max_loras)
        else:
            self.scheduler = Scheduler(sched, self.kv_cache_manager, config.speculative_config, drafter, max_loras)
        # LoRA adapters the executor has loaded and checked, by id, least recently used first.
        self._loras: OrderedDict[int, LoRARequest] = OrderedDict()
        # Async scheduling: launched steps whose results are not applied yet, oldest first
        # (at most one stays in flight between calls to step()).
        self._inflight: deque[tuple[SchedulerOutput, PendingModelOutput]] = deque()
        self.output_processor = OutputProcessor(tokenizer)
        self.eos_token_id, self._extra_eos_ids = _eos_token_ids(tokenizer, hf_config, extra_eos_token_ids)
        stop_ids = self.stop_token_ids = [t for t in [self.eos_token_id, *self._extra_eos_ids] if t is not None]
        # Grammars for structured outputs (the grammar library loads on the first one).
        self.structured_output = StructuredOutputManager(tokenizer, self.vocab_size, stop_ids, sched.max_num_seqs,
                                                         config.structured_outputs_config.backend)
        # Requests whose grammar was still compiling when they were added: parent id -> its
        # compilation (a failure ends the request with "error" at the next step).
        self._compiling: dict[str, Future] = {}
        self.busiest_snapshot: KVSnapshot | None = None  # see keep_busiest_snapshot
        self.busiest_usage = -1.0
        # The pooling runner's scorer tokens (PoolerConfig.classifier_from_token), if any.
        self.classifier_token_ids = classifier_token_ids(tokenizer, self.model_config.pooler_config)
        self.input_processor = InputProcessor(config, tokenizer, self.vocab_size, self._extra_eos_ids,
                                              self.structured_output, self.classifier_token_ids)
        # Longer prompt text cannot fit in max_model_len tokens: refused before tokenizing.
        self.max_prompt_chars = self.input_processor.max_prompt_chars

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """Read the model config, load weights and tokenizer, size and allocate the KV cache."""
        from pagedserve.model_loader import get_model, load_tokenizer, resolve_device
        from pagedserve.worker.model_runner import ModelRunner

        if engine_args.data_parallel_size > 1:
            raise ValueError(f"one LLMEngine cannot hold {engine_args.data_parallel_size} data-parallel replicas: "
                             "LLM(..., data_parallel_size=N) and `pagedserve serve --data-parallel-size N` run them "
                             "(generate and chat run one engine)")
        t0 = time.perf_counter()
        if engine_args.device in ("auto", "cpu"):
            start_cpu_kernel_builds()  # they compile (first run) while the config, tokenizer and weights load
        config = engine_args.create_engine_config()
        mc = config.model_config
        device = resolve_device(config.device_config)
        record_startup("resolve", time.perf_counter() - t0)
        if engine_args.speculative_config is None and config.speculative_config is not None:
            logger.info("speculative decoding: %s drafts, up to %d a step while at most %d requests run (the CPU "
                        "default: exact, outputs unchanged; --speculative-config off turns it off)",
                        config.speculative_config.method, config.speculative_config.num_speculative_tokens,
                        config.speculative_config.disable_by_batch_size)
        if config.parallel_config.tensor_parallel_size > 1:
            from pagedserve.executor.multiproc_executor import validate_tensor_parallel

            validate_tensor_parallel(config, device)  # a bad split fails before anything loads
        t1 = time.perf_counter()
        tokenizer = load_tokenizer(mc)
        record_startup("tokenizer", time.perf_counter() - t1)
        eos_ids = mc.generation_config_values.get("eos_token_id")
        extra_eos = [t for t in (eos_ids if isinstance(eos_ids, list) else [eos_ids]) if isinstance(t, int)]
        eos, _ = _eos_token_ids(tokenizer, mc.hf_config, extra_eos)
        if config.parallel_config.tensor_parallel_size > 1:
            from pagedserve.executor.multiproc_executor import MultiprocExecutor

            # Starts ranks 1..N-1, loads every rank's shard and sizes the KV cache on all of them.
            runner = MultiprocExecutor(config, device, eos_token_id=eos)
        else:
            t1 = time.perf_counter()
            model = get_model(mc, device)
            record_startup("weights", time.perf_counter() - t1)
            runner = ModelRunner(config, model, device, eos_token_id=eos)
            runner.initialize_kv_cache()
        drafter = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            t1 = time.perf_counter()
            drafter = build_draft_proposer(config, engine_args, device, tokenizer)
            record_startup("draft model", time.perf_counter() - t1)
        logger.info("loaded %s (%s, %s, max_model_len %d) in %.1f s (%s)", mc.model, mc.dtype, device,
                    mc.max_model_len, time.perf_counter() - t0, startup_breakdown())
        return cls(config, runner, tokenizer, extra_eos_token_ids=extra_eos, drafter=drafter)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Check (InputProcessor) and queue one request (n > 1: n scheduler sequences).
        `params`: a SamplingParams (generate runner) or a PoolingParams (pooling runner:
        the request ends with one PoolingRequestOutput).  `lora_request`: the adapter it
        runs with (loaded now if it is new).  Raises ValueError naming the problem; on
        error nothing has changed."""
        self.add_processed_request(
            self.input_processor.process(request_id, prompt, params, arrival_time, priority, lora_request),
            output_kind)

    def add_processed_request(self, request: EngineCoreRequest,
                              output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Queue a request the InputProcessor has checked: its adapter loaded, its
        sequences in the scheduler, its parent in the output processor."""
        for rid in {request.request_id, *request.child_ids}:
            if rid in self.output_processor.parents or rid in self.scheduler.requests:
                raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        if request.lora_request is not None:
            self.add_lora(request.lora_request)
        params = request.sampling_params
        added: list[str] = []
        try:
            for cid, cparams in zip(request.child_ids, request.child_params, strict=True):
                grammar = self.structured_output.request(params.structured_outputs) if request.grammar else None
                self.scheduler.add_request(Request(cid, request.prompt_token_ids, cparams, self.eos_token_id,
                                                   request.arrival_time, request.priority, request.cache_salt,
                                                   grammar, request.pooling_params, request.lora_request))
                added.append(cid)
        except ValueError:
            self.scheduler.finish_requests(added, RequestStatus.FINISHED_ABORTED)
            raise
        parent = ParentRequest(request.request_id, request.prompt, request.prompt_token_ids, output_kind,
                               RequestMetrics(request.arrival_time), pooling=request.pooling_params is not None)
        self.output_processor.add_request(parent, request.child_ids, request.child_params)
        if request.grammar is not None and not request.grammar.done():
            self._compiling[request.request_id] = request.grammar

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter (a no-op when this one is loaded); False when it was
        loaded already.  Beyond max_cpu_loras, the least recently used adapters without
        unfinished requests are unloaded to make room (one is read again when next named),
        so a step never reads an adapter's files.  ValueError names what is wrong: LoRA
        not enabled, an id taken by another adapter, or the adapter itself (its files,
        rank, targets, shapes)."""
        self.input_processor.check_lora(lora_request)
        lora_config = self.config.lora_config
        assert lora_config is not None  # check_lora refuses a request when LoRA is off
        lora_id = lora_request.lora_int_id
        known = self._loras.get(lora_id)
        if known == lora_request:
            self._loras.move_to_end(lora_id)
            return False
        if known is not None:
            raise InvalidRequestError(f"LoRA id {lora_id} is adapter {known.lora_name!r} "
                                      f"({known.lora_path}); unload it before reusing the id", param="model")
        if len(self._loras) >= lora_config.max_cpu_loras:
            # Adapters with unfinished requests stay (their steps must not read files), so
            # a batch naming more adapters than max_cpu_loras holds them all until it ends.
            busy = self._busy_loras()
            idle = [i for i in self._loras if i not in busy]
            for victim in idle[: len(self._loras) - lora_config.max_cpu_loras + 1]:
                self.remove_lora(victim)
        self.model_executor.add_lora(lora_request)
        self._loras[lora_id] = lora_request
        return True

    def remove_lora(self, lora_id: int) -> bool:
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

    def _busy_loras(self) -> set[int]:
        """Ids of the adapters unfinished requests run with."""
        return {r.lora_request.lora_int_id for r in self.scheduler.requests.values() if r.lora_request is not None}

    def list_loras(self) -> list[LoRARequest]:
        return list(self._loras.values())

    def run_batch(self, prompts: list[Any], params: list[SamplingParams] | list[PoolingParams],
                  priority: list[int] | None = None, progress: BatchProgress | None = None,
                  lora_requests: list[LoRARequest | None] | None = None,
                  ) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """The offline batch loop (`LLM.generate`, and each data-parallel replica's share of
        one): compile every grammar first (an invalid one is a ValueError before any request
        runs), add every prompt as FINAL_ONLY (one RequestOutput per request instead of a
        cumulative copy every step), step until all are done, return them in input order."""
        for compiled in [self.structured_output.compile(sp.structured_outputs) for sp in params
                         if isinstance(sp, SamplingParams) and sp.structured_outputs is not None]:
            compiled.result()
        ids: list[str] = []
        results: dict[str, EngineOutput] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = str(next(self._batch_ids))
                self.add_request(rid, prompt, sp, priority=priority[i] if priority is not None else 0,
                                 output_kind=RequestOutputKind.FINAL_ONLY,
                                 lora_request=lora_requests[i] if lora_requests is not None else None)
                ids.append(rid)
            pending = set(ids)
            while pending:
                if not self.has_unfinished_requests():
                    raise RuntimeError(f"the engine lost {len(pending)} request(s)")
                for out in self.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if progress is not None:
                            progress.finished_one()
                if progress is not None:
                    progress.tick()
        finally:
            # A bad prompt in the middle, or Ctrl-C: leave the engine clean for the next call.
            self.abort_request(ids)
        return [results[rid] for rid in ids]

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drop requests (unknown or finished ids are ignored); their blocks are freed now."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        child_ids = self.output_processor.abort_requests(list(request_ids))
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        if self._inflight and not self.scheduler.has_unfinished_requests():
            self._apply_inflight(keep=0)  # only finished requests' extra tokens are left

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[EngineOutput]:
        """One scheduling step; outputs for every request that progressed or finished.

        Synchronous: launch, wait, apply.  Overlap (async_scheduling): step N+1 is
        launched before step N's results are applied, so outputs come one step late
        (the first step returns none); once no request is left the last in-flight
        step is applied at once, leaving the engine idle with every block free."""
        outputs = self._fail_grammars() if self._compiling else []
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
        self._inflight.append((sched_out, pending))
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
            sched_out, pending = self._inflight.popleft()
            outputs += self._apply(sched_out, pending.get_output())
        return outputs

    def _apply(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[EngineOutput]:
        """A step's results: tokens into the scheduler, text and stop strings out."""
        if runner_out.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(runner_out.prompt_logprobs)
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out.sampled_token_ids,
                                                         runner_out.invalid_req_ids, runner_out.pooler_output)
        outputs, stopped = self.output_processor.process_outputs(core_outputs, runner_out.logprobs, time.time())
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes, if any (idempotent; also runs at exit)."""
        self.structured_output.shutdown()
        self.model_executor.shutdown()

    def sampling_defaults(self) -> dict[str, Any]:
        """SamplingParams fields the model's generation config sets (--generation-config auto)."""
        return self.model_config.sampling_defaults()

    @property
    def runner(self) -> str:
        """What it serves: "generate" (text), or "pooling" (one vector or score per prompt)."""
        return self.model_config.runner

    @property
    def device(self) -> torch.device:
        """Where the model (and its KV cache) runs."""
        return self.model_executor.device

    def check_invariants(self) -> None:
        """Raise AssertionError if the KV cache's bookkeeping is broken
        (KVCacheManager.check_invariants); the server runs it when it pauses after work."""
        self.kv_cache_manager.check_invariants()

    def has_unfinished_requests(self) -> bool:
        return (self.output_processor.has_unfinished_requests() or self.scheduler.has_unfinished_requests()
                or bool(self._inflight))

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    @property
    def structured_outputs_backend(self) -> str:
        """The grammar library constraining structured outputs ("guidance" or "xgrammar")."""
        return self.structured_output.backend_name

    def get_stats(self) -> EngineStats:
        kvm, op, structured = self.kv_cache_manager, self.output_processor, self.structured_output
        spec = self.scheduler.spec_stats
        tier = self.model_executor.kv_tier
        num_running, num_waiting = self.scheduler.get_request_counts()
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
        )

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
        mc, cache, sched = self.model_config, self.config.cache_config, self.config.scheduler_config
        spec = self.config.speculative_config
        return {
            "model": mc.model, "dtype": mc.dtype, "quantization": mc.quantization,
            "block_size": cache.block_size, "num_blocks": cache.num_blocks,
            "prefix_caching": "on" if cache.enable_prefix_caching else "off",
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_model_len": sched.max_model_len, "chunked_prefill": "on" if sched.enable_chunked_prefill else "off",
            "overlap_scheduling": "on" if self.async_scheduling else "off",
            "speculative_decoding": "off" if spec is None else (
                f"{spec.method}{f' ({spec.model})' if spec.model else ''}, k={spec.num_speculative_tokens}"),
            **self.model_executor.describe(),
        }

    # ------------------------------------------------------------------ chat
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def chat_template(self) -> str | None:
        return self.input_processor.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.input_processor.apply_chat_template(messages, chat_template, add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        return self.input_processor.encode_chat(messages, chat_template, add_generation_prompt, **kwargs)


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


def classifier_token_ids(tokenizer: Any, pooler: PoolerConfig | None) -> tuple[int, int] | None:
    """The token ids of PoolerConfig.classifier_from_token (negative, positive): each must
    be one token of the vocabulary, as the scorer reads one logit per token."""
    if pooler is None or pooler.classifier_from_token is None:
        return None
    if tokenizer is None:
        raise ValueError("pooler_config.classifier_from_token needs a tokenizer; this model has none")
    ids = []
    for text in pooler.classifier_from_token:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        if len(tokens) != 1:
            raise ValueError(f"pooler_config.classifier_from_token: {text!r} is {len(tokens)} tokens for this "
                             "tokenizer; each must be exactly one")
        ids.append(int(tokens[0]))
    return ids[0], ids[1]


def _eos_token_ids(tokenizer: Any, hf_config: Any, extra: list[int] | None) -> tuple[int | None, list[int]]:
    """(primary EOS, further EOS ids).  Llama 3 style models list several EOS ids in
    their config; the extra ones act as stop token ids unless ignore_eos is set."""
    ids: list[int] = []
    for source in (getattr(tokenizer, "eos_token_id", None), getattr(hf_config, "eos_token_id", None), extra):
        for t in source if isinstance(source, (list, tuple)) else [source]:
            if isinstance(t, int) and t >= 0 and t not in ids:
                ids.append(t)
    if not ids:
        return None, []
    return ids[0], ids[1:]
