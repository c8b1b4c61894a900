"""A KV cache narrower than the compute dtype (kv_cache_dtype): every backend stores K/V
converted to the cache's dtype and attends over exactly what was stored, so they agree
with float32 math over the stored values; the C++ kernel converts float8 in registers
(AVX-512 and AVX2 builds alike)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.attention import cpu_paged, kv_dtype
from pagedserve.attention.cpu_paged import CpuPagedBackend, paged_decode
from pagedserve.attention.torch_paged import TorchPagedBackend
from pagedserve.attention.torch_ref import TorchReferenceBackend
from tests.attention.test_cpu_paged import CPU_FLAGS, HAS_COMPILER, PLAIN_TEST_BUILD, reference_decode
from tests.attention.test_torch_paged import MIXED, make_case

NARROW = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


def test_storage_dtypes_by_name() -> None:
    assert kv_dtype.kv_cache_torch_dtype("auto", torch.float32) == torch.float32
    assert kv_dtype.kv_cache_torch_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert kv_dtype.kv_cache_torch_dtype("fp8_e4m3", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_dtype.kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert kv_dtype.kv_cache_torch_dtype("int8", torch.bfloat16) == torch.int8
    assert kv_dtype.row_width(64, torch.int8) == 66 and kv_dtype.row_width(64, torch.float8_e4m3fn) == 64


def test_int8_rows_keep_within_half_a_step_of_their_absmax() -> None:
    x = torch.randn(50, 3, 64) * torch.logspace(-2, 3, 50)[:, None, None]  # (scales stay normal float16)
    rows = kv_dtype.to_cache(x, torch.int8)
    assert rows.shape == (50, 3, 66) and rows.dtype == torch.int8
    back = kv_dtype.from_cache(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step * 0.5 * 1.01 + 1e-7).all()


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_stored_values_stay_finite(cache_dtype) -> None:
    for source in (torch.float32, torch.bfloat16):  # (bfloat16 over float16 is one size, a wider range: was inf)
        big = torch.tensor([1e9, -1e9, 3.0], dtype=source)
        back = kv_dtype.from_cache(kv_dtype.to_cache(big, cache_dtype), torch.float32)
        assert torch.isfinite(back).all(), source
        assert back[2] == (0.0 if cache_dtype == torch.int8 else 3.0)  # (int8: a step of the row's largest value)


@pytest.mark.parametrize("backend", [TorchReferenceBackend, TorchPagedBackend, CpuPagedBackend])
@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_backends_attend_over_what_the_narrow_cache_stored(backend, cache_dtype) -> None:
    """float32 queries over a narrow cache, prefills and decodes in one step: each backend
    equals float32 attention over the stored (rounded) values, and stores exactly the
    rounded new K/V."""
    heads, kv_heads, dim, bs = 6, 2, 64, 16
    q, k, v, kc32, vc32, common = make_case(MIXED, heads, kv_heads, dim, bs, torch.float32, seed=3)
    kc, vc = kv_dtype.to_cache(kc32, cache_dtype), kv_dtype.to_cache(vc32, cache_dtype)

    def stored(x: torch.Tensor) -> torch.Tensor:  # what the cache gives back of x
        return kv_dtype.from_cache(kv_dtype.to_cache(x, cache_dtype), torch.float32)

    ref_k, ref_v = kv_dtype.from_cache(kc, torch.float32), kv_dtype.from_cache(vc, torch.float32)
    out_ref = TorchReferenceBackend(heads, kv_heads, dim, dim**-0.5, bs).forward(
        q, stored(k), stored(v), ref_k, ref_v, TorchReferenceBackend.build_metadata(common))
    impl = backend(heads, kv_heads, dim, dim**-0.5, bs)
    out = impl.forward(q, k, v, kc, vc, backend.build_metadata(common))
    assert kc.dtype == cache_dtype
    t = common.num_actual_tokens
    slots = common.slot_mapping[:t]
    rows = kv_dtype.raw(kc).view(-1, kv_heads, kc.shape[-1]).index_select(0, slots)
    assert torch.equal(rows, kv_dtype.raw(kv_dtype.to_cache(k[:t], cache_dtype)))
    torch.testing.assert_close(out, out_ref, atol=2e-4, rtol=2e-4)


def _check_narrow_kernel(kernel, q_dtype: torch.dtype, cache_dtype: torch.dtype,
                         heads: int = 9, kv_heads: int = 3, dim: int = 64) -> None:
    g = torch.Generator().manual_seed(7)
    num_blocks, b, bs = 64, 5, 16
    k_cache, v_cache = (kv_dtype.to_cache(torch.randn(num_blocks, bs, kv_heads, dim, generator=g).mul(4), cache_dtype)
                        for _ in range(2))
    block_table = torch.randperm(num_blocks, generator=g)[: b * 8].view(b, 8).int()
    seq_lens = torch.tensor([1, 16, 17, 128, 77], dtype=torch.int32)
    q = torch.randn(b, heads, dim, generator=g).to(q_dtype)
    out = kernel(q, k_cache, v_cache, block_table, seq_lens, dim**-0.5)
    ref = reference_decode(q, kv_dtype.from_cache(k_cache, torch.float32), kv_dtype.from_cache(v_cache, torch.float32),
                           block_table, seq_lens, dim**-0.5)
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
@pytest.mark.parametrize(("q_dtype", "cache_dtype"), [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e5m2), (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2),
    (torch.float32, torch.int8), (torch.bfloat16, torch.int8),
], ids=str)
def test_kernel_reads_narrow_caches_exactly(q_dtype, cache_dtype) -> None:
    _check_narrow_kernel(paged_decode(), q_dtype, cache_dtype)
    _check_narrow_kernel(paged_decode(), q_dtype, cache_dtype, 4, 1, 256)  # Gemma 3's heads


@pytest.mark.skipif(not HAS_COMPILER or "avx2" not in CPU_FLAGS, reason="needs a C++ compiler and an AVX2 CPU")
def test_avx2_build_reads_float8_and_int8_exactly() -> None:
    kernel = cpu_paged.build(("-mno-avx512f",))
    for cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.int8):
        _check_narrow_kernel(kernel, torch.float32, cache_dtype)
        _check_narrow_kernel(kernel, torch.float32, cache_dtype, 4, 1, 256)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_plain_loop_build_reads_int8_exactly() -> None:
    kernel = cpu_paged.build(PLAIN_TEST_BUILD)
    _check_narrow_kernel(kernel, torch.float32, torch.int8)


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler on this machine")
def test_kernel_refuses_dtype_pairs_it_has_no_code_for() -> None:
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.float32)  # (a 16-bit q over a float32 cache)
    with pytest.raises(RuntimeError, match="int8, or 16-bit; got q BFloat16"):
        paged_decode()(torch.zeros(1, 4, 64, dtype=torch.bfloat16), cache, cache,
                       torch.tensor([[1]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 0.125)
