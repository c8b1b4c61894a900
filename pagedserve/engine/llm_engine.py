"""LLMEngine: one engine in this process, the offline driver: an `InputProcessor` (every
check of a request, before it touches the scheduler) in front of an `EngineCore` (the
scheduler, executor and KV-cache manager, stepped by `step()`), on the caller's thread.

`from_engine_args` builds both (config, tokenizer, weights, KV cache).  `run_batch` is
the offline batch loop `LLM.generate` runs through `InprocClient.run_batch`; the server's
`InprocClient` owns one LLMEngine on its engine thread.  A bad request raises ValueError
from `add_request` and leaves every other request exactly as it was.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from pagedserve.config import MAX_SPECULATIVE_TOKENS, EngineConfig, ModelConfig, PoolerConfig
from pagedserve.core.ngram_proposer import Drafter
from pagedserve.core.snapshot import KVSnapshot
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.engine.core import EngineCore, EngineStats
from pagedserve.engine.input_processor import EngineCoreRequest, InputProcessor
from pagedserve.executor.abstract import ModelExecutor
from pagedserve.layers.rotary_embedding import long_rope_original
from pagedserve.lora.request import LoRARequest
from pagedserve.model_loader.tokenizer_snapshot import hf_tokenizer
from pagedserve.multimodal.inputs import ImagePromptProcessor
from pagedserve.outputs import EngineOutput, PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.structured_output import StructuredOutputManager
from pagedserve.utils import cdiv, record_startup, startup_breakdown
from pagedserve.worker.cpu_threads import release_openmp_threads

logger = logging.getLogger("pagedserve.engine")


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
    batch size; a draft of a shorter context drafts within it), and check it shares the
    target's vocabulary."""
    from pagedserve.model_loader import get_model, load_tokenizer
    from pagedserve.worker.draft_model import DraftModelProposer
    from pagedserve.worker.model_runner import ModelRunner

    spec = config.speculative_config
    assert spec is not None and spec.model is not None
    assert config.parallel_config.tensor_parallel_size == 1  # EngineArgs refuses a draft model under TP
    sched, cache = config.scheduler_config, config.cache_config
    num_seqs = spec.disable_by_batch_size
    draft_args = engine_args.without_lora(
        model=spec.model, tokenizer=None, speculative_config=None, chat_template=None, quantization="auto",
        tensor_parallel_size=1, async_scheduling=False, enable_prefix_caching=False, max_model_len=None,
        max_num_seqs=num_seqs, max_num_batched_tokens=None, num_gpu_blocks_override=None, kv_cache_memory_bytes=None,
        max_step_ms=0, kv_offload_dir=None, kv_offload_bytes=None, preemption_mode="recompute",
        prefix_caching_algo="hash")
    try:
        # A draft of a shorter context drafts within it (past it, the target goes on alone).
        own_len = draft_args.create_engine_config().scheduler_config.max_model_len
        max_len = min(sched.max_model_len, own_len)
        num_blocks = num_seqs * cdiv(max_len + MAX_SPECULATIVE_TOKENS, cache.block_size) + 1
        draft_config = draft_args.replace(max_model_len=max_len, max_num_batched_tokens=num_seqs * max_len,
                                          num_gpu_blocks_override=num_blocks).create_engine_config()
        draft_tokenizer = load_tokenizer(draft_config.model_config)
    except (ValueError, FileNotFoundError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from None
    draft_vocab = draft_config.model_config.hf_config.vocab_size
    target_vocab = config.model_config.hf_config.vocab_size
    same_map = tokenizer is None or draft_tokenizer is None or tokenizer.get_vocab() == draft_tokenizer.get_vocab()
    if draft_vocab != target_vocab or not same_map:
        how = (f"its vocabulary has {draft_vocab} tokens, the target's {target_vocab}" if draft_vocab != target_vocab
               else "its tokenizer maps tokens to other ids than the target's")
        raise ValueError(f"speculative_config.model {spec.model!r}: {how} ({config.model_config.model}); a draft "
                         "model must share the target's tokenizer")
    runner = ModelRunner(draft_config, get_model(draft_config.model_config, device), device)
    if runner.num_kv_groups > 1:  # the proposer keeps one block table per request
        raise ValueError(f"speculative_config.model {spec.model!r}: a draft model with sliding-window layers "
                         "(several KV-cache groups) is not supported yet")
    runner.initialize_kv_cache()
    logger.info("draft model %s: %d KV blocks for %d requests, up to %d drafts each", spec.model, num_blocks,
                num_seqs, spec.num_speculative_tokens)
    return DraftModelProposer(runner, num_blocks, num_seqs, spec.num_speculative_tokens,
                              long_rope_original(draft_config.model_config.hf_config))


class BatchProgress(Protocol):
    """What `LLMEngine.run_batch` reports to (a progress bar)."""

    def finished_one(self) -> None: ...

    def tick(self) -> None: ...


def whole_images(model_config: ModelConfig) -> bool:
    """A vision model whose image tokens attend both ways (Gemma 3): an image's span must
    be computed in one step (SchedulerConfig.disable_chunked_mm_input)."""
    if model_config.hf_mm_config is None:
        return False
    from pagedserve.models.registry import get_model_class

    return bool(get_model_class(model_config.hf_config).bidirectional_image_attention)


def image_prompt_processor(model_config: ModelConfig, tokenizer: Any) -> ImagePromptProcessor | None:
    """A vision-language model's prompt processor (its HF image processor from the model
    directory), or None for a text model (or one without a tokenizer: images need text)."""
    if model_config.hf_mm_config is None or tokenizer is None:
        return None
    from pagedserve.model_loader.sources import resolve_source
    from pagedserve.models.registry import resolve_architecture
    from pagedserve.multimodal.registry import make_image_prompt_processor

    path = resolve_source(model_config.model, model_config.load_format).path
    return make_image_prompt_processor(resolve_architecture(model_config.hf_config), path,
                                       model_config.hf_mm_config, tokenizer)


class LLMEngine:
    def __init__(self, config: EngineConfig, model_executor: ModelExecutor, tokenizer: Any = None,
                 vocab_size: int | None = None, extra_eos_token_ids: list[int] | None = None,
                 drafter: Drafter | None = None) -> None:
        """`model_executor` has allocated its KV cache (config.cache_config.num_blocks is set);
        `drafter`: the draft model's proposer when speculative_config names one."""
        self.config = config
        self.model_config = config.model_config
        if whole_images(config.model_config):  # before the scheduler and the intake read it
            config.scheduler_config.disable_chunked_mm_input = True
        self.model_executor = model_executor
        self.tokenizer = tokenizer
        self._batch_ids = itertools.count()  # request ids of run_batch
        # One offline batch at a time: two threads stepping one scheduler and block pool
        # gave one an internal error and the other wrong text (a caller now waits its turn).
        self._batch_lock = threading.Lock()
        self._shut_down = False  # (shutdown(): a batch after it, or waiting on a grammar then, is refused)
        hf_config = config.model_config.hf_config
        self.vocab_size = vocab_size or getattr(hf_config, "vocab_size", None)
        if self.vocab_size is None:
            raise ValueError("the model config has no vocab_size")
        self.max_model_len = config.scheduler_config.max_model_len
        self.max_logprobs = config.model_config.max_logprobs
        # (generation_config.json's eos ids replace config.json's, as HF's and vLLM's generate read them)
        listed = config.model_config.generation_config_values.get("eos_token_id") is not None
        self.eos_token_id, self._extra_eos_ids = _eos_token_ids(tokenizer, None if listed else hf_config,
                                                                extra_eos_token_ids)
        stop_ids = self.stop_token_ids = [t for t in [self.eos_token_id, *self._extra_eos_ids] if t is not None]
        # Grammars for structured outputs (the grammar library loads on the first one):
        # the InputProcessor compiles them, the core's steps fill their masks.
        self.structured_output = StructuredOutputManager(tokenizer, self.vocab_size, stop_ids,
                                                         config.scheduler_config.max_num_seqs,
                                                         config.structured_outputs_config.backend)
        self.engine_core = core = EngineCore(config, model_executor, tokenizer, self.structured_output,
                                             self.eos_token_id, drafter)
        # The core's parts, named as before (the same objects, never replaced).
        self.scheduler, self.kv_cache_manager = core.scheduler, core.kv_cache_manager
        self.output_processor, self.async_scheduling = core.output_processor, core.async_scheduling
        # The pooling runner's scorer tokens (PoolerConfig.classifier_from_token), if any.
        self.classifier_token_ids = classifier_token_ids(tokenizer, self.model_config.pooler_config)
        self.input_processor = InputProcessor(config, tokenizer, self.vocab_size, self._extra_eos_ids,
                                              self.structured_output, self.classifier_token_ids,
                                              image_prompt_processor(self.model_config, tokenizer))
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
        if engine_args.device.startswith("cuda") and not torch.cuda.is_available():  # (a model constructor's assert)
            raise ValueError(f"device {engine_args.device!r}: no CUDA device is available here "
                             "(torch.cuda.is_available() is False)")
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
        extra_eos = [t for t in (eos_ids if isinstance(eos_ids, list) else [eos_ids]) if isinstance(t, int)] \
            or turn_end_token_ids(tokenizer, mc.hf_config)
        eos, _ = _eos_token_ids(tokenizer, None if eos_ids is not None else mc.hf_config, extra_eos)
        if config.parallel_config.tensor_parallel_size > 1:
            from pagedserve.executor.multiproc_executor import MultiprocExecutor

            # Starts ranks 1..N-1, loads every rank's shard and sizes the KV cache on all of them.
            runner = MultiprocExecutor(config, device, eos_token_id=eos)
        else:
            t1 = time.perf_counter()
            model = get_model(mc, device)
            record_startup("weights", time.perf_counter() - t1)
            try:
                runner = ModelRunner(config, model, device, eos_token_id=eos)
                runner.initialize_kv_cache()
            except (MemoryError, OSError) as e:  # (a traceback from numpy or mmap said nothing of which size)
                if isinstance(e, OSError) and e.errno != errno.ENOMEM:
                    raise
                raise ValueError(f"the step buffers or the KV cache do not fit in memory ({type(e).__name__}: {e}); "
                                 "lower max_num_seqs, max_num_batched_tokens, max_loras, kv_cache_memory_bytes or "
                                 "num_gpu_blocks_override") from None
        drafter = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            t1 = time.perf_counter()
            drafter = build_draft_proposer(config, engine_args, device, tokenizer)
            record_startup("draft model", time.perf_counter() - t1)
        logger.info("loaded %s (%s, %s, max_model_len %d) in %.1f s (%s)", mc.model, mc.dtype, device,
                    mc.max_model_len, time.perf_counter() - t0, startup_breakdown())
        engine = cls(config, runner, tokenizer, extra_eos_token_ids=extra_eos, drafter=drafter)
        release_openmp_threads()  # the thread that steps it may be another (worker/cpu_threads.py)
        return engine

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        output_kind: RequestOutputKind | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Check (InputProcessor) and queue one request (n > 1: n scheduler sequences).
        `params`: a SamplingParams (generate runner) or a PoolingParams (pooling runner:
        the request ends with one PoolingRequestOutput).  `output_kind`: what its outputs
        carry (None: the SamplingParams' own).  `lora_request`: the adapter it runs with
        (loaded now if it is new).  Raises ValueError naming the problem; on error
        nothing has changed."""
        request = self.input_processor.process(request_id, prompt, params, arrival_time, priority, lora_request)
        self.add_processed_request(request, request.sampling_params.output_kind if output_kind is None else output_kind)

    def add_processed_request(self, request: EngineCoreRequest,
                              output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """Queue a request the InputProcessor has checked (EngineCore.add_request)."""
        self.engine_core.add_request(request, output_kind)

    # ------------------------------------------------------------------ LoRA
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter (a no-op when this one is loaded); False when it was
        loaded already.  Beyond max_cpu_loras, the least recently used adapters without
        unfinished requests are unloaded to make room (one is read again when next named),
        so a step never reads an adapter's files.  ValueError names what is wrong: LoRA
        not enabled, an id taken by another adapter, or the adapter itself (its files,
        rank, targets, shapes)."""
        self.input_processor.check_lora(lora_request)
        return self.engine_core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter (False: it was not loaded); EngineCore.remove_lora says when."""
        return self.engine_core.remove_lora(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine_core.list_loras()

    def run_batch(self, prompts: list[Any], params: list[SamplingParams] | list[PoolingParams],
                  priority: list[int] | None = None, progress: BatchProgress | None = None,
                  lora_requests: list[LoRARequest | None] | None = None, positions: list[int] | None = None,
                  ) -> list[RequestOutput] | list[PoolingRequestOutput]:
        """The offline batch loop (`LLM.generate`, and each data-parallel replica's share of
        one): compile every grammar first (an invalid one is a ValueError before any request
        runs), add every prompt as FINAL_ONLY (one RequestOutput per request instead of a
        cumulative copy every step), step until all are done, return them in input order.
        A refused prompt is named by its position in the caller's batch (`positions`: a
        replica's share's; else its index here, where the batch has more than one).
        Calls from several threads run one after another."""
        with self._batch_lock:  # (checked under it: a batch waiting its turn through shutdown() is refused too)
            self._check_running()
            return self._run_batch(prompts, params, priority, progress, lora_requests, positions)

    def _check_running(self) -> None:
        if self._shut_down:
            raise RuntimeError("this engine was shut down (LLM.shutdown()): make a new LLM to run more")

    def _run_batch(self, prompts: list[Any], params: list[SamplingParams] | list[PoolingParams],
                   priority: list[int] | None, progress: BatchProgress | None,
                   lora_requests: list[LoRARequest | None] | None, positions: list[int] | None,
                   ) -> list[RequestOutput] | list[PoolingRequestOutput]:
        if positions is None:
            positions = list(range(len(prompts))) if len(prompts) > 1 else [-1] * len(prompts)
        compiling = [(i, self.structured_output.compile(sp.structured_outputs)) for i, sp in enumerate(params)
                     if isinstance(sp, SamplingParams) and sp.structured_outputs is not None]
        for i, compiled in compiling:
            with naming_prompt(positions[i]):
                try:
                    compiled.result()
                except concurrent.futures.CancelledError:  # (shutdown() stopped the grammar pool meanwhile)
                    self._check_running()
                    raise
        ids: list[str] = []
        results: dict[str, EngineOutput] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                rid = str(next(self._batch_ids))
                with naming_prompt(positions[i]):
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
            release_openmp_threads()  # the next batch may come from another thread (worker/cpu_threads.py)
        return [results[rid] for rid in ids]

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Drop requests (unknown or finished ids are ignored); their blocks are freed now."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.engine_core.abort_requests(list(request_ids))

    def step(self) -> list[EngineOutput]:
        """One scheduling step of the core (EngineCore.step); outputs for every request
        that progressed or finished."""
        return self.engine_core.step()

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes, if any, and the grammar pool (idempotent;
        also runs at exit); a batch after it is refused by name."""
        self._shut_down = True
        self.engine_core.shutdown()

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
        return self.engine_core.device

    def check_invariants(self) -> None:
        self.engine_core.check_invariants()

    def check_health(self) -> None:
        self.engine_core.check_health()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.get_num_unfinished_requests()

    @property
    def structured_outputs_backend(self) -> str:
        """The grammar library constraining structured outputs ("guidance" or "xgrammar")."""
        return self.structured_output.backend_name

    def get_stats(self) -> EngineStats:
        return self.engine_core.get_stats()

    def get_num_waiting(self) -> int:
        return self.engine_core.get_num_waiting()

    def reset_prefix_cache(self) -> bool:
        with self._batch_lock:  # (not under another thread's running batch)
            return self.engine_core.reset_prefix_cache()

    # ------------------------------------------------------------------ watching (the dashboard)
    def watch_blocks(self, enabled: bool) -> None:
        self.engine_core.watch_blocks(enabled)

    def snapshot(self, full: bool) -> KVSnapshot:
        return self.engine_core.snapshot(full)

    def keep_busiest_snapshot(self) -> None:
        self.engine_core.keep_busiest_snapshot()

    @property
    def busiest_snapshot(self) -> KVSnapshot | None:
        """The full snapshot of the step with the highest KV usage (keep_busiest_snapshot)."""
        return self.engine_core.busiest_snapshot

    @property
    def busiest_usage(self) -> float:
        return self.engine_core.busiest_usage

    def describe(self) -> dict[str, Any]:
        """The configuration people ask about first, for the dashboard."""
        return self.engine_core.describe()

    # ------------------------------------------------------------------ chat
    def get_tokenizer(self) -> Any:
        """transformers' tokenizer, as vLLM's LLMEngine.get_tokenizer gives it (`tokenizer`
        may be the engine's snapshot of it, which encodes and decodes only)."""
        return hf_tokenizer(self.tokenizer)

    @property
    def chat_template(self) -> str | None:
        return self.input_processor.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return self.input_processor.apply_chat_template(messages, chat_template, add_generation_prompt, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, **kwargs: Any) -> dict[str, Any]:
        return self.input_processor.encode_chat(messages, chat_template, add_generation_prompt, **kwargs)


@contextlib.contextmanager
def naming_prompt(position: int) -> Iterator[None]:
    """A refusal of one prompt of a batch names it (`prompts[3]: the prompt is empty`; -1:
    a batch of one, not named): in a batch of thousands the message alone did not say which
    to fix.  The exception keeps its type and field (`param`)."""
    try:
        yield
    except ValueError as e:
        if position >= 0 and e.args and isinstance(e.args[0], str):
            e.args = (f"prompts[{position}]: {e.args[0]}", *e.args[1:])
        raise


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


# A family's end-of-turn marker, which its own generation configs list beside the end
# token (Gemma 3's: [<eos>, <end_of_turn>]) and llama.cpp stops on; a GGUF says only the
# end token, so without a generation config a chat under its template ran past the turn.
TURN_END_TOKENS = {"gemma3": "<end_of_turn>", "gemma3_text": "<end_of_turn>"}


def turn_end_token_ids(tokenizer: Any, hf_config: Any) -> list[int]:
    """The model family's end-of-turn token (TURN_END_TOKENS), where its vocabulary has it:
    the stop ids of a model without a generation config's list."""
    marker = TURN_END_TOKENS.get(getattr(hf_config, "model_type", ""))
    if marker is None or tokenizer is None:
        return []
    token_id = tokenizer.convert_tokens_to_ids(marker)
    return [token_id] if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else []


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
