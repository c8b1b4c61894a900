"""ModelRunner: SchedulerOutput in, one forward pass over the flattened batch, sampled
tokens out.

Per step it (1) applies the scheduler's deltas to the persistent InputBatch, (2)
builds input_ids, positions, slot_mapping, the block table and the query/sequence
offsets with a handful of numpy gathers into preallocated buffers
(worker/step_buffers.py), (3) lets the attention backend plan the step once
(`build_metadata`), shared by every layer, (4) runs the model under
`set_forward_context`, and (5) computes logits only at the last scheduled token of
requests whose known tokens are all computed after this step (a prompt chunk mid-way
gets no token), then samples them.  Prompt logprobs, pooled results and the draft
rows' logprobs come from the same hidden states (worker/step_outputs.py).

On CUDA, decode-only steps replay a captured graph instead (worker/cuda_graph.py):
the same buffers, padded to the graph's batch size.

Overlap scheduling (`execute_model_async`): the step returns once launched, its
tokens still on their way to the host (worker/async_output.py).  The next step is
scheduled before they arrive, so a request decoding in it may be one token ahead of
what the host knows: that *pending* token is gathered on the device from the
previous step's sampled ids into input_ids.  Host input buffers alternate between
two sets so that preparing step N+1 never overwrites what step N's copies still read.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch
from torch import nn

from pagedserve.attention.backend import CommonAttentionMetadata
from pagedserve.attention.kv_dtype import kv_cache_torch_dtype
from pagedserve.attention.selector import get_attn_backend
from pagedserve.config import EngineConfig
from pagedserve.core.kv_tier import KVTransfers
from pagedserve.core.sched_output import GrammarBitmask, SchedulerOutput
from pagedserve.forward_context import set_forward_context
from pagedserve.layers.pooler import Pooler
from pagedserve.layers.rotary_embedding import long_prompt_rows
from pagedserve.lora.manager import LoRAModelManager
from pagedserve.lora.request import LoRARequest
from pagedserve.models.utils import bind_decode_stacks, bind_direct_layers
from pagedserve.platforms import is_cpu, is_cuda
from pagedserve.utils import record_startup
from pagedserve.worker import kv_cache, kv_offload, step_outputs
from pagedserve.worker.async_output import AsyncModelRunnerOutput
from pagedserve.worker.compiled_model import CompiledModel, maybe_compile
from pagedserve.worker.cpu_malloc import bound_onednn_caches, keep_freed_memory_on_heap, release_freed_memory
from pagedserve.worker.cuda_graph import (
    DecodeGraphRunner,
    capture_sizes,
    graphs_unavailable_reason,
    padded_size,
)
from pagedserve.worker.input_batch import InputBatch, generator_seed
from pagedserve.worker.mm_inputs import image_inputs_for
from pagedserve.worker.rejection_sampler import verify_drafts
from pagedserve.worker.runner_output import ModelRunnerOutput
from pagedserve.worker.sampler import Sampler, SamplingMetadata, apply_grammar_bitmask
from pagedserve.worker.step_buffers import StepBuffers, StepInputs

logger = logging.getLogger("pagedserve")


def _first_eos(eos) -> int | None:
    eos = (eos[0] if eos else None) if isinstance(eos, (list, tuple)) else eos
    return eos if isinstance(eos, int) and eos >= 0 else None


class ModelRunner:
    """A ModelExecutor (executor/abstract.py) for one process and one device."""

    supports_async_scheduling = True

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device | str | None = None,
                 eos_token_id: int | list[int] | None = None, vocab_size: int | None = None) -> None:
        self.config = config
        self.model = model
        param = next(model.parameters(), None)
        if device is None:
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        if is_cpu(self.device):
            release_freed_memory()  # what loading the weights freed, before the heap starts keeping it
            keep_freed_memory_on_heap()
            bound_onednn_caches()
        floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
        self.dtype = floats[0] if floats else torch.get_default_dtype()
        # What the KV cache stores (attention/kv_dtype.py): the model's dtype, or narrower.
        self.kv_dtype = kv_cache_torch_dtype(config.cache_config.cache_dtype, self.dtype)
        hf_config = config.model_config.hf_config
        self.vocab_size = vocab_size or getattr(hf_config, "vocab_size", None)
        if not self.vocab_size:
            raise ValueError("the model runner needs vocab_size (from hf_config or the vocab_size argument)")
        sched, cache = config.scheduler_config, config.cache_config
        self.block_size = cache.block_size
        self.max_model_len = sched.max_model_len
        self.max_num_reqs = sched.max_num_seqs
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.attn_backend = get_attn_backend(config.device_config.attention_backend, self.device)
        if self.kv_dtype in self.attn_backend.unsupported_kv_dtypes:
            raise ValueError(f"kv_cache_dtype={config.cache_config.cache_dtype!r}: the {self.attn_backend.name} "
                             "attention backend cannot read it (the CPU backends read every kv_cache_dtype)")
        self.attn_layers = kv_cache.get_attention_layers(model)
        self.kv_layout = kv_cache.kv_cache_layout(self.attn_layers)
        self.num_kv_groups = len(self.kv_layout.group_windows)
        if eos_token_id is None:
            eos_token_id = getattr(hf_config, "eos_token_id", None)
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.block_size, self.vocab_size,
                                      self.device, _first_eos(eos_token_id), self.num_kv_groups)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(generator_seed(config.model_config.seed, self.device)))
        self.pooler = Pooler()  # pooling requests' partly folded prompts
        # Multi-LoRA (lora/manager.py): the adapters' slots, and each running request's slot.
        self.lora_manager = (LoRAModelManager(model, config.lora_config, model.stacked_params, self.device, self.dtype)
                             if config.lora_config is not None else None)
        self._lora_slot: dict[str, int] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.exact_rows_context = 0  # every layer's AttentionBackend.exact_rows_context (set with the KV cache)
        # The KV tier beneath the block pool (worker/kv_offload.py), made with the cache.
        self.kv_tier: kv_offload.HostKVTier | kv_offload.DiskKVTier | None = None
        self._kv_tensors: list[torch.Tensor] = []
        self.tensor_parallel_size = config.parallel_config.tensor_parallel_size
        self.graph_runner: DecodeGraphRunner | None = None
        self.compiled: CompiledModel | None = None  # set by initialize_kv_cache when compiling applies
        # Async: the last launched step's sampled ids (device) and each request's index in them.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_index: dict[str, int] = {}
        self.images = image_inputs_for(model, self.device)  # a VLM's images (worker/mm_inputs.py); None: text
        # Where each step's inputs are written, in place (and the CUDA graphs' static inputs).
        self.buffers = StepBuffers(self.device, self.max_num_batched_tokens, self.max_num_reqs,
                                   self.input_batch.max_blocks_per_req, self.num_kv_groups, long_prompt_rows(model))

    @property
    def eos_token_id(self) -> int | None:
        """The EOS that min_tokens keeps from being sampled (unless ignore_eos)."""
        return self.input_batch.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | list[int] | None) -> None:
        self.input_batch.eos_token_id = _first_eos(value)

    # -------------------------------------------------------------- KV cache
    def initialize_kv_cache(self) -> int:
        """Size (see kv_cache.determine_num_blocks), allocate and bind the KV cache to
        every attention layer, then capture the decode CUDA graphs where they apply;
        records and returns num_blocks (null block included)."""
        cache, layout = self.config.cache_config, self.kv_layout
        block_bytes = kv_cache.bytes_per_block(self.attn_layers, self.block_size, self.kv_dtype, layout)
        num_blocks, why = self.propose_num_blocks()
        t0 = time.perf_counter()
        self.kv_caches = kv_cache.allocate_kv_caches(self.attn_layers, num_blocks, self.block_size,
                                                     self.kv_dtype, self.device, layout)
        for layer, kv, group in zip(self.attn_layers, self.kv_caches, layout.layer_group, strict=True):
            layer.impl = self.attn_backend(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale,
                                           self.block_size)
            layer.kv_cache = kv
            layer.kv_cache_group = group
        cache.num_blocks = num_blocks
        cache.group_windows = layout.group_windows
        exact = self.config.device_config.exact_prompt_attention  # (else no layer offers it: 0)
        self.exact_rows_context = min((layer.impl.exact_rows_context(self.device, self.dtype, self.kv_dtype)
                                       for layer in self.attn_layers if exact), default=0)
        self._kv_tensors = kv_offload.kv_block_tensors(self.kv_caches)
        kv_cache.log_kv_cache(num_blocks, self.block_size, self.max_model_len, block_bytes, self.device, why,
                              layout, self.max_num_batched_tokens, self.kv_dtype)
        record_startup("KV cache", time.perf_counter() - t0)
        dc = self.config.device_config
        t0 = time.perf_counter()
        compile_requested = dc.torch_compile
        if self.images is not None:  # its steps take image embeddings: never compiled
            compile_requested = False
        if is_cpu(self.device):  # (with LoRA too: the adapters' products are in each projection's direct call)
            bound, layers = bind_direct_layers(self.model)
            if bind_decode_stacks(self.model):
                logger.info("decode steps: the decoder layers run as one C++ call (layers/decode_stack.py)")
            if compile_requested is None and not dc.enforce_eager and bound == layers > 0:
                logger.info("torch.compile: not by default: every decoder layer calls fused C++ kernels directly, "
                            "as fast as the compiled graph with no compile (torch_compile=True compiles anyway)")
                compile_requested = False
        self.compiled = maybe_compile(self.model, self.device, compile_requested, dc.enforce_eager,
                                      self.tensor_parallel_size, (self.buffers.dev["input_ids"], self.buffers.dev["positions"]))
        record_startup("compile", time.perf_counter() - t0)
        t0, swap = time.perf_counter(), self.config.scheduler_config.preemption_mode == "swap"  # (after compiling)
        self.kv_tier = kv_offload.make_kv_tier(cache.kv_offload_dir, cache.kv_offload_bytes, swap,
                                               kv_offload.block_nbytes(self._kv_tensors), self.kv_fingerprint())
        record_startup("KV cache", time.perf_counter() - t0)
        eager = self.config.device_config.enforce_eager
        reason = graphs_unavailable_reason(self.device, self.attn_backend, False, self.tensor_parallel_size,
                                           self.num_kv_groups)
        if reason is None and self.lora_manager is not None:
            reason = "LoRA adapters (each step's rows per adapter are not captured)"
        if reason is None and self.images is not None:
            reason = "a vision-language model (its steps take image embeddings and positions)"
        if reason is None and eager:
            # Eager decode steps take the graphs' padded shapes (and split counts) without
            # capturing: a GEMM's rounding depends on its row count, so an unpadded batch
            # would make greedy outputs differ from a run with graphs in the last bits.
            self.capture_decode_graphs(use_graphs=False)
            logger.info("CUDA graphs off: enforce_eager=True (decode steps keep the graphs' padded batch sizes, "
                        "so outputs equal a run with graphs)")
        elif reason is None:
            try:
                self.capture_decode_graphs()
            except Exception as e:  # noqa: BLE001 - a model op that cannot be captured: stay correct, eager
                self.graph_runner = None
                torch.cuda.synchronize(self.device)
                logger.warning("CUDA graph capture failed, running eagerly (%s: %s); set enforce_eager=True "
                               "to skip the attempt", type(e).__name__, e)
        else:
            logger.info("CUDA graphs off: %s", reason)
        return num_blocks

    def kv_fingerprint(self) -> str:
        """What makes a KV block's bytes valid besides its tokens (activation bits, the attention path,
        whether the model runs compiled, the CPU's instruction set too); a disk tier's files are
        read back only under the same one."""
        mc, shapes = self.config.model_config, [(tuple(t.shape[1:]), str(t.dtype)) for t in self._kv_tensors]
        weights = kv_offload.files_identity(mc.source_path or mc.model)  # new weights under its name: another model
        parts = [
            "pagedserve-kv/1", f"model={mc.model}", f"load_format={mc.load_format}", f"quantization={mc.quantization}",
            f"seed={mc.seed}" if mc.load_format == "dummy" else "", f"dtype={self.dtype}", f"kv_dtype={self.kv_dtype}",
            f"block_size={self.block_size}", f"tp={self.config.parallel_config.tensor_parallel_size}",
            f"activation_bits={mc.quant_activation_bits}", f"attention={self.attn_backend.name}",
            f"cpu={kv_offload.cpu_identity()}", f"exact_rows={self.config.device_config.exact_prompt_attention}",
            f"windows={self.kv_layout.group_windows}", f"tensors={shapes}", f"weights={weights}",
            f"compiled={self.compiled is not None}",  # (a compiled graph may round K/V differently; and its config:)
            "hf_config=" + kv_offload.checksum(repr(mc.hf_config).encode()).hex(),
        ]
        return "|".join(parts)

    def propose_num_blocks(self, host_ranks: int = 1) -> tuple[int, str]:
        """(KV blocks this process can hold, the rule that chose them): see
        kv_cache.determine_num_blocks.  On CUDA, sizing by memory first runs the profile
        forward (a collective under tensor parallelism: every rank does it together).
        `host_ranks`: processes sharing this host's memory (tensor-parallel CPU ranks),
        which split its share between them."""
        cache = self.config.cache_config
        block_bytes = kv_cache.bytes_per_block(self.attn_layers, self.block_size, self.kv_dtype, self.kv_layout)
        reserved = 0
        if is_cuda(self.device) and cache.num_blocks is None and cache.kv_cache_memory_bytes is None:
            reserved = self.profile_run()
        if host_ranks > 1 and is_cpu(self.device):
            space = cache.cpu_kv_cache_space
            cache = dataclasses.replace(cache, cpu_kv_cache_fraction=cache.cpu_kv_cache_fraction / host_ranks,
                                        cpu_kv_cache_space=None if space is None else space // host_ranks)
        return kv_cache.determine_num_blocks(cache, block_bytes, self.max_model_len, self.max_num_reqs,
                                             self.device, reserved, self.kv_layout.group_windows,
                                             self.max_num_batched_tokens)

    def capture_decode_graphs(self, use_graphs: bool = True) -> None:
        """Capture (use_graphs=False: only set up and warm up, then run the static path
        eagerly, which is how CPU tests exercise it) the decode graphs."""
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must run before capture_decode_graphs()")
        if not self.attn_backend.supports_cuda_graphs:
            raise ValueError(f"decode graphs need an attention backend that supports CUDA graphs, not "
                             f"{self.attn_backend.name!r}")
        self.graph_runner = DecodeGraphRunner(
            self.model, self.attn_backend, self.buffers.dev, capture_sizes(self.max_num_reqs, self.max_num_batched_tokens),
            self.block_size, self.max_model_len, self.attn_layers[0].num_kv_heads, use_graphs=use_graphs,
            sliding_window=self.kv_layout.group_windows[0])
        self.graph_runner.capture()

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward at the largest step, max_num_batched_tokens tokens (no KV cache:
        attention treats them as one causal sequence), then the logits and a worst-case
        sampler pass (top-k/top-p sort, logprobs) for max_num_seqs rows; returns the
        peak activation bytes on CUDA (0 on CPU, where it only warms up kernels)."""
        n = self.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device) % self.max_model_len
        cuda = is_cuda(self.device)
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        if self.images is not None and self.images.uses_mrope:
            pos = pos.unsqueeze(0).repeat(3, 1)
        with set_forward_context(None):
            hidden = self.model(ids, pos)
            r = min(n, self.max_num_reqs)
            logits = self.model.compute_logits(hidden[-r:])
        if logits is not None:  # None on tensor-parallel ranks > 0
            self.sampler(logits, self._dummy_sampling_metadata(r))
        del hidden, logits
        if not cuda:
            return 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return int(peak)

    def _dummy_sampling_metadata(self, r: int) -> SamplingMetadata:
        def full(value, dtype):
            return torch.full((r,), value, dtype=dtype, device=self.device)

        return SamplingMetadata(
            all_greedy=False, all_random=True, temperature=full(0.7, torch.float32),
            top_k=full(self.vocab_size - 1, torch.long), top_p=full(0.9, torch.float32), max_num_logprobs=20)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._execute(scheduler_output, overlap=False).get_output()

    @torch.inference_mode()
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch the step and return without waiting for it; `.get_output()` waits.
        Requests may be scheduled one token past what the host knows (async scheduling),
        provided the previous step launched here sampled that token."""
        return self._execute(scheduler_output, overlap=True)

    def _execute(self, scheduler_output: SchedulerOutput, overlap: bool) -> AsyncModelRunnerOutput:
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must run before execute_model()")
        self._apply_scheduler_output(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0 or not scheduler_output.num_scheduled_tokens:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput.empty())
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if drafts and overlap:
            raise ValueError("speculative decoding does not run under overlap (async) scheduling")
        self.input_batch.write_draft_tokens(drafts)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        self.buffers.next_set()
        step = self._prepare_inputs(req_ids, scheduler_output, overlap)
        hidden, pend_tokens = self._forward(req_ids, step, scheduler_output)
        transfers = scheduler_output.kv_transfers
        if transfers is not None and transfers.saves:
            self._copy_out(transfers.saves)  # this step computed them
        if overlap:
            self._prev_sampled, self._prev_index = None, {}
        return self._step_output(scheduler_output, req_ids, step, hidden, pend_tokens, overlap)

    def _apply_scheduler_output(self, scheduler_output: SchedulerOutput) -> None:
        """Bring the persistent state up to this step: adapters' slots, the InputBatch's
        rows, pooling requests that left, and the KV blocks moved before the step runs."""
        if self.lora_manager is not None:
            self._update_lora_slots(scheduler_output)
        self.input_batch.update_states(scheduler_output)
        if self.images is not None:
            self.images.update(scheduler_output)
        if self.pooler.num_partial:
            for req_id in scheduler_output.finished_req_ids:
                self.pooler.forget(req_id)
        if scheduler_output.kv_transfers is not None:
            self._transfer_before_step(scheduler_output.kv_transfers)

    def _forward(self, req_ids: list[str], step: StepInputs,
                 scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden states of the step's tokens, the pending tokens gathered on the device):
        a captured graph's replay, or the (compiled) model under the step's metadata."""
        t = step.num_tokens
        if self.lora_manager is not None:
            self.lora_manager.set_step((self._lora_slot.get(r, 0) for r in req_ids),
                                       np.fromiter(scheduler_output.num_scheduled_tokens.values(), np.int64,
                                                   len(req_ids)))
        pend_tokens = self._gather_pending(req_ids, step) if step.pending.any() else None
        if step.graph_size is not None:
            return self.graph_runner.run(step.graph_size), pend_tokens
        attn_metadata = [self.attn_backend.build_metadata(c) for c in step.common]
        forward = self.compiled or self.model
        dev = self.buffers.dev
        if self.images is not None:
            return self._forward_images(req_ids, step, attn_metadata), pend_tokens
        with set_forward_context(attn_metadata):
            return forward(dev["input_ids"][:t], dev["positions"][:t]), pend_tokens

    def _forward_images(self, req_ids: list[str], step: StepInputs, attn_metadata: list) -> torch.Tensor:
        """A vision-language model's step: image rows in the embeddings, M-RoPE positions,
        bidirectional image spans (worker/mm_inputs.py prepares them)."""
        t, n, bufs = step.num_tokens, step.num_reqs, self.buffers
        ids, positions = bufs.dev["input_ids"][:t], bufs.dev["positions"][:t]
        inputs = self.images.prepare(req_ids, bufs.np["seq_lens"][:n], bufs.np["query_start_loc"][:n + 1], ids,
                                     positions)
        with set_forward_context(attn_metadata, bidirectional=inputs.spans, common=step.common):
            return self.model(ids, positions if inputs.positions is None else inputs.positions,
                              inputs_embeds=inputs.inputs_embeds)

    def _step_output(self, scheduler_output: SchedulerOutput, req_ids: list[str], step: StepInputs,
                     hidden: torch.Tensor, pend_tokens: torch.Tensor | None,
                     overlap: bool) -> AsyncModelRunnerOutput:
        """What the step returns: prompt logprobs and pooled results, then (on the rank
        that samples) the draft verdicts and the sampled tokens, or a deferred sampling
        while the grammar bitmask is on its way."""
        ib, drafts = self.input_batch, scheduler_output.scheduled_spec_decode_tokens
        qsl = self.buffers.np["query_start_loc"]
        prompt_lps = (step_outputs.prompt_logprobs(self.model, ib, qsl, req_ids, hidden, self.vocab_size)
                      if ib.prompt_logprob_rows else {})
        pooled = step_outputs.pool(self.pooler, self.model, ib, qsl, req_ids, hidden) if ib.pooling_params else {}
        if not step.sample_rows:
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput(req_ids=req_ids, prompt_logprobs=prompt_lps,
                                                                  pooler_output=pooled))
        logits = self._sampled_logits(step, hidden)
        # Every rank computes the draft rows' logits too (a collective under tensor parallelism).
        spec_ids = [r for r in req_ids if r in drafts]
        draft_logits = step_outputs.draft_logits(self.model, qsl, req_ids, spec_ids, drafts, hidden) if drafts else None
        if logits is None:  # a tensor-parallel rank > 0: its logits went to rank 0, which samples
            return AsyncModelRunnerOutput.ready(ModelRunnerOutput(req_ids=req_ids))
        sample_ids = [req_ids[i] for i in step.sample_rows]
        rows = [ib.req_id_to_row[r] for r in sample_ids]
        pending = None
        if pend_tokens is not None:  # every pending request samples, in the same order
            pending = (np.flatnonzero(step.pending[step.sample_rows]).tolist(), pend_tokens)
        out = AsyncModelRunnerOutput(req_ids, sample_ids, [ib.params[row].logprobs for row in rows],
                                     prompt_logprobs=prompt_lps, pooler_output=pooled)
        if draft_logits is not None:
            metadata = ib.sampling_metadata([ib.req_id_to_row[r] for r in spec_ids for _ in drafts[r]])
            verdicts = verify_drafts(self.sampler, draft_logits, metadata, [drafts[r] for r in spec_ids])
            out.set_draft_verdicts(drafts, dict(zip(spec_ids, verdicts, strict=True)),
                                   step_outputs.draft_logprobs(ib, spec_ids, drafts, verdicts, draft_logits))
        self._sample(out, logits, rows, sample_ids, pending, overlap, scheduler_output)
        return out

    def _sampled_logits(self, step: StepInputs, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits at the last token of each request that samples (None on tensor-parallel
        ranks > 0)."""
        k, t = len(step.logits_idx), step.num_tokens
        if k == t:  # every token is a sampled decode: rows already in order
            return self.model.compute_logits(hidden[:t])
        self.buffers.np["logits_idx"][:k] = step.logits_idx
        return self.model.compute_logits(hidden.index_select(0, self.buffers.to_device("logits_idx", k)))

    def _sample(self, out: AsyncModelRunnerOutput, logits: torch.Tensor, rows: list[int], sample_ids: list[str],
                pending: tuple[list[int], torch.Tensor] | None, overlap: bool,
                scheduler_output: SchedulerOutput) -> None:
        """Sample now, or (a grammar's bitmask still to come from the engine) hand `out`
        the sampling to run once the mask is there."""
        ib = self.input_batch

        def sample(grammar: GrammarBitmask | None) -> None:
            if grammar is not None:
                apply_grammar_bitmask(logits, grammar)
            sampled = self.sampler(logits, ib.sampling_metadata(rows, pending))
            if overlap:
                self._prev_sampled = sampled.sampled_token_ids
                self._prev_index = {r: i for i, r in enumerate(sample_ids)}
            out.set_sampled(sampled)

        if scheduler_output.structured_output_rows and scheduler_output.grammar_bitmask is None:
            out.defer_sampling(torch.inference_mode()(sample))  # the engine hands the mask over later
        else:
            sample(scheduler_output.grammar_bitmask)

    def _update_lora_slots(self, sched_out: SchedulerOutput) -> None:
        """Requests leaving the batch give their adapter's slot back; new ones take theirs
        (in that order, so a slot freed this step can be reused by it)."""
        mgr = self.lora_manager
        assert mgr is not None
        for req_id in (*sched_out.finished_req_ids, *sched_out.preempted_req_ids,
                       *(new.req_id for new in sched_out.scheduled_new_reqs)):
            slot = self._lora_slot.pop(req_id, None)
            if slot is not None:
                mgr.release(slot)
        for new in sched_out.scheduled_new_reqs:
            if new.lora_request is not None:
                self._lora_slot[new.req_id] = mgr.acquire(new.lora_request)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter now (between steps), so the step that first runs it
        does not read files; ValueError names what is wrong with it."""
        if self.lora_manager is None:
            raise ValueError("LoRA adapters are not enabled (enable_lora=True, --enable-lora)")
        self.lora_manager.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove_lora(lora_id)

    def _transfer_before_step(self, transfers: KVTransfers) -> None:
        """Copy out the blocks of requests preempted this step (the step may reuse
        them), copy radix partial hits within the pool (every source read before any
        destination is written), then load the blocks admissions found in the tier."""
        if transfers.swap_outs:
            self._copy_out(transfers.swap_outs)
        if transfers.copies:
            rows, _ = kv_offload.gather_blocks(self._kv_tensors, [s for s, _ in transfers.copies])
            kv_offload.scatter_blocks(self._kv_tensors, [d for _, d in transfers.copies], rows)
        if transfers.loads:
            loads, take = transfers.loads, self.kv_tier.take
            kv_offload.scatter_blocks(self._kv_tensors, [b for b, _ in loads], [take(k) for _, k in loads])

    def _copy_out(self, pairs: list[tuple[int, int]]) -> None:
        self.kv_tier.put([k for _, k in pairs], *kv_offload.gather_blocks(self._kv_tensors, [b for b, _ in pairs]))

    def describe(self) -> dict[str, str]:
        return {"device": str(self.device), "attention_backend": self.attn_backend.name,
                "torch_compile": "on" if self.compiled is not None else "off",
                "cuda_graphs": "on" if self.graph_runner is not None else "off",
                "tensor_parallel_size": str(self.tensor_parallel_size),
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "kv_bytes_per_token": str(kv_cache.bytes_per_block(self.attn_layers, 1, self.kv_dtype, self.kv_layout))}

    def check_health(self) -> None:
        """In one process nothing else can fail between steps."""

    def shutdown(self) -> None:
        """Finish the KV tier's queued writes; the model and its caches go with the object."""
        if self.kv_tier is not None:
            self.kv_tier.close()

    def _gather_pending(self, req_ids: list[str], step: StepInputs) -> torch.Tensor:
        """Write each pending token (sampled by the previous step, still on the device)
        into its input_ids slot; returns those tokens, in request order."""
        idx = np.flatnonzero(step.pending)
        p = len(idx)
        bufs = self.buffers
        buf = bufs.np["pending"]
        buf[:p] = bufs.np["query_start_loc"][idx + 1] - 1  # a pending token is its request's last
        buf[p:2 * p] = [self._prev_index[req_ids[i]] for i in idx]
        both = bufs.to_device("pending", 2 * p)
        tokens = self._prev_sampled.index_select(0, both[p:])
        bufs.dev["input_ids"].index_copy_(0, both[:p], tokens)
        return tokens

    def _prepare_inputs(self, req_ids: list[str], sched_out: SchedulerOutput, overlap: bool = False) -> StepInputs:
        """Fill this step's host buffers (and start their copies to the device), in four
        named steps: which InputBatch rows run and how many tokens each (`_step_shape`),
        the per-token buffers (`StepBuffers.fill_tokens`), the block table
        (`StepBuffers.fill_block_table`), and the attention metadata plus the rows that
        sample.  A decode-only step that a CUDA graph covers is padded to the graph's
        batch size."""
        ib, bufs = self.input_batch, self.buffers
        rows, num_new, computed = self._step_shape(req_ids, sched_out)
        num_reqs, num_tokens = len(req_ids), int(num_new.sum())
        seq_lens = computed + num_new
        pending, total = self._step_targets(req_ids, rows, seq_lens, sched_out, overlap)
        self._check_step(req_ids, rows, num_new, computed, seq_lens, total)
        graph_size = None
        if self.graph_runner is not None and num_tokens == num_reqs:  # decode-only
            graph_size = padded_size(self.graph_runner.sizes, num_reqs)
        # Rows filled and copied: padding rows up to the graph's batch size, if one replays.
        padded_tokens, padded_reqs = graph_size or num_tokens, graph_size or num_reqs
        bufs.fill_tokens(ib, rows, num_new, computed, seq_lens, padded_reqs)
        max_blocks = bufs.fill_block_table(ib, rows, int(seq_lens.max()))
        qsl = bufs.np["query_start_loc"][: padded_reqs + 1]
        dev = {name: bufs.to_device(name, m) for name, m in (
            ("input_ids", padded_tokens), ("positions", padded_tokens), ("slot_mapping", padded_tokens),
            ("query_start_loc", padded_reqs + 1), ("seq_lens", padded_reqs), ("block_table", (num_reqs, max_blocks)))}
        common = None
        if graph_size is None:
            qsl_cpu, seq_lens_cpu = qsl.tolist(), seq_lens.tolist()
            common = [CommonAttentionMetadata(
                num_reqs=num_reqs, num_actual_tokens=num_tokens, query_start_loc=dev["query_start_loc"],
                seq_lens=dev["seq_lens"], block_table=dev["block_table"][g], slot_mapping=dev["slot_mapping"][g],
                query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu, max_query_len=int(num_new.max()),
                max_seq_len=int(seq_lens.max()), block_size=self.block_size, sliding_window=window,
                exact_rows_context=self.exact_rows_context,
            ) for g, window in enumerate(self.kv_layout.group_windows)]
        sample = seq_lens == total  # every known (and pending) token computed: the next one is sampled
        if ib.pooling_params:  # (pooling requests never sample)
            sample &= ~ib.is_pooling[rows]
        return StepInputs(num_reqs, num_tokens, common, graph_size, qsl[1: num_reqs + 1][sample] - 1,
                          np.flatnonzero(sample).tolist(), pending)

    def _step_targets(self, req_ids: list[str], rows: np.ndarray, seq_lens: np.ndarray, sched_out: SchedulerOutput,
                      overlap: bool) -> tuple[np.ndarray, np.ndarray]:
        """(which requests' last scheduled token is pending on the device, how many tokens
        each request has in all: known, pending and drafted)."""
        ib, num_reqs = self.input_batch, len(req_ids)
        known = ib.num_tokens[rows]
        pending = np.zeros(num_reqs, dtype=bool)
        if overlap and self._prev_index:
            # One token past the host's: the previous step sampled it (async scheduling).
            prev = self._prev_index
            pending = (seq_lens == known + 1) & np.fromiter((r in prev for r in req_ids), bool, num_reqs)
        total = known + pending
        if sched_out.scheduled_spec_decode_tokens:  # drafts sit in the token rows past the known tokens
            spec = sched_out.scheduled_spec_decode_tokens
            total = total + np.fromiter((len(spec.get(r, ())) for r in req_ids), np.int64, num_reqs)
        return pending, total

    def _check_step(self, req_ids: list[str], rows: np.ndarray, num_new: np.ndarray, computed: np.ndarray,
                    seq_lens: np.ndarray, total: np.ndarray) -> None:
        """Every request gets tokens, no more than it has, and no more than its blocks hold."""
        ib = self.input_batch
        bad = (num_new <= 0) | (seq_lens > total) | (seq_lens > ib.num_blocks[rows] * self.block_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"request {req_ids[i]!r}: {num_new[i]} tokens scheduled after {computed[i]} computed, but it has "
                f"{ib.num_tokens[rows][i]} tokens and {ib.num_blocks[rows][i]} blocks of {self.block_size}")

    def _step_shape(self, req_ids: list[str], sched_out: SchedulerOutput) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(InputBatch row, tokens scheduled, tokens already computed) per request, in
        step order; the step must fit the budgets the buffers were sized for."""
        ib, num_reqs = self.input_batch, len(req_ids)
        try:
            rows = np.fromiter((ib.req_id_to_row[r] for r in req_ids), np.int64, num_reqs)
        except KeyError as e:
            raise ValueError(f"scheduled request {e.args[0]!r} is unknown to the model runner") from None
        num_new = np.fromiter(sched_out.num_scheduled_tokens.values(), np.int64, num_reqs)
        num_tokens = int(num_new.sum())
        if num_tokens > self.max_num_batched_tokens or num_reqs > self.max_num_reqs:
            raise ValueError(f"step of {num_tokens} tokens / {num_reqs} requests exceeds max_num_batched_tokens="
                             f"{self.max_num_batched_tokens} / max_num_seqs={self.max_num_reqs}")
        return rows, num_new, ib.num_computed_tokens[rows]
