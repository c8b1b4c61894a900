"""Every CPU attention backend against the torch reference on random paged batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.attention import torch_paged
from pagedserve.attention.backend import CommonAttentionMetadata
from pagedserve.attention.cpu_paged import CpuPagedBackend
from pagedserve.attention.selector import get_attn_backend
from pagedserve.attention.torch_paged import TorchPagedBackend, plan_groups
from pagedserve.attention.torch_ref import TorchReferenceBackend

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=5e-3, rtol=5e-3)}
# torch_paged, and cpu_paged whose decodes go through the C++ kernel (head_dim 32, 64, 96, 128 or 256).
BACKENDS = [pytest.param(TorchPagedBackend, id="torch_paged"), pytest.param(CpuPagedBackend, id="cpu_paged")]


def make_case(specs, heads, kv_heads, dim, block_size, dtype, seed, pad_tokens=0):
    """specs: [(seq_len, new_tokens)] in batch order.  Each request's cached prefix is
    written into randomly scattered blocks.  NaN fills the slots no request owns
    (except the null block 0, zeroed as the allocator does), a block allocated ahead
    past each request's context, and the blocks this step opens (written from their
    first slot), which the backend must zero before use: reading any of them poisons
    the output.  The unwritten tail of a block the prefix already started holds large
    finite garbage, which only the causal mask hides."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-s // block_size) for s, _ in specs]
    num_blocks = 1 + sum(nblocks) + len(specs) + 3
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    k_cache[0] = 0
    v_cache = k_cache.clone()
    fk, fv = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    block_table = torch.zeros(len(specs), max(nblocks) + 1, dtype=torch.int32)
    qsl, slot_mapping = [0], []
    for i, (s, n) in enumerate(specs):
        blocks = [free.pop() for _ in range(nblocks[i])]
        # Plus one block allocated ahead and never written (NaN): it must not be read.
        block_table[i, : nblocks[i] + 1] = torch.tensor(blocks + [free.pop()], dtype=torch.int32)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size
                              for p in range(nblocks[i] * block_size)])
        started = -(-(s - n) // block_size) * block_size  # slots of blocks the prefix began
        fk[slots[s - n:started]] = 50.0
        fv[slots[s - n:started]] = -50.0
        fk[slots[: s - n]] = torch.randn(s - n, kv_heads, dim, generator=g).to(dtype)
        fv[slots[: s - n]] = torch.randn(s - n, kv_heads, dim, generator=g).to(dtype)
        slot_mapping += slots[s - n:s].tolist()
        qsl.append(qsl[-1] + n)
    rows = qsl[-1] + pad_tokens
    q, k, v = (torch.randn(rows, h, dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    seq_lens = [s for s, _ in specs]
    common = CommonAttentionMetadata(
        num_reqs=len(specs), num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table, slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        max_query_len=max(n for _, n in specs), max_seq_len=max(seq_lens), block_size=block_size,
    )
    return q, k, v, k_cache, v_cache, common


def run_backend(cls, case, heads, kv_heads, dim, block_size):
    q, k, v, kc, vc, common = case
    kc, vc = kc.clone(), vc.clone()
    backend = cls(heads, kv_heads, dim, dim**-0.5, block_size)
    out = backend.forward(q, k, v, kc, vc, cls.build_metadata(common))
    return out, kc, vc


MIXED = [(37, 1), (150, 1), (16, 16), (70, 23), (5, 5), (300, 1), (33, 2), (129, 1), (64, 64), (1, 1)]
LONG = [(40, 1), (1100, 1100), (1300, 900), (90, 1)]  # two are split into query chunks


CASES = [
    pytest.param(specs, heads, kv_heads, bs, dtype, id=f"{name}-{heads}/{kv_heads}-bs{bs}-{str(dtype)[6:]}")
    for name, specs, head_cfgs in [("mixed", MIXED, [(6, 2), (4, 4), (8, 1)]), ("decode", [(150, 1)] * 11 + [(129, 1)], [(6, 2), (8, 1), (10, 5)]),
                                   ("long", LONG, [(6, 2)])]
    for heads, kv_heads in head_cfgs for bs in (16, 32) for dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("specs,heads,kv_heads,block_size,dtype", CASES)
def test_matches_reference(backend, specs, heads, kv_heads, block_size, dtype):
    dim = 64
    case = make_case(specs, heads, kv_heads, dim, block_size, dtype, seed=hash((heads, block_size)) % 1000)
    ref, ref_k, ref_v = run_backend(TorchReferenceBackend, case, heads, kv_heads, dim, block_size)
    out, kc, vc = run_backend(backend, case, heads, kv_heads, dim, block_size)
    assert out.shape == ref.shape and out.dtype == dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    # The cache holds the new K/V at exactly the mapped slots; the blocks this step
    # opened are zero elsewhere, and nothing else changed.
    sm = case[-1].slot_mapping
    fresh = sm[sm % block_size == 0] // block_size
    for got, want in ((kc, ref_k), (vc, ref_v)):
        want = want.clone()
        want[fresh] = want[fresh].nan_to_num(0.0)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))


def test_only_blocks_a_step_opens_and_leaves_part_empty_are_zeroed():
    """A prompt's blocks that the step fills whole need no zeros (its last slot is written
    too): zeroing them was ~1% of a prefill.  Those it opens and leaves part empty, and
    no others, are zeroed first (test_matches_reference: no NaN reaches the output)."""
    # 40 new tokens from position 0 (2 blocks full, 1 opened), 23 from 70 (64..79 begun
    # before; 80..92 opened), a decode at 128 (opens a block), one at 150 (opens none).
    *_, common = make_case([(40, 40), (93, 23), (129, 1), (151, 1)], 4, 2, 64, 16, torch.float32, seed=5)
    slots = common.slot_mapping
    fresh = TorchPagedBackend.build_metadata(common).fresh_blocks
    opened = (32, 40 + 10, 40 + 23)  # the new tokens at positions 32, 80 and 128
    assert all(int(slots[i]) % 16 == 0 for i in opened)
    want = sorted(int(slots[i]) // 16 for i in opened)
    assert sorted(fresh.tolist()) == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_rows_are_zero_and_ignored(backend):
    case = make_case([(20, 1), (9, 9)], 4, 2, 64, 16, torch.float32, seed=3, pad_tokens=5)
    ref, _, _ = run_backend(TorchReferenceBackend, case, 4, 2, 64, 16)
    out, _, _ = run_backend(backend, case, 4, 2, 64, 16)
    t = case[-1].num_actual_tokens
    assert out.shape[0] == t + 5
    torch.testing.assert_close(out[:t], ref[:t], atol=1e-5, rtol=1e-5)
    assert torch.all(out[t:] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_in_any_order_with_groups_split(monkeypatch, backend):
    """Tiny group limits force many groups and query chunks; the result must not change."""
    monkeypatch.setattr(torch_paged, "GROUP_OVERHEAD_CELLS", 0)
    monkeypatch.setattr(torch_paged, "GROUP_MAX_AREA", 2000)
    specs = [(300, 1), (45, 12), (8, 1), (200, 40), (60, 1), (17, 17), (9, 3)]
    case = make_case(specs, 8, 2, 64, 16, torch.float32, seed=11)
    ref, _, _ = run_backend(TorchReferenceBackend, case, 8, 2, 64, 16)
    md = backend.build_metadata(case[-1])
    assert len(md.groups) > 5
    assert sum(g.num_reqs for g in md.groups) > len(specs)  # (200, 40) was cut into chunks
    out, _, _ = run_backend(backend, case, 8, 2, 64, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_plan_groups_keeps_similar_decodes_together():
    same = [(1, 150 + i % 3, i, i) for i in range(32)]
    assert len(plan_groups(same)) == 1
    spread = [(1, 20, i, i) for i in range(16)] + [(1, 2000, 16 + i, 16 + i) for i in range(16)]
    groups = plan_groups(spread)
    assert len(groups) == 2 and {len(g) for g in groups} == {16}
    # Decodes are not padded up to a prefill's query length.
    mixed = [(1, 100, i, i) for i in range(8)] + [(40, 40, 8, 8)]
    assert any(all(it[0] == 1 for it in g) for g in plan_groups(mixed))
    assert sorted(it[3] for g in plan_groups(mixed) for it in g) == list(range(9))


def test_bad_metadata_is_a_value_error():
    case = make_case([(10, 3)], 2, 1, 8, 16, torch.float32, seed=0)
    common = case[-1]
    common.seq_lens_cpu = [2]
    with pytest.raises(ValueError, match="seq_len"):
        TorchPagedBackend.build_metadata(common)


def test_selector():
    assert get_attn_backend(None, "cpu") is CpuPagedBackend
    assert get_attn_backend("torch_paged", "cpu") is TorchPagedBackend
    assert get_attn_backend("torch_ref", torch.device("cpu")) is TorchReferenceBackend
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attn_backend("flash", "cpu")


def test_all_decode_step_takes_the_in_place_path():
    case = make_case([(150 + i, 1) for i in range(8)], 6, 2, 16, 16, torch.bfloat16, seed=5)
    md = TorchPagedBackend.build_metadata(case[-1])
    assert md.identity and md.groups[0].token_idx is None
    mixed = make_case([(150, 1), (40, torch_paged.DECODE_ROWS_MAX_TOKENS + 4)], 6, 2, 16, 16, torch.bfloat16, seed=5)
    assert not TorchPagedBackend.build_metadata(mixed[-1]).identity


@pytest.mark.parametrize("window", [None, 24])
def test_float32_prefill_takes_the_fused_kernel_causal_only_from_position_0(monkeypatch, window):
    """Float32 prefill groups go to SDPA: plain causal for a lone prompt with no earlier
    context and no window, the group's mask for the others (a later chunk, a prefix, a
    padded group, a window); bf16 groups keep the matmuls.  Both match the reference."""
    calls = []
    real = torch_paged.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append("causal" if kwargs.get("is_causal") else "mask")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_paged.F, "scaled_dot_product_attention", spy)
    # 200 * 200 cells over the area: the 200-token prompt goes in query chunks of 60, each its own group
    monkeypatch.setattr(torch_paged, "GROUP_MAX_AREA", 60 * 200)
    specs, heads, kv_heads, dim, bs = [(200, 200), (90, 40), (33, 20)], 6, 2, 64, 16
    for dtype in (torch.float32, torch.bfloat16):
        calls.clear()
        case = windowed_case(specs, window, heads, kv_heads, dim, bs, dtype) if window else \
            make_case(specs, heads, kv_heads, dim, bs, dtype, seed=4)
        groups = TorchPagedBackend.build_metadata(case[-1]).groups
        # only the prompt's first chunk starts at position 0
        assert sum(g.causal_from_zero for g in groups) == (0 if window else 1)
        assert all(g.num_reqs == 1 and g.q_len == 60 and g.kv_len == 64 for g in groups if g.causal_from_zero)
        assert sum(g.num_reqs == 1 and g.q_len == 60 for g in groups) >= 3  # the chunks after it: masked
        ref, _, _ = run_backend(TorchReferenceBackend, case, heads, kv_heads, dim, bs)
        out, _, _ = run_backend(TorchPagedBackend, case, heads, kv_heads, dim, bs)
        torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
        if dtype == torch.bfloat16:
            assert calls == []
        else:
            assert sorted(calls) == sorted("causal" if g.causal_from_zero else "mask" for g in groups)
            assert ("causal" in calls) is (window is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_few_new_tokens_attend_exactly_as_one_token_steps(dtype):
    """Speculative decoding verifies 1 + k tokens of a request in one step; each row must
    come out bit for bit as the one-token step at that position would compute it.  The
    native decode kernel (cpu_paged, head_dim 64) computes each row alone, so it does;
    torch_paged pads a group's rows to its longest context, which moves the last bits."""
    backend = CpuPagedBackend
    heads, kv_heads, dim, bs = 6, 2, 64, 16
    n = torch_paged.DECODE_ROWS_MAX_TOKENS
    case = make_case([(150, 1), (97, n), (40, 3)], heads, kv_heads, dim, bs, dtype, seed=11)
    q, k, v, _, _, common = case
    out, kc, vc = run_backend(backend, case, heads, kv_heads, dim, bs)
    row0 = 1  # the (97, n) request's first query row
    for j in range(n):
        seq_len = 97 - n + j + 1
        one = CommonAttentionMetadata(
            num_reqs=1, num_actual_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32), block_table=common.block_table[1:2],
            slot_mapping=common.slot_mapping[row0 + j: row0 + j + 1], query_start_loc_cpu=[0, 1],
            seq_lens_cpu=[seq_len], max_query_len=1, max_seq_len=seq_len, block_size=bs)
        impl = backend(heads, kv_heads, dim, dim**-0.5, bs)
        r = slice(row0 + j, row0 + j + 1)
        single = impl.forward(q[r], k[r], v[r], kc.clone(), vc.clone(), backend.build_metadata(one))
        assert torch.equal(single[0], out[row0 + j]), j


def windowed_case(specs, window, heads=6, kv_heads=2, dim=64, block_size=16, dtype=torch.float32, seed=3):
    """make_case with a sliding window: each request's blocks before its window are
    replaced by a NaN block (stale ids the runner keeps: reading one poisons the output)."""
    q, k, v, kc, vc, common = make_case(specs, heads, kv_heads, dim, block_size, dtype, seed)
    nan_id = kc.shape[0]
    kc, vc = (torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in (kc, vc))
    table = common.block_table.clone()
    for i, (s, n) in enumerate(specs):
        table[i, : max(0, s - n - window + 1) // block_size] = nan_id
    return q, k, v, kc, vc, dataclasses.replace(common, block_table=table, sliding_window=window)


@pytest.mark.parametrize("backend", [pytest.param(TorchReferenceBackend, id="torch_ref"), *BACKENDS])
def test_a_one_token_window_sees_only_itself(backend):
    """Window 1: every query attends to its own key only, so the output is its own value."""
    heads, kv_heads = 6, 2
    q, k, v, kc, vc, common = windowed_case(MIXED, 1, heads, kv_heads)
    out, _, _ = run_backend(backend, (q, k, v, kc, vc, common), heads, kv_heads, 64, 16)
    want = v[: common.num_actual_tokens].repeat_interleave(heads // kv_heads, dim=1)
    torch.testing.assert_close(out[: common.num_actual_tokens], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [5, 24, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_matches_reference(backend, window, dtype):
    """Decodes (the C++ kernel under cpu_paged), chunks and long prefills split into
    query chunks, each over its own window; never a block before it."""
    specs = MIXED + LONG[:2]
    case = windowed_case(specs, window, dtype=dtype)
    ref, _, _ = run_backend(TorchReferenceBackend, case, 6, 2, 64, 16)
    out, _, _ = run_backend(backend, case, 6, 2, 64, 16)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    if window == 4096:  # wider than every context: plain causal attention
        plain = make_case(specs, 6, 2, 64, 16, dtype, seed=3)
        torch.testing.assert_close(ref.float(), run_backend(TorchReferenceBackend, plain, 6, 2, 64, 16)[0].float())


def test_each_engine_thread_has_its_own_scratch() -> None:
    """Several models' engines step at once on their own threads: one scratch buffer
    shared by both would have each write into the other's gathered K/V."""
    import threading

    got, both = {}, threading.Barrier(2)

    def step(name: str) -> None:
        got[name] = torch_paged._WORKSPACE.get(64, torch.float32, torch.device("cpu")).data_ptr()
        both.wait(5)  # (both buffers alive: a freed one's address could be the other's)

    threads = [threading.Thread(target=step, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got["a"] != got["b"]
    mine = torch_paged._WORKSPACE.get(64, torch.float32, torch.device("cpu"))
    assert torch_paged._WORKSPACE.get(32, torch.float32, torch.device("cpu")).data_ptr() == mine.data_ptr()
