"""ModelRunner: SchedulerOutput in, one forward pass over the flattened batch, sampled
tokens out.

Per step it (1) applies the scheduler's deltas to the persistent InputBatch, (2)
builds input_ids, positions, slot_mapping, the block table and the query/sequence
offsets with a handful of numpy gathers into preallocated buffers, (3) lets the
attention backend plan the step once (`build_metadata`), shared by every layer,
(4) runs the model under `set_forward_context`, and (5) computes logits only at the
last scheduled token of requests whose known tokens are all computed after this
step (a prompt chunk mid-way gets no token), then samples them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from pagedserve.attention.backend import CommonAttentionMetadata
from pagedserve.attention.selector import get_attn_backend
from pagedserve.config import EngineConfig
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.forward_context import set_forward_context
from pagedserve.worker import kv_cache
from pagedserve.worker.input_batch import InputBatch
from pagedserve.worker.outputs import LogprobsEntry, ModelRunnerOutput
from pagedserve.worker.sampler import Sampler, SamplerOutput

logger = logging.getLogger("pagedserve")


def _first_eos(eos) -> int | None:
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) and eos >= 0 else None


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device | str | None = None,
                 eos_token_id: int | list[int] | None = None, vocab_size: int | None = None) -> None:
        self.config = config
        self.model = model
        param = next(model.parameters(), None)
        if device is None:
            device = param.device if param is not None else torch.device("cpu")
        self.device = torch.device(device)
        floats = [p.dtype for p in model.parameters() if p.is_floating_point()]
        self.dtype = floats[0] if floats else torch.get_default_dtype()
        hf_config = config.model_config.hf_config
        self.vocab_size = vocab_size or getattr(hf_config, "vocab_size", None)
        if not self.vocab_size:
            raise ValueError("the model runner needs vocab_size (from hf_config or the vocab_size argument)")
        sched, cache = config.scheduler_config, config.cache_config
        self.block_size = cache.block_size
        self.max_model_len = sched.max_model_len
        self.max_num_reqs = sched.max_num_seqs
        self.max_num_tokens = sched.max_num_batched_tokens
        self.attn_backend = get_attn_backend(config.device_config.attention_backend, self.device)
        self.attn_layers = kv_cache.get_attention_layers(model)
        if eos_token_id is None:
            eos_token_id = getattr(hf_config, "eos_token_id", None)
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.block_size, self.vocab_size,
                                      self.device, _first_eos(eos_token_id))
        gen = torch.Generator(device=self.device)
        gen.manual_seed(config.model_config.seed)
        self.sampler = Sampler(gen)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._alloc_buffers()

    @property
    def eos_token_id(self) -> int | None:
        """The EOS that min_tokens keeps from being sampled (unless ignore_eos)."""
        return self.input_batch.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | list[int] | None) -> None:
        self.input_batch.eos_token_id = _first_eos(value)

    def _alloc_buffers(self) -> None:
        """Host buffers filled in place every step; their device twins on accelerators."""
        t, r, b = self.max_num_tokens, self.max_num_reqs, self.input_batch.max_blocks_per_req
        self._arange = np.arange(max(t, r, b) + 1, dtype=np.int64)
        cpu = {
            "input_ids": torch.zeros(t, dtype=torch.int64),
            "positions": torch.zeros(t, dtype=torch.int64),
            "slot_mapping": torch.zeros(t, dtype=torch.int64),
            "query_start_loc": torch.zeros(r + 1, dtype=torch.int32),
            "seq_lens": torch.zeros(r, dtype=torch.int32),
            "block_table": torch.zeros(r, b, dtype=torch.int32),
        }
        if self.device.type == "cuda":
            cpu = {k: v.pin_memory() for k, v in cpu.items()}
        self._cpu = cpu
        self._np = {k: v.numpy() for k, v in cpu.items()}
        self._dev = cpu if self.device.type == "cpu" else {k: v.to(self.device) for k, v in cpu.items()}

    def _to_device(self, name: str, n: int | tuple[int, int]) -> torch.Tensor:
        src = self._cpu[name][:n] if isinstance(n, int) else self._cpu[name][: n[0], : n[1]]
        if self.device.type == "cpu":
            return src
        dst = self._dev[name][:n] if isinstance(n, int) else self._dev[name][: n[0], : n[1]]
        dst.copy_(src, non_blocking=True)
        return dst

    # -------------------------------------------------------------- KV cache
    def initialize_kv_cache(self) -> int:
        """Size (see kv_cache.determine_num_blocks), allocate and bind the KV cache to
        every attention layer; records and returns num_blocks (null block included)."""
        cache = self.config.cache_config
        block_bytes = kv_cache.bytes_per_block(self.attn_layers, self.block_size, self.dtype)
        reserved = 0
        if self.device.type == "cuda" and cache.num_blocks is None and cache.kv_cache_memory_bytes is None:
            reserved = self.profile_run()
        num_blocks = kv_cache.determine_num_blocks(cache, block_bytes, self.max_model_len, self.max_num_reqs,
                                                   self.device, reserved)
        self.kv_caches = kv_cache.allocate_kv_caches(self.attn_layers, num_blocks, self.block_size,
                                                     self.dtype, self.device)
        for layer, kv in zip(self.attn_layers, self.kv_caches, strict=True):
            layer.impl = self.attn_backend(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale,
                                           self.block_size)
            layer.kv_cache = kv
        cache.num_blocks = num_blocks
        kv_cache.log_kv_cache(num_blocks, self.block_size, self.max_model_len, block_bytes)
        return num_blocks

    @torch.inference_mode()
    def profile_run(self) -> int:
        """One forward at the largest step (no KV cache: attention treats it as one
        causal sequence) plus the largest logits; returns peak activation bytes on
        CUDA (0 on CPU, where it only warms up kernels)."""
        n = min(self.max_num_tokens, self.max_model_len)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        with set_forward_context(None):
            hidden = self.model(ids, pos)
            self.model.compute_logits(hidden[-min(n, self.max_num_reqs):])
        if not cuda:
            return 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del hidden
        torch.cuda.empty_cache()
        return int(peak)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must run before execute_model()")
        ib = self.input_batch
        ib.update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0 or not scheduler_output.num_scheduled_tokens:
            return ModelRunnerOutput.empty()
        req_ids = list(scheduler_output.num_scheduled_tokens)
        common, logits_idx, sample_rows = self._prepare_inputs(req_ids, scheduler_output)
        attn_metadata = self.attn_backend.build_metadata(common)
        t = common.num_actual_tokens
        with set_forward_context(attn_metadata):
            hidden = self.model(self._to_device("input_ids", t), self._to_device("positions", t))
        out = ModelRunnerOutput(req_ids=req_ids)
        if not sample_rows:
            return out
        if len(logits_idx) == t:  # every token is a sampled decode: rows already in order
            logits = self.model.compute_logits(hidden[:t])
        else:
            logits = self.model.compute_logits(hidden.index_select(0, torch.from_numpy(logits_idx).to(self.device)))
        if logits is None:  # a tensor-parallel rank > 0: its logits went to rank 0, which samples
            return out
        rows = [ib.req_id_to_row[req_ids[i]] for i in sample_rows]
        sampled = self.sampler(logits, ib.sampling_metadata(rows))
        self._collect(out, [req_ids[i] for i in sample_rows], rows, sampled)
        return out

    def _prepare_inputs(self, req_ids: list[str], so: SchedulerOutput
                        ) -> tuple[CommonAttentionMetadata, np.ndarray, list[int]]:
        ib, bs, bufs = self.input_batch, self.block_size, self._np
        b = len(req_ids)
        try:
            rows = np.fromiter((ib.req_id_to_row[r] for r in req_ids), np.int64, b)
        except KeyError as e:
            raise ValueError(f"scheduled request {e.args[0]!r} is unknown to the model runner") from None
        n = np.fromiter(so.num_scheduled_tokens.values(), np.int64, b)
        t = int(n.sum())
        if t > self.max_num_tokens or b > self.max_num_reqs:
            raise ValueError(f"step of {t} tokens / {b} requests exceeds max_num_batched_tokens="
                             f"{self.max_num_tokens} / max_num_seqs={self.max_num_reqs}")
        computed = ib.num_computed_tokens[rows]
        seq_lens = computed + n
        known = ib.num_tokens[rows]
        if (n <= 0).any() or (seq_lens > known).any() or (seq_lens > ib.num_blocks[rows] * bs).any():
            i = int(np.argmax((n <= 0) | (seq_lens > known) | (seq_lens > ib.num_blocks[rows] * bs)))
            raise ValueError(
                f"request {req_ids[i]!r}: {n[i]} tokens scheduled after {computed[i]} computed, but it has "
                f"{known[i]} tokens and {ib.num_blocks[rows][i]} blocks of {bs}")
        qsl = bufs["query_start_loc"][: b + 1]
        qsl[0] = 0
        np.cumsum(n, out=qsl[1:])
        bufs["seq_lens"][:b] = seq_lens
        req_of_tok = np.repeat(self._arange[:b], n)
        pos = bufs["positions"][:t]
        np.subtract(self._arange[:t], qsl[:-1][req_of_tok], out=pos)
        pos += computed[req_of_tok]
        row_of_tok = rows[req_of_tok]
        bufs["input_ids"][:t] = ib.token_ids[row_of_tok, pos]
        bufs["slot_mapping"][:t] = ib.block_table[row_of_tok, pos // bs].astype(np.int64) * bs + pos % bs
        nblk = int(-(-seq_lens.max() // bs))
        table = ib.block_table[rows, :nblk]
        # Entries past a request's own blocks may be stale from a row's previous owner.
        bufs["block_table"][:b, :nblk] = np.where(self._arange[:nblk][None, :] < ib.num_blocks[rows][:, None],
                                                  table, 0)
        common = CommonAttentionMetadata(
            num_reqs=b, num_actual_tokens=t,
            query_start_loc=self._to_device("query_start_loc", b + 1),
            seq_lens=self._to_device("seq_lens", b),
            block_table=self._to_device("block_table", (b, nblk)),
            slot_mapping=self._to_device("slot_mapping", t),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(n.max()), max_seq_len=int(seq_lens.max()), block_size=bs,
        )
        sample = seq_lens == known
        return common, qsl[1:][sample] - 1, np.flatnonzero(sample).tolist()

    def _collect(self, out: ModelRunnerOutput, req_ids: list[str], rows: list[int],
                 sampled: SamplerOutput) -> None:
        tokens = sampled.sampled_token_ids.tolist()
        for req_id, tok in zip(req_ids, tokens, strict=True):
            out.sampled_token_ids[req_id] = [tok]
        if sampled.sampled_logprobs is None:
            return
        lps = sampled.sampled_logprobs.tolist()
        ranks = sampled.sampled_ranks.tolist()
        top_ids = sampled.topk_token_ids.tolist() if sampled.topk_token_ids is not None else None
        top_lps = sampled.topk_logprobs.tolist() if sampled.topk_logprobs is not None else None
        params = self.input_batch.params
        for i, (req_id, row) in enumerate(zip(req_ids, rows, strict=True)):
            k = params[row].logprobs
            if k is None:
                continue
            out.logprobs[req_id] = LogprobsEntry(
                token_id=tokens[i], logprob=lps[i], rank=ranks[i],
                topk_token_ids=top_ids[i][:k] if k and top_ids else [],
                topk_logprobs=top_lps[i][:k] if k and top_lps else [],
            )
