"""The quantized linear kernel against dequantize-then-matmul, for every kind, every
build (AVX-512 VNNI where the CPU has it, AVX2, plain loops) and odd shapes; GGUF block
decoding against the gguf package's own dequantization; the layers that keep weights
quantized."""

from __future__ import annotations

import mmap
import shutil

import numpy as np
import pytest
import torch

from pagedserve.cpu_info import cpu_flags
from pagedserve.layers.quantization import (
    QK,
    BlockWeights,
    QuantizedWeight,
    QuantKind,
    dequantize_rows,
    from_gguf,
    on_huge_pages,
    pack,
    quant_kernel,
    quantize,
    quantized_matmul,
)
from tests.attention.test_cpu_paged import PLAIN_TEST_BUILD
from tests.cpu_builds import AVX2_TEST_BUILD, avx2_param

pytestmark = pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                                reason="no C++ compiler on this machine")

# (M activation rows, N weight rows, K): N not a multiple of the 16-row tile, K not a
# multiple of the 64 bytes a vector reads, K not even a multiple of the 32-weight block
# (quantize pads it), a single row, more rows than one pass of the kernel keeps (64), and
# enough rows for AVX2's widened path over more blocks (18) than it widens at a time (16),
# and enough tiles (9) for AVX-512's two-tile path when two threads share them.
SHAPES = [(1, 37, 96), (3, 16, 32), (7, 50, 200), (65, 33, 64), (2, 300, 1024), (20, 24, 576), (12, 136, 160)]


def blocks_of(kind: QuantKind, n: int, k: int, seed: int) -> BlockWeights:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if kind == QuantKind.Q8:
        return quantize(w, "int8")
    b = quantize(w, "int4")
    if kind == QuantKind.Q4_ASYM:
        m = (torch.randn(b.d.shape, generator=g) * 0.2).half()
        b = BlockWeights(QuantKind.Q4_ASYM, b.codes, b.d, m)
    return b


def activations(x: torch.Tensor, bits: int, kernel=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's quantized activations with the codes in logical order (16-bit codes
    are stored in pair order: x0 x2 x1 x3 within every 4)."""
    xq, xd, xds = (kernel or quant_kernel()).quantize_activations(x, bits)
    if bits == 16:
        xq = xq.view(x.shape[0], -1, 4)[:, :, [0, 2, 1, 3]].reshape(x.shape)
    return xq, xd, xds


def reference(x: torch.Tensor, w: BlockWeights, kernel=None, bits: int = 16) -> torch.Tensor:
    """The kernel's own arithmetic in float64: its activations (checked on their own below:
    round to nearest per block of 32, scale amax / 32767 or / 127) times the dequantized weight."""
    k = w.shape[1]
    xq, xd, _ = activations(torch.nn.functional.pad(x.float(), (0, k - x.shape[1])), bits, kernel)
    xr = (xq.double().view(x.shape[0], -1, QK) * xd.double().unsqueeze(-1)).view(x.shape[0], k)
    return xr @ w.dequantize().double().T


@pytest.mark.parametrize("bits", [16, 8])
def test_activations_round_to_nearest_per_block(bits: int) -> None:
    x = torch.randn(9, 96) * torch.tensor([0.0, 1.0, 1000.0]).repeat_interleave(32)  # a zero block too
    x[:, 40] = torch.arange(9) - 4.0  # so the pair order is seen: one known column
    xq, xd, xds = activations(x.bfloat16(), bits)
    qmax = 2 ** (bits - 1) - 1
    blocks = x.bfloat16().float().view(9, 3, QK)
    amax = blocks.abs().amax(-1)
    assert xq.dtype == (torch.int16 if bits == 16 else torch.int8)
    assert torch.allclose(xd, amax / qmax, rtol=1e-6)
    err = (xq.float().view(9, 3, QK) * xd.unsqueeze(-1) - blocks).abs()
    assert (err <= xd.unsqueeze(-1) * (0.5 + 1e-5)).all()
    assert torch.allclose(xds, xd * xq.float().view(9, 3, QK).sum(-1), rtol=1e-6)
    assert (xq.view(9, 3, QK)[:, 0] == 0).all() and (xd[:, 0] == 0).all()
    assert torch.allclose(xq[:, 40].float() * xd[:, 1], x[:, 40], atol=0.51 * xd[:, 1].max().item())


BUILDS = {"native": None, "avx2": AVX2_TEST_BUILD, "plain": PLAIN_TEST_BUILD}
BUILD_PARAMS = ["native", avx2_param("avx2"), "plain"]


@pytest.mark.parametrize("build", BUILD_PARAMS)
def test_16_bit_codes_are_the_float32_arithmetic_exactly(build: str) -> None:
    """Every build's 16-bit codes (the vector paths and the plain loop) are exactly
    round-half-even(x * (32767 / amax)) in float32, from float32, bf16 and fp16 input;
    the scales and scale * code sums likewise (ties, zero blocks and every magnitude)."""
    if build == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    kernel = quant_kernel(BUILDS[build])
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, 256, generator=g) * torch.logspace(-4, 4, 8).repeat_interleave(32)  # fp16's range
    x[3, 32:64] = 0.0  # a zero block
    x[6, :32] = torch.tensor([0.5, -0.5, 1.5, -2.5] * 8)  # exact ties in float32: amax 32767 scales by 1
    x[6, 0] = 32767.0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xt = x.to(dtype)
        xq, xd, xds = activations(xt, 16, kernel)
        blocks = xt.float().view(37, -1, QK)
        amax = blocks.abs().amax(-1)
        inv = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.tensor(0.0))
        want = torch.round(blocks * inv.unsqueeze(-1)).to(torch.int16)
        assert torch.equal(xq.view(37, -1, QK), want), dtype
        assert torch.equal(xd, amax / 32767.0), dtype
        assert torch.equal(xds, xd * want.sum(-1).float()), dtype
        if dtype == torch.float32:  # halves to even: 0.5 -> 0, -0.5 -> 0, 1.5 -> 2, -2.5 -> -2
            assert xq[6, 1:4].tolist() == [0, 2, -2]


@pytest.mark.parametrize("build", BUILD_PARAMS)
@pytest.mark.parametrize("kind", list(QuantKind))
def test_kernel_matches_dequantize_then_matmul(build: str, kind: QuantKind) -> None:
    if build == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    kernel = quant_kernel(BUILDS[build])
    for i, (m, n, k) in enumerate(SHAPES):
        w = blocks_of(kind, n, k, seed=i)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + i))
        loose = torch.nn.functional.pad(x, (0, w.shape[1] - k)) @ w.dequantize().T
        # against plain dequantize-then-matmul in float32 only the activations' rounding differs:
        # 16 bits keep the dequantized answer (errors ~2e-5 of the largest output), 8 bits do not (~6e-3)
        for bits, bound in ((16, 2e-4), (8, 0.03)):
            y = quantized_matmul(x, [(0, pack(w, kernel))], n, kernel, bits=bits)
            assert y.shape == (m, n) and y.dtype == torch.float32
            exact = reference(x, w, kernel, bits)
            scale = exact.abs().max().item()
            assert (y.double() - exact).abs().max().item() <= 1e-5 * scale, (build, kind, bits, m, n, k)
            assert (y - loose).abs().max().item() <= bound * loose.abs().max().item(), (build, kind, bits)
        rows = torch.tensor([0, n - 1, n // 2, n // 2])
        assert torch.equal(dequantize_rows(pack(w, kernel), rows, kernel), w.dequantize()[rows])


@pytest.mark.parametrize("build", BUILD_PARAMS)
@pytest.mark.parametrize("kind", list(QuantKind))
def test_a_rows_output_does_not_depend_on_its_batch(build: str, kind: QuantKind) -> None:
    """Bit for bit, whatever path the batch's size takes (AVX2: one or two rows in one
    pass, 3-15 in passes per half-tile, 16 and more through widened codes and panels, a
    last partial panel; AVX-512: from 4 rows two tiles at a time, 6 rows a call; past 64
    rows, chunks): a request's logits must not change with who else is in its step.
    K = 576: 18 blocks, more than the widened path takes at a time; N = 136: runs of two
    tiles or more even when two threads share the 9 tiles (the last one partial)."""
    if build == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    kernel = quant_kernel(BUILDS[build])
    w = pack(blocks_of(kind, 136, 576, seed=7), kernel)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(8))
    for bits in (16, 8):
        alone = torch.cat([quantized_matmul(x[i:i + 1], [(0, w)], 136, kernel, bits=bits) for i in range(70)])
        for m in (2, 4, 5, 8, 16, 18, 70):
            got = quantized_matmul(x[:m], [(0, w)], 136, kernel, bits=bits)
            assert torch.equal(got, alone[:m]), (build, kind, bits, m)


@pytest.mark.parametrize("kind", list(QuantKind))
def test_pack_writes_the_layout_the_kernel_header_describes(kind: QuantKind) -> None:
    """pack's codes against the layout spelled out index by index (quant_linear.cpp's
    header), rows past N zero: 4-bit chunk p, byte 4r + i holds k = 8p + i (low nibble)
    and 8p + 4 + i (high); 8-bit chunk j, byte 4r + i holds k = 4j + i."""
    n, k = 21, 64  # a tile and a part: the padding rows too
    w = blocks_of(kind, n, k, seed=7)
    codes = w.codes.view(torch.uint8).tolist()
    chunks, expected = (8 if kind == QuantKind.Q8 else 4), []
    for t in range(-(-n // 16)):
        for b in range(k // 32):
            for j in range(chunks):
                for r in range(16):
                    row = t * 16 + r
                    for i in range(4):
                        c = codes[row][b * 32:] if row < n else [0] * 32
                        expected.append(c[4 * j + i] if kind == QuantKind.Q8 else c[8 * j + i] | (c[8 * j + 4 + i] << 4))
    assert pack(w).codes.tolist() == expected


@pytest.mark.parametrize("bits", [16, 8])
def test_bf16_activations_and_segments_of_mixed_kinds(bits: int) -> None:
    """A fused qkv whose shards came as different GGUF types: one call, three segments."""
    parts = [blocks_of(QuantKind.Q4_SYM, 48, 128, 1), blocks_of(QuantKind.Q8, 17, 128, 2),
             blocks_of(QuantKind.Q4_ASYM, 33, 128, 3)]
    qw = QuantizedWeight(98, 128, activation_bits=bits)
    offset = 0
    for p in parts:
        qw.store(offset, p)
        offset += p.shape[0]
    assert qw.complete()
    x = torch.randn(5, 128).bfloat16()
    y = qw.matmul(x)
    assert y.shape == (5, 98)
    fused = qw.linear(x.view(5, 1, 128))  # the layer's one-call path: any leading dims, x's dtype out
    assert fused.dtype == torch.bfloat16 and fused.shape == (5, 1, 98)
    assert torch.equal(fused.view(5, 98), y.to(torch.bfloat16))
    offset = 0
    for p in parts:
        ref = reference(x.float(), p, bits=bits)
        got = y[:, offset: offset + p.shape[0]].double()
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        offset += p.shape[0]


def test_quantize_is_round_to_nearest_per_block() -> None:
    w = torch.randn(20, 70)
    # int8: half a step of amax/127.  int4 (Q4_0's rule): the extreme value maps to -8, so
    # the other side reaches only 7/8 of it: up to amax/8 off where it clamps.
    for method, bound in (("int8", 0.5 / 127), ("int4", 1 / 8)):
        b = quantize(w, method)
        assert b.shape == (20, 96)  # K padded to the block
        err = (b.dequantize()[:, :70] - w).abs().view(20, -1)
        amax = torch.nn.functional.pad(w, (0, 26)).abs().view(20, -1, 32).amax(-1)
        per_block = torch.nn.functional.pad(err, (0, 26)).view(20, -1, 32).amax(-1)
        assert (per_block <= amax * bound + 1e-3 * amax).all(), method
        assert (b.dequantize()[:, 70:] == 0).all()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0"])
def test_gguf_blocks_are_kept_exactly(type_name: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from gguf.quants import quantize as gguf_quantize

    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    qt = GGMLQuantizationType[type_name]
    raw = gguf_quantize(w, qt)
    b = from_gguf(raw, type_name, (24, 96))
    assert b is not None and b.source_type == type_name
    assert torch.equal(b.dequantize(), torch.from_numpy(dequantize(raw, qt).astype(np.float32)))


def random_k_blocks(type_name: str, n: int, k: int, block_bytes: int) -> np.ndarray:
    """Random bytes are valid K-quant blocks once the fp16 super-scales are made finite."""
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(n * k // 256, block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((raw.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if type_name == "Q4_K":
        raw[:, :4] = scales
    else:  # Q6_K: d is the last two bytes
        raw[:, -2:] = scales[:, :2]
    return raw.reshape(n, -1)


def test_q4_k_becomes_q4_asym_with_fp16_rounding_only() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_k_blocks("Q4_K", 8, 512, 144)
    b = from_gguf(raw, "Q4_K", (8, 512))
    assert b is not None and b.kind == QuantKind.Q4_ASYM
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float32)).view(8, 512)
    # d*sc and dmin*m rounded to fp16: relative error per term at most 2^-11
    err = (b.dequantize() - ref).abs().max().item()
    assert err <= 2 * 2**-11 * ref.abs().max().item()


def test_other_types_are_requantized_to_8_bits() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_k_blocks("Q6_K", 4, 256, 210)
    b = from_gguf(raw, "Q6_K", (4, 256))
    assert b is not None and b.kind == QuantKind.Q8 and b.source_type == "Q6_K"
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q6_K).astype(np.float32)).view(4, 256)
    amax = ref.abs().view(4, -1, 32).amax(-1, keepdim=True)
    err = (b.dequantize() - ref).abs().view(4, -1, 32)
    assert (err <= amax / 127 * 0.5 + amax * 2**-10).all()
    assert from_gguf(np.zeros((2, 64), np.float16), "F16", (2, 32)) is None


def test_columns_split_only_at_block_boundaries() -> None:
    b = quantize(torch.randn(8, 128), "int8")
    assert b.narrow(1, 64, 64).shape == (8, 64)
    assert torch.equal(b.narrow(1, 64, 64).dequantize(), b.dequantize()[:, 64:])
    assert torch.equal(b.narrow(0, 3, 2).dequantize(), b.dequantize()[3:5])
    with pytest.raises(ValueError, match="multiples of its 32-weight blocks"):
        b.narrow(1, 48, 48)


def test_shards_of_one_kind_merge_into_one_call() -> None:
    """q|k|v of one GGUF type: once all are in, one packed weight (one kernel call)."""
    parts = [blocks_of(QuantKind.Q4_ASYM, n, 64, seed) for seed, n in enumerate((32, 16, 24))]
    qw = QuantizedWeight(72, 64)
    for offset, p in zip((0, 32, 48), parts, strict=True):
        qw.store(offset, p)
    assert [(o, w.n) for o, w in qw.segments] == [(0, 72)]
    x = torch.randn(3, 64)
    full = BlockWeights(QuantKind.Q4_ASYM, torch.cat([p.codes for p in parts]), torch.cat([p.d for p in parts]),
                        torch.cat([p.m for p in parts]))
    ref = reference(x, full)
    assert (qw.matmul(x).double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    ragged = QuantizedWeight(40, 64)  # a first shard that ends mid-tile stays a segment of its own
    ragged.store(0, parts[2])
    ragged.store(24, parts[1])
    assert [(o, w.n) for o, w in ragged.segments] == [(0, 24), (24, 16)]


def huge_page_advised(ptr: int) -> bool:
    """Whether the mapping holding address `ptr` was madvised for huge pages ("hg")."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no transparent huge pages on this OS")
def test_merged_weights_stream_from_huge_pages() -> None:
    """A complete layer's packed weight moves to 2 MB-aligned memory advised for huge pages
    (a decode step streams it every token); its values, and the layer's output, stay."""
    w = quantize(torch.randn(4096, 1024), "int4")  # 2 MB of codes
    qw = QuantizedWeight(4096, 1024)
    qw.store(0, w)
    codes = qw.segments[0][1].codes
    assert torch.equal(codes, pack(w).codes)
    assert codes.data_ptr() % (2 << 20) == 0 and huge_page_advised(codes.data_ptr())
    x = torch.randn(2, 1024)
    assert torch.equal(qw.matmul(x), quantized_matmul(x, [(0, pack(w))], 4096))
    small = torch.zeros(100)
    assert on_huge_pages(small) is small  # under one huge page: left where it is


def test_unpadded_activations_against_a_block_padded_weight() -> None:
    w = torch.randn(20, 70)
    qw = QuantizedWeight(20, 70)
    qw.store(0, quantize(w, "int8"))
    x = torch.randn(3, 70)
    ref = reference(x, quantize(w, "int8"))
    assert (qw.linear(x).double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("bits", [16, 8])
def test_one_segment_layers_take_the_list_free_op(bits: int) -> None:
    """A merged weight's forward calls `linear1` (no list arguments to convert on every
    call); it computes what the segment-list op and the two-call path compute, bit for bit,
    whether its activations fit the thread's reused scratch (decode) or not (a long prompt).
    136 rows: 9 tiles, so 16-bit outputs of two tiles at a time (AVX-512, 4 rows or more)
    pass through their buffer too."""
    qw = QuantizedWeight(136, 1024, activation_bits=bits)
    qw.store(0, quantize(torch.randn(136, 1024), "int4"))
    kernel = quant_kernel()
    for m in (1, 7, 1100, 3):  # 1100 x 1024 codes outgrow the scratch; the calls after reuse it
        x = torch.randn(m, 1024).bfloat16()
        y = qw.linear(x)
        assert qw._op is getattr(torch.ops, kernel.__name__).linear1
        w = qw.segments[0][1]
        lists = getattr(torch.ops, kernel.__name__).linear(x, [w.codes], [w.d], [w.aux], [int(w.kind)], [136], [0],
                                                           136, 1024, bits)
        assert torch.equal(y, lists) and torch.equal(y, qw.matmul(x).to(torch.bfloat16))


@pytest.mark.parametrize("kind", list(QuantKind))
def test_row_dots_are_the_dequantized_rows_dotted_in_float32(kind: QuantKind) -> None:
    """The LM head's exact top logits: row ids[i, j] of the weight dotted with x[i], for
    every kind, a width not a multiple of the block (70: the packed rows are padded), and
    x a strided view; each row's value alone, whatever the batch; ids past the weight's
    rows refused by name."""
    qw = QuantizedWeight(40, 70)
    qw.store(0, blocks_of(kind, 40, 70, seed=3))
    x = torch.randn(3, 80)[:, :70]
    ids = torch.tensor([[0, 39, 17], [5, 5, 22], [38, 1, 16]])
    got = qw.row_dots(ids, x)
    want = (qw.rows(ids.reshape(-1)).double().view(3, 3, 70) * x.double().unsqueeze(1)).sum(-1)
    assert got.dtype == torch.float32 and got.shape == (3, 3)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(qw.row_dots(ids[1:2], x[1:2]), got[1:2])
    with pytest.raises(RuntimeError, match="row id 48 outside"):
        qw.row_dots(torch.tensor([[48]]), x[:1])
