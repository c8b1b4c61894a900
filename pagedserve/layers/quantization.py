"""Weight-only quantized weights on CPU: blocks of 32 weights sharing a scale.

Three kinds, each one of llama.cpp's own formats or a lossless rewrite of it, run by
one C++ kernel (layers/csrc/quant_linear.cpp; why our own: docs/cpu_quantization.md):
  Q4_SYM   w = d * (u - 8),  u in 0..15   GGUF Q4_0; `--quantization int4`
  Q4_ASYM  w = d * u + m,    u in 0..15   GGUF Q4_1; Q4_K (d = super-scale x sub-scale, m = -dmin x sub-min,
                                          each rounded to fp16: the one lossy step, measured in the docs)
  Q8       w = d * s,        s in -128..127  GGUF Q8_0; Q5_0 (s = its 5-bit code - 16); `--quantization
                                          int8`; every other GGUF quantized type (Q5_1, Q5_K, Q6_K, ...)
                                          dequantized and requantized
`BlockWeights` is the plain form (codes [N, K], per-block scales [N, K/32]) that
loaders produce and that tensor parallelism narrows (rows anywhere, columns at block
boundaries only); `pack` turns it into the tiled layout the kernel streams
(`PackedWeight`), and only that is kept.  A weight whose K is not a multiple of 32
(quantized from a float checkpoint) is padded with zero columns; the activations get
the same padding at run time.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from pagedserve.config import QUANT_ACTIVATION_BITS
from pagedserve.cpu_extension import CpuKernel

logger = logging.getLogger("pagedserve")

QK = 32  # weights per block (one scale each)
TILE = 16  # rows per kernel tile (one SIMD lane each)
# The activations' codes per block of 32 (ModelConfig.quant_activation_bits): 16 bits by
# default, 8 an opt-in.
DEFAULT_ACTIVATION_BITS = QUANT_ACTIVATION_BITS[0]


class QuantKind(IntEnum):
    Q4_SYM = 0
    Q4_ASYM = 1
    Q8 = 2


@dataclass
class BlockWeights:
    """A quantized [N, K] weight in plain form.  codes: uint8 (0..15) for the 4-bit kinds,
    int8 for Q8; d (and m for Q4_ASYM): float16 [N, K // 32]."""

    kind: QuantKind
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    source_type: str = ""  # the GGUF type (or "int8"/"int4") it came from, for logs

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> BlockWeights:
        """Rows anywhere; columns only at block boundaries (tensor parallelism's row split)."""
        if dim == 0:
            return BlockWeights(self.kind, self.codes.narrow(0, start, length), self.d.narrow(0, start, length),
                                None if self.m is None else self.m.narrow(0, start, length), self.source_type)
        if start % QK or length % QK:
            raise ValueError(f"a quantized weight splits only at multiples of its {QK}-weight blocks: columns "
                             f"[{start}, {start + length}) of {self.shape[1]} do not (choose a "
                             "tensor_parallel_size that divides the input features into multiples of 32, "
                             "or load with --quantization none)")
        b0, nb = start // QK, length // QK
        return BlockWeights(self.kind, self.codes.narrow(1, start, length), self.d.narrow(1, b0, nb),
                            None if self.m is None else self.m.narrow(1, b0, nb), self.source_type)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: the exact values the kernel multiplies by."""
        n, k = self.codes.shape
        d = self.d.float().repeat_interleave(QK, dim=1)
        if self.kind == QuantKind.Q8:
            return self.codes.float() * d
        if self.kind == QuantKind.Q4_SYM:
            return (self.codes.float() - 8.0) * d
        assert self.m is not None
        return self.codes.float() * d + self.m.float().repeat_interleave(QK, dim=1)


@dataclass
class PackedWeight:
    """The kernel's tiled layout of one [N, K] weight (K a multiple of 32)."""

    kind: QuantKind
    n: int
    k: int
    codes: torch.Tensor  # uint8, flat
    d: torch.Tensor  # float16 [tiles, K/32, 16]
    aux: torch.Tensor  # Q4_ASYM: float16 offsets; Q8: int16 code sums; Q4_SYM: empty

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.aux))


def pack(w: BlockWeights, kernel: ModuleType | None = None) -> PackedWeight:
    """The tiled layout quant_linear.cpp reads (its header comment describes it; the
    kernel writes the codes' part in one pass)."""
    n, k = w.shape
    if k % QK:
        raise ValueError(f"pack needs K a multiple of {QK}, got {k}")
    kb, tiles = k // QK, -(-n // TILE)
    pad = tiles * TILE - n

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t

    flat = (kernel or quant_kernel()).pack_codes(w.codes.contiguous(), int(w.kind))
    if w.kind == QuantKind.Q8:
        aux = rows(w.codes.view(torch.int8).view(n, kb, QK).sum(-1, dtype=torch.int32).to(torch.int16))
    else:
        aux = rows(w.m) if w.kind == QuantKind.Q4_ASYM else torch.empty(0, dtype=torch.float16)
    d = rows(w.d.to(torch.float16)).view(tiles, TILE, kb).transpose(1, 2).contiguous()
    if aux.numel():
        aux = aux.view(tiles, TILE, kb).transpose(1, 2).contiguous()
    return PackedWeight(w.kind, n, k, flat, d, aux)


_HUGE_PAGE = 2 << 20


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into memory that Linux backs with 2 MB pages where it can (transparent
    huge pages asked for by madvise, which is what most distributions allow by default).
    A decode step streams every weight once: on 4 KB pages that is a TLB miss and a page
    walk every 4 KB, and the hardware prefetcher stops at each page's end.  On 2 MB pages
    the 1.7B shape's Q4_0 linears took 26.4 ms a token against 31.7 on 4 KB pages (Zen 4,
    alternated in one process; docs/cpu_quantization.md).  Only whole 2 MB pages are asked
    for, so the memory used stays the tensor's size; elsewhere (small tensors, no THP)
    `t` comes back as it is."""
    nbytes = t.numel() * t.element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _HUGE_PAGE or advice is None or not t.is_contiguous():
        return t
    # private anonymous memory (a shared mapping would be shmem, which has its own THP switch)
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # keeps `buf` alive
    start = -raw.data_ptr() % _HUGE_PAGE
    try:
        buf.madvise(advice, start, nbytes // _HUGE_PAGE * _HUGE_PAGE)
    except OSError:  # THP compiled out or off: plain pages, as before
        return t
    out = raw[start: start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


# ----------------------------------------------------------------------------- quantizing float weights


def quantize(w: torch.Tensor, method: str) -> BlockWeights:
    """`--quantization int8|int4`: group-wise (32) weight-only quantization of a float [N, K]
    weight, round to nearest; K is zero-padded to a multiple of 32."""
    w = w.detach().float()
    n, k = w.shape
    if k % QK:
        w = torch.nn.functional.pad(w, (0, QK - k % QK))
    blocks = w.view(n, -1, QK)
    if method == "int8":
        amax = blocks.abs().amax(-1)
        d = (amax / 127).to(torch.float16)
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(amax))
        codes = torch.round(blocks * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        return BlockWeights(QuantKind.Q8, codes.view(n, -1), d, None, "int8")
    if method == "int4":
        # Q4_0's rule: the value of largest magnitude maps to -8, so its sign sets the scale's
        amax_idx = blocks.abs().argmax(-1, keepdim=True)
        extreme = blocks.gather(-1, amax_idx).squeeze(-1)
        d = (extreme / -8).to(torch.float16)
        inv = torch.where(d.float() != 0, 1.0 / d.float(), torch.zeros_like(extreme))
        codes = (torch.round(blocks * inv.unsqueeze(-1)) + 8).clamp(0, 15).to(torch.uint8)
        return BlockWeights(QuantKind.Q4_SYM, codes.view(n, -1), d, None, "int4")
    raise ValueError(f"unknown weight quantization {method!r}; expected 'int8' or 'int4'")


# ----------------------------------------------------------------------------- GGUF blocks


def _nibbles_q4(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes of Q4_0/Q4_1 -> [blocks, 32] codes (low nibbles are weights 0..15),
    written in place (a third of the time of concatenating two temporaries; Zen 4,
    AVX-512 with native bf16)."""
    out = np.empty((qs.shape[0], 2 * qs.shape[1]), dtype=np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, :16])
    np.right_shift(qs, 4, out=out[:, 16:])
    return out


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> BlockWeights | None:
    """A GGUF tensor's raw bytes as BlockWeights, or None for float types (F32/F16/BF16).
    `shape` is the [N, K] of the weight (GGUF lists it reversed)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import Q4_K, dequantize

    n, k = shape
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
    if type_name in ("F32", "F16", "BF16"):
        return None
    if type_name == "Q4_0":
        b = raw.reshape(n, k // QK, 18)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        codes = _nibbles_q4(b[..., 2:].reshape(-1, 16)).reshape(n, k)
        return BlockWeights(QuantKind.Q4_SYM, torch.from_numpy(codes), torch.from_numpy(d), None, type_name)
    if type_name == "Q4_1":
        b = raw.reshape(n, k // QK, 20)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        m = b[..., 2:4].copy().view(np.float16)[..., 0]
        codes = _nibbles_q4(b[..., 4:].reshape(-1, 16)).reshape(n, k)
        return BlockWeights(QuantKind.Q4_ASYM, torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m),
                            type_name)
    if type_name == "Q5_0":
        # d, 32 high bits (weight i's in bit i), then Q4_0's nibbles: w = d * (u - 16), u in
        # 0..31, so s = u - 16 fits Q8's codes and d is the file's: exact, where requantizing
        # the dequantized block lost up to 1/16 of d a weight (Gemma 3's Q4_K_M keeps 81
        # tensors so)
        b = raw.reshape(n, k // QK, 22)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # [n, blocks, 32]: weight i's bit
        codes = _nibbles_q4(b[..., 6:].reshape(-1, 16)).reshape(n, k // QK, QK)
        codes = (codes | (high << 4)).view(np.int8) - np.int8(16)
        return BlockWeights(QuantKind.Q8, torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(d), None, type_name)
    if type_name == "Q8_0":
        b = raw.reshape(n, k // QK, 34)
        d = b[..., :2].copy().view(np.float16)[..., 0]
        codes = b[..., 2:].copy().view(np.int8).reshape(n, k)
        return BlockWeights(QuantKind.Q8, torch.from_numpy(codes), torch.from_numpy(d), None, type_name)
    if type_name == "Q4_K":
        # super-blocks of 256: d, dmin (fp16), 12 bytes of 6-bit sub-scales/mins, 128 bytes of nibbles
        b = raw.reshape(n * (k // 256), 144)
        dd = b[:, :2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16].copy())
        d = (dd * sc.reshape(-1, 8).astype(np.float32)).astype(np.float16)
        m = (-dmin * mn.reshape(-1, 8).astype(np.float32)).astype(np.float16)
        qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 0x0F).reshape(n, k)
        return BlockWeights(QuantKind.Q4_ASYM, torch.from_numpy(np.ascontiguousarray(codes)),
                            torch.from_numpy(d.reshape(n, -1)), torch.from_numpy(m.reshape(n, -1)), type_name)
    if k % QK:
        return None  # cannot be re-blocked: stays float
    w = np.asarray(dequantize(raw.reshape(-1), GGMLQuantizationType[type_name]), dtype=np.float32).reshape(n, k)
    out = quantize(torch.from_numpy(w), "int8")
    out.source_type = type_name
    return out


# ----------------------------------------------------------------------------- the kernel


def quant_kernel(extra_cflags: tuple[str, ...] | None = None) -> ModuleType:
    """The compiled kernel for this machine (built once, cached; see cpu_extension.py).
    `extra_cflags` builds another variant (tests: the AVX2 and plain paths)."""
    return _KERNEL.get(extra_cflags)


def quant_kernel_error() -> str | None:
    """None when the kernel builds (or is built) here, else why not (no compiler, ...)."""
    return _KERNEL.error()


def linear_op(kernel: ModuleType, segments: int) -> Any:
    """The kernel's layer forward as a torch operator (what a compiled graph calls): for a
    weight of one segment the one that takes no lists."""
    ops = getattr(torch.ops, kernel.__name__)
    return ops.linear1 if segments == 1 else ops.linear


def _register_fake(kernel: ModuleType) -> None:
    """Output shapes for torch.compile's tracing of `linear_op(kernel, ...)`."""

    @torch.library.register_fake(f"{kernel.__name__}::linear")
    def _(x: torch.Tensor, codes: list[torch.Tensor], d: list[torch.Tensor], aux: list[torch.Tensor],
          kinds: list[int], ns: list[int], offsets: list[int], n: int, k: int, bits: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake(f"{kernel.__name__}::linear1")
    def _(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, aux: torch.Tensor, kind: int, n: int, k: int,
          bits: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)


_KERNEL = CpuKernel("pagedserve_quant_linear", Path(__file__).parent / "csrc" / "quant_linear.cpp",
                    "quantized linear kernel", "quantized kernel", on_load=_register_fake)


def quantized_matmul(x: torch.Tensor, segments: list[tuple[int, PackedWeight]], n: int,
                     kernel: ModuleType | None = None, bits: int = DEFAULT_ACTIVATION_BITS) -> torch.Tensor:
    """x [..., K] times the [n, K] weight made of `segments` (row offset, packed rows)
    transposed: float32 [..., n].  The activations are quantized once for all segments,
    to `bits` (16 or 8) per block of 32."""
    kernel = kernel or quant_kernel()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    k = segments[0][1].k
    if x2.shape[1] != k:
        x2 = torch.nn.functional.pad(x2, (0, k - x2.shape[1]))
    xq, xd, xds = kernel.quantize_activations(x2, bits)
    out = torch.empty(x2.shape[0], n, dtype=torch.float32)
    for offset, w in segments:
        kernel.qgemm(xq, xd, xds, w.codes, w.d, w.aux, int(w.kind), w.n, out, offset)
    return out.view(*lead, n)


def dequantize_rows(w: PackedWeight, ids: torch.Tensor, kernel: ModuleType | None = None) -> torch.Tensor:
    """Rows `ids` of a packed weight as float32 [len(ids), K] (embedding lookups)."""
    kernel = kernel or quant_kernel()
    return kernel.dequantize_rows(w.codes, w.d, w.aux, int(w.kind), w.k, ids.reshape(-1))


class QuantizedWeight:
    """A layer's quantized [n, k] weight: packed row segments, one per checkpoint shard
    (q, k, v of a fused qkv may even be of different GGUF types).  What the layer keeps
    instead of its float weight."""

    def __init__(self, n: int, k: int, activation_bits: int = DEFAULT_ACTIVATION_BITS) -> None:
        self.n, self.k = n, k
        self.activation_bits = activation_bits
        self.segments: list[tuple[int, PackedWeight]] = []
        self.source_types: set[str] = set()
        self._args: tuple | None = None  # the kernel's arguments, built on first use
        self._op: Any = None  # the kernel as a torch operator (what a compiled graph calls)
        self._call: Any = None  # the same, through the kernel's Python binding

    def store(self, offset: int, w: BlockWeights) -> None:
        rows, cols = w.shape
        if cols != -(-self.k // QK) * QK or offset < 0 or offset + rows > self.n:
            raise ValueError(f"quantized rows [{offset}, {offset + rows}) x {cols} do not fit a [{self.n}, {self.k}] "
                             "weight")
        self.segments = sorted([s for s in self.segments if s[0] != offset] + [(offset, pack(w))],
                               key=lambda s: s[0])
        self.source_types.add(w.source_type)
        self._args = None
        if self.complete():
            self.merge()

    def complete(self) -> bool:
        return sum(w.n for _, w in self.segments) == self.n

    def merge(self) -> None:
        """Once every shard is in: adjacent segments of one kind whose rows fill whole tiles
        become one (the tiled layout concatenates), so a fused q|k|v is one kernel call."""
        merged: list[tuple[int, PackedWeight]] = []
        for offset, w in self.segments:
            if merged:
                o, m = merged[-1]
                if m.kind == w.kind and m.n % TILE == 0 and o + m.n == offset:
                    merged[-1] = (o, PackedWeight(m.kind, m.n + w.n, m.k, torch.cat([m.codes, w.codes]),
                                                  torch.cat([m.d, w.d]), torch.cat([m.aux, w.aux])))
                    continue
            merged.append((offset, w))
        self.segments = [(o, PackedWeight(w.kind, w.n, w.k, on_huge_pages(w.codes), on_huge_pages(w.d),
                                         on_huge_pages(w.aux)))
                         for o, w in merged]

    def kernel_args(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[int], list[int],
                                   list[int], int, int, int]:
        """The kernel's `linear` arguments after x: (codes, d, aux, kinds, ns, offsets per
        segment, N, K, activation bits); `linear1` takes the one segment's without lists."""
        segs = [w for _, w in self.segments]
        return ([w.codes for w in segs], [w.d for w in segs], [w.aux for w in segs], [int(w.kind) for w in segs],
                [w.n for w in segs], [o for o, _ in self.segments], self.n, segs[0].k, self.activation_bits)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> float32 [..., n]."""
        return quantized_matmul(x, self.segments, self.n, bits=self.activation_bits)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., k] -> [..., n] in x's dtype: the layer's forward, one call into the kernel
        (a decode step makes ~100 of these, so Python work per call shows)."""
        args = self._args
        if args is None:
            full = self.kernel_args()
            codes, d, aux, kinds, _, _, n, k, bits = full
            # one segment: the operator that takes no lists
            args = self._args = (codes[0], d[0], aux[0], kinds[0], n, k, bits) if len(codes) == 1 else full
            kernel = quant_kernel()
            self._op = linear_op(kernel, len(codes))
            self._call = kernel.linear1 if len(codes) == 1 else kernel.linear
        # Eagerly the kernel's own binding: the torch operator's dispatch costs ~5 us a
        # call (Zen 4, AVX-512 with native bf16), as much as a small decode step's matmul.
        call = self._op if torch.compiler.is_compiling() else self._call
        if x.dim() == 2:  # the model's rows: no reshaping
            return call(x, *args)
        lead = x.shape[:-1]
        return call(x.reshape(-1, x.shape[-1]), *args).view(*lead, self.n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 [len(ids), k] (a single-segment weight: embeddings)."""
        return dequantize_rows(self.segments[0][1], ids)[:, : self.k]

    def row_dots(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """float32 [n, j]: row ids[i, j] (of a single-segment weight) dotted with x[i]
        [n, k], in float32, each in column order (the LM head's exact top logits)."""
        w = self.segments[0][1]
        return quant_kernel().row_dots(w.codes, w.d, w.aux, int(w.kind), w.k, ids.contiguous(), x.float().contiguous())

    def nbytes(self) -> int:
        return sum(w.nbytes() for _, w in self.segments)


def as_block_weights(tensor: torch.Tensor | BlockWeights, method: str) -> BlockWeights:
    """What a quantized layer stores for a checkpoint tensor: GGUF blocks as they come;
    float tensors quantized by `method` ("int8"/"int4"; "gguf" layers take float shards
    as int8, the finer of the two)."""
    if isinstance(tensor, BlockWeights):
        return tensor
    return quantize(tensor, "int8" if method == "gguf" else method)


@runtime_checkable
class QuantizableLayer(Protocol):
    """A layer that can keep its weight quantized (linears, embeddings, the LM head)."""

    weight: nn.Parameter
    qweight: QuantizedWeight | None

    def enable_quantization(self, method: str, weight: torch.Tensor | None = None,
                            activation_bits: int = DEFAULT_ACTIVATION_BITS) -> None:
        """From now on keep the weight quantized by `method`; `weight`: quantize these
        values now (random weights), else the checkpoint's arrive through the loader;
        `activation_bits`: what the kernel rounds the activations to."""

    def set_prepack(self, enabled: bool) -> None:
        """Whether a float weight keeps a oneDNN-packed second copy (PackedLinear)."""
