"""The C++ decode kernel behind cpu_paged: built where a compiler exists, exact against
float32 math for every dtype and head size it takes, and optional (no compiler: the
backend keeps the torch path)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from pagedserve.attention import cpu_paged, kv_dtype
from pagedserve.attention.backend import EVERY_POSITION
from pagedserve.attention.cpu_paged import CpuPagedBackend, paged_decode
from pagedserve.attention.torch_paged import TorchPagedBackend
from pagedserve.attention.torch_ref import TorchReferenceBackend
from pagedserve.cpu_info import cpu_flags
from tests.attention.test_torch_paged import make_case, run_backend
from tests.cpu_builds import SAME_AS_NATIVE, avx2_param

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
# The plain loops (no AVX2, no FMA), as tests build them: at -O0, which checks the same
# source in about 15 s less compile time than -O3 (real Zen 3; the machines that run the
# plain loops build them at -O3, where GCC vectorises them), and runs the tests in tenths
# of a second.
PLAIN_TEST_BUILD = ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-O0")


def reference_decode(q, k_cache, v_cache, block_table, seq_lens, scale):
    """float32 attention of one query token per request over its first seq_len slots."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        slots = torch.arange(n)
        blocks = block_table[b, slots // bs].long()
        k = k_cache[blocks, slots % bs].float()  # [n, Hkv, D]
        v = v_cache[blocks, slots % bs].float()
        g = q.shape[1] // hkv
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [n, H, D]
        p = (torch.einsum("hd,nhd->hn", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_kernel_builds_where_a_compiler_exists():
    assert paged_decode() is not None
    assert CpuPagedBackend(8, 2, 64, 0.125, 16).decode_kernel is not None


def check_kernel(kernel, dtype, heads, kv_heads, dim, bs) -> None:
    g = torch.Generator().manual_seed(heads * dim + bs)
    num_blocks, b = 160, 7
    k_cache, v_cache = (torch.randn(num_blocks, bs, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    width = -(-128 // bs)
    block_table = torch.randperm(num_blocks, generator=g)[: b * width].view(b, width).int()
    seq_lens = torch.tensor([1, 16, 17, 128, 0, 77, 33], dtype=torch.int32)  # 0: a padding row, output 0
    # q rows strided, as the model's q is a slice of the fused q|k projection.
    q = torch.randn(b, heads + 2 * kv_heads, dim, generator=g).to(dtype)[:, :heads]
    out = kernel(q, k_cache, v_cache, block_table, seq_lens, dim**-0.5)
    assert out.dtype == dtype and out.shape == (b, heads, dim)
    ref = reference_decode(q, k_cache, v_cache, block_table, seq_lens, dim**-0.5)
    # The kernel rounds once, at the output; the tolerance is that one rounding.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert torch.all(out[4] == 0)


# (9, 3, 64): SmolLM2; G = 16 and block size 8 take the row-by-row loops instead of the
# 16-slot blocks and register accumulators; (4, 1, 256): Gemma 3 270M, and heads of 256
# with G = 2 and 8 (each G takes its own share of the 256 values per pass).
HEAD_CONFIGS = [(9, 3, 64), (8, 8, 128), (16, 2, 128), (4, 1, 64), (16, 1, 64), (4, 1, 256), (8, 4, 256),
                (16, 2, 256), (32, 32, 96), (6, 2, 96), (4, 2, 32), (8, 1, 32)]


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", HEAD_CONFIGS)
@pytest.mark.parametrize("bs", [16, 32, 8])
def test_kernel_matches_float32_math(dtype, heads, kv_heads, dim, bs):
    check_kernel(paged_decode(), dtype, heads, kv_heads, dim, bs)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 32, 64), (16, 2, 128), (4, 1, 64), (8, 2, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_requests_than_threads_split_heads_and_change_nothing(heads, kv_heads, dim, dtype):
    """With fewer requests than threads, each request's KV heads are split into ranges,
    one task each (one user's decode step uses every thread): the output is the very same
    bits as one thread's, with a sliding window too, and with 1, 2, 3 or 5 threads."""
    g = torch.Generator().manual_seed(heads + dim)
    k_cache, v_cache = (torch.randn(40, 16, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    block_table = torch.randperm(40, generator=g)[:16].view(2, 8).int()
    seq_lens = torch.tensor([100, 37], dtype=torch.int32)
    q = torch.randn(2, heads, dim, generator=g).to(dtype)
    before = torch.get_num_threads()
    try:
        for batch in (1, 2):
            for window in (0, 40):
                args = (q[:batch], k_cache, v_cache, block_table[:batch], seq_lens[:batch], dim**-0.5, window)
                torch.set_num_threads(1)
                want = paged_decode()(*args)
                if window == 0:
                    ref = reference_decode(*args[:-1])
                    torch.testing.assert_close(want.float(), ref, atol=1e-2, rtol=1e-2)
                for threads in (2, 3, 5):
                    torch.set_num_threads(threads)
                    assert torch.equal(paged_decode()(*args), want), (batch, window, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_a_decode_kernel_step_builds_no_gather_plan():
    """The usual decode step's group is views of the step's block table and lengths, and
    the torch path's gather plan waits for a layer that reads it (cpu_paged's kernel never does)."""
    *tensors, common = make_case([(150 + i, 1) for i in range(4)], 8, 2, 64, 16, torch.bfloat16, seed=3)
    md = CpuPagedBackend.build_metadata(common)
    g = md.groups[0]
    assert md.identity and g.block_table.data_ptr() == common.block_table.data_ptr()
    assert g.seq_lens.data_ptr() == common.seq_lens.data_ptr()
    q, k, v, k_cache, v_cache = tensors[:5]
    backend = CpuPagedBackend(8, 2, 64, 0.125, 16)
    backend.forward(q, k, v, k_cache, v_cache, md)
    assert g._plan_made is None
    assert g.blocks.shape == (4 * g.kv_len // 16,) and g.masked.shape == (4, 1, g.kv_len)  # built on first read


CPU_FLAGS = cpu_flags()


@pytest.mark.skipif(not HAS_COMPILER or "avx2" not in CPU_FLAGS, reason="needs a C++ compiler and an AVX2 CPU")
@SAME_AS_NATIVE  # (test_kernel_matches_float32_math's cases include these)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_avx2_build_matches_float32_math(dtype):
    """The AVX2/FMA path a CPU without AVX-512 gets (most laptops, Zen 3), built here with
    AVX-512 disabled: every head shape, block sizes with whole and partial 8-slot groups."""
    kernel = cpu_paged.build(("-mno-avx512f",))
    for heads, kv_heads, dim in HEAD_CONFIGS:
        for bs in (16, 8):
            check_kernel(kernel, dtype, heads, kv_heads, dim, bs)


def _prompt_rows_case(q_dtype, cache_dtype, dim, kv_heads, group, bs, seed):
    """13 rows of one prompt (positions 40..52, one block table) between two other
    requests' decode rows: the kernel's arguments."""
    g = torch.Generator().manual_seed(seed)
    nb, heads = 12, kv_heads * group
    width = dim + 2 if cache_dtype == torch.int8 else dim
    if cache_dtype == torch.int8:  # codes, then each row's float16 scale
        kc, vc = (torch.randint(-100, 100, (nb, bs, kv_heads, width), generator=g, dtype=torch.int8) for _ in "kv")
        scale = torch.full((nb, bs, kv_heads, 1), 0.01, dtype=torch.float16).view(torch.int8)
        kc[..., dim:], vc[..., dim:] = scale, scale
    else:
        kc, vc = ((torch.randn(nb, bs, kv_heads, dim, generator=g) * 0.7).to(cache_dtype) for _ in "kv")
    own = torch.randperm(nb, generator=g)[:6].int()
    lens = [70, *range(41, 54), 90]
    table = torch.stack([torch.randperm(nb, generator=g)[:6].int(), *[own] * 13, torch.randperm(nb, generator=g)[:6].int()])
    q = torch.randn(len(lens), heads, dim, generator=g).to(q_dtype)
    return q, kc, vc, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("isa", ["native", avx2_param("avx2")])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.bfloat16), (torch.bfloat16, torch.int8),
                                                 (torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.float16),
                                                 (torch.float16, torch.bfloat16)])
def test_rows_of_one_prompt_attended_together_are_each_row_alone(isa, q_dtype, cache_dtype):
    """Consecutive rows of one prompt over one block table (the exact prompt rows) are
    attended as tiles that read each block once: every row bit for bit what the kernel
    gives that row alone, and close to float32 math; under a sliding window too (rows
    whose window starts past position 0 are not tiled)."""
    if isa == "avx2" and "avx2" not in CPU_FLAGS:
        pytest.skip("needs an AVX2 CPU")
    kernel = paged_decode() if isa == "native" else cpu_paged.build(("-mno-avx512f",))
    before = torch.get_num_threads()
    try:
        # (2 or 3 threads: tiles of 4 rows; more threads would shorten them, so each gets one)
        for dim, kv_heads, group in ((64, 3, 3), (128, 2, 4), (256, 1, 8), (64, 2, 1), (96, 4, 3), (32, 2, 2)):
            for bs in (16, 32):
                q, kc, vc, table, lens = _prompt_rows_case(q_dtype, cache_dtype, dim, kv_heads, group, bs, dim + bs)
                for window, threads in ((0, 2), (45, 2), (0, 3)):
                    torch.set_num_threads(threads)
                    out = kernel(q, kc, vc, table, lens, dim**-0.5, window)
                    for b in range(len(lens)):
                        alone = kernel(q[b:b + 1], kc, vc, table[b:b + 1], lens[b:b + 1], dim**-0.5, window)
                        assert torch.equal(alone[0], out[b]), (dim, group, bs, window, threads, b)
                if cache_dtype in (torch.float32, torch.bfloat16, torch.float16):
                    want = reference_decode(q.float(), kc.float(), vc.float(), table, lens, dim**-0.5)
                    torch.testing.assert_close(kernel(q, kc, vc, table, lens, dim**-0.5).float(), want,
                                               atol=2e-2, rtol=2e-2)
    finally:
        torch.set_num_threads(before)


def _relaid(kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, bs: int, seed: int):
    """The same keys and values as (kc, vc, table) in blocks of `bs` slots, scattered in
    another order, with NaN in every slot no row owns: (k_cache, v_cache, block_table)."""
    old_bs, max_len = kc.shape[1], int(lens.max())
    nblk = -(-max_len // bs)
    order = (torch.randperm(len(lens) * nblk, generator=torch.Generator().manual_seed(seed)) + 1).int()
    new_table = order.view(len(lens), nblk)
    k2 = torch.full((len(lens) * nblk + 1, bs, *kc.shape[2:]), float("nan"), dtype=kc.dtype)
    v2 = k2.clone()
    for b, n in enumerate(lens.tolist()):
        p = torch.arange(n)
        src = (table[b, p // old_bs].long(), p % old_bs)
        dst = (new_table[b, p // bs].long(), p % bs)
        k2[dst], v2[dst] = kc[src], vc[src]
    return k2, v2, new_table


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("isa", ["native", avx2_param("avx2")])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                 (torch.float32, torch.bfloat16), (torch.float16, torch.float16),
                                                 (torch.bfloat16, torch.float16)])
def test_the_block_size_changes_no_output_bit(isa, q_dtype, cache_dtype):
    """The same keys and values in blocks of 1 to 64 slots give every row (decode rows and
    a prompt's tiled rows, under a sliding window too) bit for bit the same output: a block
    smaller than the kernel's group of slots once took the row-by-row path, whose bf16
    scores round differently, so `--block-size 8` changed greedy answers on AVX-512."""
    if isa == "avx2" and "avx2" not in CPU_FLAGS:
        pytest.skip("needs an AVX2 CPU")
    kernel = paged_decode() if isa == "native" else cpu_paged.build(("-mno-avx512f",))
    for dim, kv_heads, group in ((64, 3, 3), (128, 2, 4), (64, 1, 12), (96, 2, 3), (32, 2, 4)):
        q, kc, vc, table, lens = _prompt_rows_case(q_dtype, cache_dtype, dim, kv_heads, group, 16, dim)
        for window in (0, 45):
            want = kernel(q, kc, vc, table, lens, dim**-0.5, window)
            for bs in (1, 2, 4, 8, 32, 64):
                k2, v2, t2 = _relaid(kc, vc, table, lens, bs, bs)
                got = kernel(q, k2, v2, t2, lens, dim**-0.5, window)
                assert torch.equal(got, want), (dim, group, window, bs, (got.float() - want.float()).abs().max())


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_plain_loop_build_matches_float32_math():
    """The plain loops of a CPU with neither (built here with both disabled)."""
    kernel = cpu_paged.build(PLAIN_TEST_BUILD)
    for heads, kv_heads, dim in [*HEAD_CONFIGS[:3], HEAD_CONFIGS[5], *HEAD_CONFIGS[-3:]]:
        check_kernel(kernel, torch.bfloat16, heads, kv_heads, dim, 16)


def test_without_a_compiler_the_backend_keeps_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(cpu_paged, "_state", {})

    def no_compiler():
        raise RuntimeError("Error building extension: c++: not found")

    monkeypatch.setattr(cpu_paged, "build", no_compiler)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        backend = CpuPagedBackend(6, 2, 64, 64**-0.5, 16)
    assert backend.decode_kernel is None
    assert "CPU attention kernel unavailable" in caplog.text and "c++: not found" in caplog.text
    case = make_case([(150, 1)] * 6 + [(40, 9)], 6, 2, 64, 16, torch.float32, seed=2)
    ref, _, _ = run_backend(TorchReferenceBackend, case, 6, 2, 64, 16)
    q, k, v, kc, vc, common = case
    out = backend.forward(q, k, v, kc.clone(), vc.clone(), CpuPagedBackend.build_metadata(common))
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_decode_groups_use_the_kernel(monkeypatch):
    """Decodes go to the kernel, prefill chunks to the torch path, in one mixed step."""
    calls = []
    kernel = paged_decode()

    def spy(q, *args):
        calls.append(q.shape[0])
        return kernel(q, *args)

    backend = CpuPagedBackend(6, 2, 64, 64**-0.5, 16)
    backend.decode_kernel = spy
    case = make_case([(150, 1), (151, 1), (30, 30), (90, 1)], 6, 2, 64, 16, torch.bfloat16, seed=4)
    q, k, v, kc, vc, common = case
    out = backend.forward(q, k, v, kc.clone(), vc.clone(), CpuPagedBackend.build_metadata(common))
    torch_out, _, _ = run_backend(TorchPagedBackend, case, 6, 2, 64, 16)
    assert sum(calls) == 3  # the three decodes; the 30-token prefill did not go to the kernel
    torch.testing.assert_close(out.float(), torch_out.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_kernel_refuses_tables_that_would_read_out_of_bounds():
    k_cache = v_cache = torch.zeros(4, 16, 2, 64)
    q = torch.zeros(1, 4, 64)
    table = torch.tensor([[1, 2]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        paged_decode()(q, k_cache, v_cache, table, torch.tensor([33], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        paged_decode()(q, k_cache, v_cache, torch.tensor([[1, 9]], dtype=torch.int32),
                       torch.tensor([20], dtype=torch.int32), 0.125)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_all_decode_step_is_one_kernel_call_that_stores_kv():
    """The usual step (every request decoding one token) hands the new K/V to the kernel,
    which stores them before attending: the same cache and output as storing first."""
    calls = []
    kernel = paged_decode()

    def spy(*args, **kwargs):
        calls.append(len(args) + len(kwargs))
        return kernel(*args, **kwargs)

    backend = CpuPagedBackend(6, 2, 64, 64**-0.5, 16)
    backend.decode_kernel = spy
    case = make_case([(150, 1), (129, 1), (3, 1)], 6, 2, 64, 16, torch.float32, seed=5)  # 129: opens a block
    q, k, v, kc, vc, common = case
    kc, vc = kc.clone(), vc.clone()
    out = backend.forward(q, k, v, kc, vc, CpuPagedBackend.build_metadata(common))
    assert calls == [10]  # one call, with key, value and slot_mapping
    ref, ref_k, ref_v = run_backend(TorchPagedBackend, case, 6, 2, 64, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc.nan_to_num(7.0), ref_k.nan_to_num(7.0)) and torch.equal(vc.nan_to_num(7.0), ref_v.nan_to_num(7.0))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_the_kernel_stores_float32_rows_into_a_16_bit_cache_as_the_layer_does(cache_dtype):
    """Float32 K/V into a 16-bit cache (`--kv-cache-dtype` under float32 compute): the
    kernel's store converts as kv_dtype.store does, bit for bit (rounding to nearest even,
    float16 clamped to its range: 1e6 and -inf become +-65504; NaN stays a NaN, whose bits
    torch's vectorised cast may set otherwise), so the decode stack and the layer path fill
    the same cache."""
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(3, 2, 64, generator=g) * 300, torch.randn(3, 2, 64, generator=g)
    key[0, 0, :3] = torch.tensor([1e6, -float("inf"), float("nan")])
    value[1, 1, 5] = 65519.0  # (rounds past float16's largest finite value unless clamped)
    slots = torch.tensor([18, 35, 49])
    caches = [torch.zeros(4, 16, 2, 64, dtype=cache_dtype) for _ in range(4)]
    kv_dtype.store(key, value, caches[0], caches[1], slots)
    q, table = torch.randn(3, 4, 64, generator=g), torch.tensor([[1], [2], [3]], dtype=torch.int32)
    paged_decode()(q, caches[2], caches[3], table, torch.tensor([3, 4, 2], dtype=torch.int32), 0.125, 0,
                   key, value, slots)
    assert caches[2][1, 2, 0, 2].isnan() and caches[0][1, 2, 0, 2].isnan()
    caches[0][1, 2, 0, 2] = caches[2][1, 2, 0, 2] = 0
    assert torch.equal(caches[2].view(torch.int16), caches[0].view(torch.int16))
    assert torch.equal(caches[3].view(torch.int16), caches[1].view(torch.int16))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_kernel_refuses_a_bad_slot_before_writing_any():
    k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
    q, key = torch.zeros(2, 4, 64), torch.ones(2, 2, 64)
    table, lens = torch.tensor([[1], [2]], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="slot 64 out of range"):
        paged_decode()(q, k_cache, v_cache, table, lens, 0.125, 0, key, key, torch.tensor([18, 64]))
    assert not k_cache.any() and not v_cache.any()
    with pytest.raises(RuntimeError, match="come together"):
        paged_decode()(q, k_cache, v_cache, table, lens, 0.125, 0, key, key)
    with pytest.raises(RuntimeError, match="cache's dtype"):
        paged_decode()(q, k_cache, v_cache, table, lens, 0.125, 0, key.double(), key.double(), torch.tensor([18, 35]))


EXACT_CASES = {  # (specs, sliding window): with an exact horizon of 48 positions
    "prompt from 0, beside decodes": ([(150, 1), (97, 97), (40, 3)], None),
    "one exact row, then a chunk": ([(40, 1), (147, 100)], None),  # its first new token at 47
    "a prefix hit past the horizon": ([(40, 1), (120, 60)], None),
    "windowed": ([(40, 1), (147, 100), (97, 97)], 32),
}


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_prompt_rows_below_the_exact_horizon_attend_as_one_token_steps(name, dtype):
    """With an exact horizon of 48 positions, every prompt row at a position below 48
    comes out bit for bit as a one-token step at that position computes it (the decode
    kernel, row by row); every row, those past the horizon too, matches the reference."""
    import dataclasses

    from tests.attention.test_torch_paged import TOL, windowed_case

    heads, kv_heads, dim, bs, horizon = 6, 2, 64, 16, 48
    specs, window = EXACT_CASES[name]
    if window is None:
        case = make_case(specs, heads, kv_heads, dim, bs, dtype, seed=13)
    else:
        case = windowed_case(specs, window, heads, kv_heads, dim, bs, dtype, seed=13)
    q, k, v, kc, vc, common = case
    ref, kc, vc = run_backend(TorchReferenceBackend, case, heads, kv_heads, dim, bs)
    common = dataclasses.replace(common, exact_rows_context=horizon)
    out = CpuPagedBackend(heads, kv_heads, dim, dim**-0.5, bs).forward(
        q, k, v, case[3].clone(), case[4].clone(), CpuPagedBackend.build_metadata(common))
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    exact_rows = 0
    for i, (s, n) in enumerate(specs):
        row0 = common.query_start_loc_cpu[i]
        for j in range(n):
            p = s - n + j
            if n <= 1 or p >= horizon:
                continue
            exact_rows += 1
            one = dataclasses.replace(
                common, num_reqs=1, num_actual_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                seq_lens=torch.tensor([p + 1], dtype=torch.int32), block_table=common.block_table[i:i + 1],
                slot_mapping=common.slot_mapping[row0 + j: row0 + j + 1], query_start_loc_cpu=[0, 1],
                seq_lens_cpu=[p + 1], max_query_len=1, max_seq_len=p + 1, exact_rows_context=0)
            r = slice(row0 + j, row0 + j + 1)
            single = CpuPagedBackend(heads, kv_heads, dim, dim**-0.5, bs).forward(
                q[r], k[r], v[r], kc.clone(), vc.clone(), CpuPagedBackend.build_metadata(one))
            assert torch.equal(single[0], out[row0 + j]), (i, p)
    assert exact_rows == {"prompt from 0, beside decodes": 48 + 3, "one exact row, then a chunk": 1,
                          "a prefix hit past the horizon": 0, "windowed": 1 + 48}[name]


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_the_exact_horizon_is_offered_only_where_the_kernel_reads_the_operands():
    """Rows the kernel cannot take would run the torch decode path, padded to the longest
    context: no horizon there, and none from the torch-only backend."""
    backend = CpuPagedBackend(6, 2, 64, 0.125, 16)
    for q, cache in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.float16),
                     (torch.bfloat16, torch.int8), (torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)):
        assert backend.exact_rows_context(torch.device("cpu"), q, cache) == EVERY_POSITION
    cpu = torch.device("cpu")
    assert backend.exact_rows_context(cpu, torch.bfloat16, torch.float32) == 0
    assert backend.exact_rows_context(torch.device("cuda"), torch.bfloat16, torch.bfloat16) == 0  # (selected there by name)
    assert CpuPagedBackend(6, 2, 80, 0.125, 16).exact_rows_context(cpu, torch.float32, torch.float32) == 0  # no 80 kernel
    assert TorchPagedBackend(6, 2, 64, 0.125, 16).exact_rows_context(cpu, torch.float32, torch.float32) == 0


def test_a_head_size_without_the_kernel_says_so_once(caplog) -> None:
    """A model whose head size the kernel lacks (a tiny one's 16, or 80, 96) took the torch
    path in silence, and its answers then depend on chunking: it is said at start, once."""
    import logging

    from pagedserve.attention import cpu_paged

    cpu_paged._WARNED_HEAD_DIMS.discard(48)
    with caplog.at_level(logging.WARNING, logger="pagedserve"):
        for _ in range(3):  # (every layer builds one)
            backend = cpu_paged.CpuPagedBackend(4, 2, 48, 48 ** -0.5, 16)
        cpu_paged.CpuPagedBackend(4, 2, 64, 0.125, 16)
    assert backend.decode_kernel is None
    said = [r.getMessage() for r in caplog.records if "head sizes" in r.getMessage()]
    assert len(said) == 1 and "this model's are 48" in said[0]
