"""TritonAttentionBackend: the paged-attention backend for CUDA devices.

Per step, `build_metadata` splits the batch by query length: requests with one new
token go to the decode kernel, the rest to the extend kernel.  Why two kernels
instead of one launch over the mixed batch:
  * decode is memory-bound: every step reads each request's whole K/V once.  Its
    kernel packs the GQA group of one token into the tile rows and splits long
    contexts across programs (flash-decoding), which is what keeps the GPU full when
    a few long requests decode.  A unified kernel tiles queries BLOCK_Q tokens at a
    time, so a decode row would use 1/BLOCK_Q of its tile's rows and get no split.
  * extend is compute-bound on long prompts and wants big query tiles; it never
    needs a split because its queries already give it enough programs.
  * the price of separating them is one extra launch (a few microseconds per layer)
    and only in steps that mix both; pure-decode steps, the bulk of a run, launch
    store + decode (+ reduce when split).
These are arithmetic and roofline reasoning, not timings: this was written without
a GPU.  What was checked offline: every kernel compiles for sm_90 (triton.compile with
a GPUTarget, no device needed), and the default tiles were chosen from those builds
(ptxas -v: no register spills; cp.async pipelining engages; extend uses wgmma).
`pagedserve/benchmarks/bench_kernels.py` times each kernel against its memory floor
and against torch SDPA, and is where the tiles and split policy should be tuned.

CUDA graphs (decode batches): everything the kernels read per step is on the device
(seq_lens, block_table, slot_mapping, query_start_loc; a pure-decode batch's request
list is a view of one cached arange), and each split's token range is computed in
the kernel from seq_len.  So a captured decode step stays valid when those tensors
are refilled in place, provided the capture pins `md.num_splits` (the host-side plan
follows the longest context).  Padding rows: query length 1, seq_len 0, slot -1:
nothing is stored and their output is zeros.

Requires triton; `import pagedserve.attention.triton_backend` fails with ImportError
without it, which is what the backend selector tests for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from pagedserve.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagedserve.attention.triton_kernels import LOG2E, get_kernels, next_pow2
from pagedserve.platforms import is_cuda
from pagedserve.utils import cdiv

# Split-KV policy for decode: aim for TARGET_WAVES programs per SM and give no split
# fewer than MIN_SPLIT_TOKENS tokens (each split adds a partial write and a reduce
# read).  Starting values, to be tuned with bench_kernels --sweep.
TARGET_WAVES = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16


def plan_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many programs share one (request, kv head)'s context in the decode kernel."""
    programs = num_decodes * num_kv_heads
    if programs == 0:
        return 1
    want = cdiv(TARGET_WAVES * num_sms, programs)
    splits = max(1, min(want, max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)  # powers of two: NUM_SPLITS is a constexpr, one compile each


@functools.cache
def num_sms(device: torch.device) -> int:
    if is_cuda(device):
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: any small number keeps the policy exercised


_ARANGE: dict[torch.device, torch.Tensor] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """A view of one long-lived arange per device: no upload, and static storage for
    CUDA-graph capture of pure-decode steps."""
    buf = _ARANGE.get(device)
    if buf is None or buf.numel() < n:
        buf = _ARANGE[device] = torch.arange(max(n, 1024), dtype=torch.int32, device=device)
    return buf[:n]


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes (tokens) and launch shape.  Picked from static compilation for sm_90
    (no register spills, shared memory within an SM's budget), not from timings."""

    decode_block_n: int = 64
    decode_warps: int = 4
    decode_stages: int = 2
    extend_block_m: int = 128  # rows = query tokens x GQA group
    extend_block_n: int = 64
    extend_warps: int = 8
    extend_stages: int = 2


def default_config(dtype: torch.dtype, head_dim: int) -> KernelConfig:
    if dtype == torch.float32:  # dots in 3xTF32: wider tiles spill
        return KernelConfig(decode_block_n=32, extend_block_m=64, extend_block_n=32)
    if head_dim > 128:
        return KernelConfig(decode_block_n=32, extend_block_n=32)
    return KernelConfig()


@dataclass
class TritonAttentionMetadata:
    """What the kernels need beyond the common metadata, built once per step."""

    common: CommonAttentionMetadata
    num_decodes: int
    decode_reqs: torch.Tensor  # [num_decodes] int32: request indices with query length 1
    max_decode_seq_len: int
    extend_reqs: list[int]  # host: request indices with query length > 1
    # None: plan per layer shape with plan_num_splits.  Pin it for CUDA-graph capture
    # (the decode kernel derives each split's range from seq_len on the device).
    num_splits: int | None = None
    _tiles: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict, repr=False)
    _scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    _checked: set[int] = field(default_factory=set, repr=False)  # backends whose inputs passed _check

    def extend_tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tile -> request, tile -> first query index, count), heaviest tiles first so
        the long-context tiles start in the first wave.  Cached per block_q: all layers
        of a model share it."""
        if block_q not in self._tiles:
            c = self.common
            work: list[tuple[int, int, int]] = []
            for i in self.extend_reqs:
                n = c.query_start_loc_cpu[i + 1] - c.query_start_loc_cpu[i]
                prefix = c.seq_lens_cpu[i] - n
                work.extend((prefix + q0 + block_q, i, q0) for q0 in range(0, n, block_q))
            work.sort(reverse=True)
            both = _to_device([w[1] for w in work] + [w[2] for w in work], c.query_start_loc.device)
            self._tiles[block_q] = (both[: len(work)], both[len(work):], len(work))  # one upload
        return self._tiles[block_q]

    def split_scratch(self, num_heads: int, num_splits: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (num_heads, num_splits, head_dim)
        if key not in self._scratch:
            dev = self.common.query_start_loc.device
            self._scratch[key] = (
                torch.empty(self.num_decodes, num_heads, num_splits, head_dim, dtype=torch.float32, device=dev),
                torch.empty(self.num_decodes, num_heads, num_splits, dtype=torch.float32, device=dev),
            )
        return self._scratch[key]


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    # int8 rows carry their scale inline (attention/kv_dtype.py): the kernels here do not read them.
    unsupported_kv_dtypes = (torch.int8,)

    # None: default_config(query dtype, head_dim) on first use; set it to tune or test.
    config: KernelConfig | None = None

    @classmethod
    def build_capture_metadata(cls, common: CommonAttentionMetadata, num_kv_heads: int) -> TritonAttentionMetadata:
        """The host cannot re-plan the split-KV decode per replay: plan for the longest context."""
        metadata = cls.build_metadata(common)
        metadata.num_splits = plan_num_splits(common.num_reqs, num_kv_heads, common.max_seq_len,
                                        num_sms(common.seq_lens.device))
        return metadata

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        qsl = common.query_start_loc_cpu
        if len(qsl) != common.num_reqs + 1 or len(common.seq_lens_cpu) != common.num_reqs:
            raise ValueError(
                f"attention metadata: {common.num_reqs} requests but {len(qsl)} query_start_loc "
                f"and {len(common.seq_lens_cpu)} seq_lens entries"
            )
        decodes: list[int] = []
        extends: list[int] = []
        for i in range(common.num_reqs):
            n = qsl[i + 1] - qsl[i]
            # seq_len 0 with one token: a padding row (CUDA-graph batch), output zeros.
            if n < 0 or (n > common.seq_lens_cpu[i] and not (n == 1 and common.seq_lens_cpu[i] == 0)):
                raise ValueError(f"attention metadata: request {i} has {n} new tokens but seq_len "
                                 f"{common.seq_lens_cpu[i]}")
            if n == 1:
                decodes.append(i)
            elif n > 1:
                extends.append(i)
        dev = common.query_start_loc.device
        if len(decodes) == common.num_reqs:
            decode_reqs = _arange(common.num_reqs, dev)
        else:
            decode_reqs = _to_device(decodes, dev)
        return TritonAttentionMetadata(
            common=common,
            num_decodes=len(decodes),
            decode_reqs=decode_reqs,
            max_decode_seq_len=max((common.seq_lens_cpu[i] for i in decodes), default=0),
            extend_reqs=extends,
        )

    def forward(self, query, key, value, k_cache, v_cache, attn_metadata, output: torch.Tensor | None = None):
        """Store the new K/V, then decode and extend; writes every element of the output
        (rows past num_actual_tokens, padding, are zeroed).  `output` may be passed in
        [T, num_heads, head_dim]; otherwise a fresh tensor is returned."""
        if not get_kernels().interpreted and not is_cuda(query.device):
            raise ValueError(f"triton backend needs CUDA tensors, got {query.device}; to run the kernels in the "
                             "Triton interpreter (slow; for tests) set TRITON_INTERPRET=1 before triton is imported")
        metadata = attn_metadata
        if isinstance(metadata, CommonAttentionMetadata):
            metadata = self.build_metadata(metadata)
        elif not isinstance(metadata, TritonAttentionMetadata):
            raise ValueError(f"triton backend got metadata of type {type(metadata).__name__}; "
                             "build it with TritonAttentionBackend.build_metadata")
        if id(self) not in metadata._checked:  # once per step and backend: every layer has the same shapes
            self._check(query, key, value, k_cache, v_cache)
            metadata._checked.add(id(self))
        c = metadata.common
        num_tokens = c.num_actual_tokens
        if output is None:
            output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        elif output.shape != query.shape or output.stride(-1) != 1:
            raise ValueError(f"output must be {tuple(query.shape)} with contiguous rows, got {tuple(output.shape)}")
        if num_tokens < query.shape[0]:
            output[num_tokens:].zero_()
        if num_tokens == 0:
            return output

        self.store_kv(key, value, k_cache, v_cache, c.slot_mapping, num_tokens)
        if metadata.num_decodes:
            self.decode(query, k_cache, v_cache, metadata, output)
        if metadata.extend_reqs:
            self.extend(query, k_cache, v_cache, metadata, output)
        return output

    # The three phases are public so the kernel benchmark can time each alone; they
    # assume forward's checks have passed.

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, num_tokens: int) -> None:
        cs = k_cache.stride()
        get_kernels().store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1), cs[1], cs[2],
            NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=self.head_dim,
            BLOCK_H=next_pow2(self.num_kv_heads, 1), BLOCK_D=next_pow2(self.head_dim),
        )

    def decode(self, query, k_cache, v_cache, metadata: TritonAttentionMetadata, output) -> None:
        kern, cfg, prec, common_args = self._launch(query, k_cache, metadata, output)
        h, hkv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        splits = metadata.num_splits or plan_num_splits(metadata.num_decodes, hkv, metadata.max_decode_seq_len, num_sms(query.device))
        if splits > 1:
            part_out, part_lse = metadata.split_scratch(h, splits, dim)
        else:
            part_out, part_lse = output, output  # unused by the kernel
        group = h // hkv
        kern.decode_kernel[(metadata.num_decodes, hkv, splits)](
            query, k_cache, v_cache, output, part_out, part_lse, *common_args[:3], metadata.decode_reqs, *common_args[3:],
            NUM_HEADS=h, GROUP=group, HEAD_DIM=dim, CACHE_BLOCK=self.block_size,
            BLOCK_G=next_pow2(group), BLOCK_D=next_pow2(dim), BLOCK_N=cfg.decode_block_n, NUM_SPLITS=splits,
            UPCAST=kern.interpreted, DOT_PREC=prec, num_warps=cfg.decode_warps, num_stages=cfg.decode_stages,
        )
        if splits > 1:
            kern.decode_reduce_kernel[(metadata.num_decodes, h)](
                part_out, part_lse, output, metadata.common.query_start_loc, metadata.decode_reqs,
                output.stride(0), output.stride(1),
                NUM_HEADS=h, HEAD_DIM=dim, NUM_SPLITS=splits, BLOCK_S=next_pow2(splits, 2),
                BLOCK_D=next_pow2(dim), num_warps=4,
            )

    def extend(self, query, k_cache, v_cache, metadata: TritonAttentionMetadata, output) -> None:
        kern, cfg, prec, common_args = self._launch(query, k_cache, metadata, output)
        group = self.num_heads // self.num_kv_heads
        block_m = max(cfg.extend_block_m, next_pow2(group))
        block_q = block_m // group
        tile_req, tile_q0, num_tiles = metadata.extend_tiles(block_q)
        kern.extend_kernel[(num_tiles, self.num_kv_heads)](
            query, k_cache, v_cache, output, *common_args[:3], tile_req, tile_q0, *common_args[3:],
            GROUP=group, HEAD_DIM=self.head_dim, CACHE_BLOCK=self.block_size,
            BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=next_pow2(self.head_dim), BLOCK_N=cfg.extend_block_n,
            UPCAST=kern.interpreted, DOT_PREC=prec, num_warps=cfg.extend_warps, num_stages=cfg.extend_stages,
        )

    def _launch(self, query, k_cache, metadata: TritonAttentionMetadata, output):
        """Arguments decode and extend share: block table, seq lens, query starts, then
        the strides, the softmax scale (base 2) and the sliding window (0: none)."""
        if self.config is None:
            self.config = default_config(query.dtype, self.head_dim)
        # 3xTF32 keeps fp32 accuracy on tensor cores; other dtypes ignore the setting.
        prec = "tf32x3" if query.dtype == torch.float32 else "tf32"
        c, cs = metadata.common, k_cache.stride()
        args = (c.block_table, c.seq_lens, c.query_start_loc,
                query.stride(0), query.stride(1), output.stride(0), output.stride(1),
                c.block_table.stride(0), cs[0], cs[1], cs[2], self.scale * LOG2E, c.sliding_window or 0)
        return get_kernels(), self.config, prec, args

    def _check(self, query, key, value, k_cache, v_cache) -> None:
        h, hkv, dim = self.num_heads, self.num_kv_heads, self.head_dim
        if h % hkv:
            raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
        t = query.shape[0]
        for name, x, heads in (("query", query, h), ("key", key, hkv), ("value", value, hkv)):
            if x.dim() != 3 or x.shape[0] != t or x.shape[1] != heads or x.shape[2] != dim:
                raise ValueError(f"{name} must be [{t}, {heads}, {dim}], got {tuple(x.shape)}")
            if x.stride(-1) != 1:
                raise ValueError(f"{name} must have contiguous head_dim rows")
        expect = (k_cache.shape[0], self.block_size, hkv, dim)
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if tuple(x.shape) != expect or not x.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {expect} tensor, got {tuple(x.shape)}")
        if v_cache.dtype != k_cache.dtype or query.device != k_cache.device:
            raise ValueError("query and both caches must share a device, and the caches a dtype")
