"""CpuPagedBackend: torch_paged plus a C++ decode-attention kernel (csrc/paged_decode.cpp).

Why a kernel: in a CPU decode step the attention math is tiny; what costs is moving
K/V.  The torch path gathers each request's blocks into a contiguous copy and then
multiplies (two passes over memory, plus a dozen op dispatches per layer); the kernel
reads every block where it lies, once for K and once for V, and keeps scores and
accumulators in float32 registers.  On SmolLM2 shapes (32 sequences of 150 tokens,
30 layers) the kernel itself takes about half the torch path's time, and the whole
backend step, K/V store and planning included, about three quarters
(`python -m pagedserve.benchmarks.bench_attention --backend cpu_paged` / `--backend torch_paged`).

It is compiled for this machine's CPU (`cpu_extension.py`) the first time in a process
that needs it (~25 s once per machine, then a cached load).  Without a C++
compiler, or on any build error, the backend keeps the torch path for decodes too;
the reason is logged once.  `attention_backend="torch_paged"` is the same backend
without the kernel.

Prompt tokens too: each row of a prefill chunk goes through the kernel, as a one-token
decode step would compute that token (`exact_prompt_attention`, on by default).  The
blocked paths (oneDNN's batched matmuls in 16 bits, SDPA's fused kernel in float32)
round differently from the kernel, and in bf16 that difference flipped answers: the same
chat sent twice at temperature 0 began with another token the second time (its prompt
then a prefix-cache hit, its last token recomputed as a decode row), 5 of 9 chats
differed somewhere in 96 tokens, and so did 3 of 9 under 64-token prefill chunks
(SmolLM2-135M, Zen 5, bf16).  Rows were first exact only below 2,048 positions; past
them a prefix-cache hit still changed 2 of 4 chats of ~2,660 tokens, one from its first
token.  The kernel reads a row's context once per row; it takes a prompt's rows in tiles
(of 4 when measured here, 16 now) that read each block once, and in bf16 scores them with the CPU's bf16 dot product,
so exact rows are also the faster: one prompt's TTFT against the blocked paths (Zen 5,
bf16, 2026-11-30) 221 against 253 ms at 512 tokens, 1.22 against 1.29 s at 2,048, 3.45
against 3.69 s at 4,096, 10.2 against 14.9 s at 8,000; float32 under AVX2 emulation 484
against 537 ms at 512, 8.21 against 8.64 s at 4,096; the 1.7B shape (32 KV heads of one
query each) at 2,048 tokens level with them (bf16 11.2 against 11.24 s, AVX2 emulation 27.7
against 27.8).  Not everywhere: on an Intel Xeon (float32, 26 GB/s) each tile re-reads the
context from memory; with tiles of 16 rows (4 before) the exact rows take 9.0 against the
blocked paths' 6.5 s at 4,096 tokens (12.7 with 4).  `--no-exact-prompt-attention` takes
the blocked paths.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.attention import kv_dtype
from pagedserve.attention.backend import EVERY_POSITION, DecodeKernelStep
from pagedserve.attention.torch_paged import TorchPagedBackend, TorchPagedMetadata
from pagedserve.cpu_extension import build_cpu_extension
from pagedserve.utils import record_startup

logger = logging.getLogger("pagedserve")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
HEAD_DIMS = (32, 64, 96, 128, 256)  # the head sizes the kernel is instantiated for (96: Phi-3, 256: Gemma 3)
_WARNED_HEAD_DIMS: set[int] = set()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_state: dict[str, object] = {}


def build(extra_cflags: tuple[str, ...] | None = None, source: Path = SOURCE) -> Callable[..., torch.Tensor]:
    """Compile (or load the cached build of) the kernel for this CPU (cpu_extension.py;
    `source`: benchmarks compare another version)."""
    return build_cpu_extension("pagedserve_paged_decode", source, "CPU decode-attention kernel",
                               extra_cflags).paged_decode


def paged_decode() -> Callable[..., torch.Tensor] | None:
    """The kernel `paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale, window=0, key=None,
    value=None, slot_mapping=None) -> [B, H, D]` (q [B, H, D]; block_table [B, >= blocks of
    the longest] and seq_lens [B], int32; key/value [T, Hkv, D] and slot_mapping [T] int64:
    the step's new K/V, stored first),
    built once per process; None where it cannot be built."""
    if "fn" in _state:
        return _state["fn"]  # type: ignore[return-value]
    with _lock:
        if "fn" not in _state:
            fn = None
            t0 = time.perf_counter()
            try:
                fn = build()
                record_startup("attention kernel", time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - no compiler, headers, ...: the torch path still works
                msg = str(e).strip().splitlines()
                logger.warning("CPU attention kernel unavailable, using the torch path (%s: %s); it attends prompt "
                               "rows on blocked paths, so answers can depend on chunking and batching "
                               "(exact_prompt_attention needs the kernel)", type(e).__name__, msg[-1] if msg else "")
            _state["fn"] = fn
    return _state["fn"]  # type: ignore[return-value]


class CpuPagedBackend(TorchPagedBackend):
    name = "cpu_paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        self.decode_kernel = paged_decode() if head_dim in HEAD_DIMS else None
        if head_dim not in HEAD_DIMS and head_dim not in _WARNED_HEAD_DIMS:  # (once a process, not per layer)
            _WARNED_HEAD_DIMS.add(head_dim)
            logger.warning("attention: the C++ decode kernel takes head sizes %s, this model's are %d: the torch "
                           "path attends prompt rows on blocked paths, so answers can depend on chunking, "
                           "batching and prefix-cache hits (docs/architecture.md, invariants)",
                           ", ".join(map(str, HEAD_DIMS)), head_dim)
        # (device, q dtype, cache dtype) -> the kernel or None: decided once, not in every layer's call
        self._kernels: dict[tuple[str, torch.dtype, torch.dtype], Callable[..., torch.Tensor] | None] = {}

    def forward(self, query, key, value, k_cache, v_cache, attn_metadata: TorchPagedMetadata):
        """An all-decode step (one group of one-token rows in batch order: the usual step)
        is one kernel call that also stores the new K/V; at a small model's size the
        store's own tensor operations and this class's Python per layer were a tenth of
        a decode step.  Anything else takes the general path."""
        metadata = attn_metadata
        g = metadata.groups[0]
        kernel = self._kernel_for(query, k_cache) if _whole_decode(metadata, query.shape[0]) else None
        if kernel is None:
            return super().forward(query, key, value, k_cache, v_cache, metadata)
        self._zero_fresh_blocks(metadata, k_cache, v_cache)
        if not _kernel_stores(key.dtype, k_cache.dtype):  # (fp8, int8: converted here)
            key, value = kv_dtype.to_cache(key, k_cache.dtype), kv_dtype.to_cache(value, v_cache.dtype)
        return kernel(query, k_cache, v_cache, g.block_table, g.seq_lens, self.scale, g.window,
                      key, value, metadata.slots)

    def decode_operator(self) -> str | None:
        return None if self.decode_kernel is None else f"{self.decode_kernel.__module__}::paged_decode"

    def exact_rows_context(self, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> int:
        """Every position where the kernel reads these operands (else the rows would take
        the torch decode path, all in one group padded to the longest context)."""
        kernel = self._kernel_for_dtypes(device.type, dtype, cache_dtype)
        return EVERY_POSITION if kernel is not None else 0

    def decode_kernel_step(self, num_rows: int, dtype: torch.dtype, k_cache: torch.Tensor,
                           attn_metadata: TorchPagedMetadata) -> DecodeKernelStep | None:
        """The kernel's arguments when it takes the whole step as `forward` would, and
        stores the step's key/value itself (rows of `dtype`: the cache's, or float32 over
        a 16-bit cache)."""
        if (not _kernel_stores(dtype, k_cache.dtype)
                or self._kernel_for_dtypes(k_cache.device.type, dtype, k_cache.dtype) is None
                or not _whole_decode(attn_metadata, num_rows)):
            return None
        g = attn_metadata.groups[0]
        return DecodeKernelStep(g.block_table, g.seq_lens, g.window, attn_metadata.slots, attn_metadata.fresh_blocks)

    def _kernel_for(self, query: torch.Tensor, k_cache: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The kernel reads a cache of q's dtype, of float8 or int8, or of 16 bits (the C++
        side's supported_dtypes)."""
        kernel = self._kernel_for_dtypes(query.device.type, query.dtype, k_cache.dtype)
        return kernel if query.stride(-1) == 1 else None

    def _kernel_for_dtypes(self, device: str, q: torch.dtype, cache: torch.dtype) -> Callable[..., torch.Tensor] | None:
        key = (device, q, cache)
        if key not in self._kernels:
            ok = (device == "cpu" and q in DTYPES
                  and (cache == q or cache in (*kv_dtype.FP8_DTYPES, torch.int8, torch.bfloat16, torch.float16)))
            self._kernels[key] = self.decode_kernel if ok else None
        return self._kernels[key]


def _kernel_stores(rows: torch.dtype, cache: torch.dtype) -> bool:
    """Whether the kernel stores new key/value rows of `rows` into a cache of `cache` itself:
    the same dtype, or float32 into 16 bits (converted as kv_dtype.to_cache converts)."""
    return rows == cache or (rows == torch.float32 and cache in (torch.bfloat16, torch.float16))


def _whole_decode(metadata: TorchPagedMetadata, num_rows: int) -> bool:
    """An all-decode step: one group of one-token rows in batch order, the usual step,
    which the kernel takes whole (storing the new key/value too)."""
    return metadata.identity and metadata.groups[0].q_len == 1 and num_rows == metadata.common.num_actual_tokens
