"""Triton paged-attention kernels against the torch reference backend.

Triton fixes interpreter-or-compiled when it is first imported (TRITON_INTERPRET=1
then), so this module picks its process:
  * no GPU and triton not yet imported: it sets TRITON_INTERPRET=1 before importing
    triton and runs the interpreter suite here on CPU tensors (the CI case);
  * otherwise (a GPU machine, or triton already imported compiled by an earlier
    module) the compiled GPU tests run here and the interpreter suite runs in a fresh
    python process, so neither mode leaks into the other or into other areas' tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install triton); the Triton backend needs it")

from pagedserve.attention.backend import CommonAttentionMetadata  # noqa: E402
from pagedserve.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagedserve.attention.triton_backend import (  # noqa: E402
    MIN_SPLIT_TOKENS,
    KernelConfig,
    TritonAttentionBackend,
    TritonAttentionMetadata,
    plan_num_splits,
)
from pagedserve.attention.triton_kernels import language_interpreted  # noqa: E402

INTERPRETED = language_interpreted()
ROOT = Path(__file__).resolve().parents[2]
interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="triton is compiled in this process: test_interpreter_suite_in_fresh_process runs these")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
GPU_TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                          reason="needs a CUDA GPU and triton in compiled mode (TRITON_INTERPRET unset)")


def make_batch(specs, heads, kv_heads, dim, block_size, dtype, seed, device="cpu", pad_tokens=0):
    """specs: [(seq_len, new_tokens)].  Prefix K/V goes straight into scattered cache
    blocks; every other cache slot holds NaN, so a kernel reading outside a request's
    context poisons its output."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-seq_len // block_size) for seq_len, _ in specs]
    num_blocks = 1 + sum(nblocks) + 2  # block 0 is the null block
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    block_table = torch.zeros(len(specs), max(nblocks), dtype=torch.int32)
    qsl, slots = [0], []
    for i, (seq_len, n) in enumerate(specs):
        blocks = [free.pop() for _ in range(nblocks[i])]
        block_table[i, : nblocks[i]] = torch.tensor(blocks, dtype=torch.int32)
        req_slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        prefix = seq_len - n
        flat_k[req_slots[:prefix]] = torch.randn(prefix, kv_heads, dim, generator=g).to(dtype)
        flat_v[req_slots[:prefix]] = torch.randn(prefix, kv_heads, dim, generator=g).to(dtype)
        slots.extend(req_slots[prefix:].tolist())
        qsl.append(qsl[-1] + n)
    rows = qsl[-1] + pad_tokens

    def rnd(h):
        return torch.randn(rows, h, dim, generator=g).to(dtype).to(device)

    seq_lens = [s for s, _ in specs]
    md = CommonAttentionMetadata(
        num_reqs=len(specs), num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
        max_query_len=max(n for _, n in specs), max_seq_len=max(seq_lens), block_size=block_size,
    )
    return rnd(heads), rnd(kv_heads), rnd(kv_heads), k_cache.to(device), v_cache.to(device), md


def check(specs, heads=4, kv_heads=2, dim=32, block_size=16, dtype=torch.float32, seed=0, device="cpu",
          tiles=None, num_splits=None, pad_tokens=0, tol=TOL, window=None):
    """Run reference and Triton on identical copies; outputs and caches must agree and
    every output element must be overwritten (the output starts as NaN)."""
    q, k, v, kc, vc, common = make_batch(specs, heads, kv_heads, dim, block_size, dtype, seed, device, pad_tokens)
    common.sliding_window = window
    scale = dim**-0.5
    ref = TorchReferenceBackend(heads, kv_heads, dim, scale, block_size)
    tri = TritonAttentionBackend(heads, kv_heads, dim, scale, block_size)
    if tiles:
        tri.config = tiles
    kc2, vc2 = kc.clone(), vc.clone()
    expected = ref.forward(q, k, v, kc, vc, common)
    md = TritonAttentionBackend.build_metadata(common)
    md.num_splits = num_splits
    out = torch.full_like(q, float("nan"))
    got = tri.forward(q, k, v, kc2, vc2, md, output=out)
    assert got is out
    assert not got.isnan().any(), "output elements left unwritten or NaN read from outside a context"
    torch.testing.assert_close(got.float(), expected.float(), **tol[dtype])
    torch.testing.assert_close(kc2, kc, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc2, vc, atol=0, rtol=0, equal_nan=True)
    return md


# ---------------------------------------------------------------- interpreter (CPU)

SMALL = KernelConfig(decode_block_n=16, extend_block_m=32, extend_block_n=16)  # many tiles per request


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_only(dtype, heads, kv_heads, block_size):
    specs = [(37, 1), (1, 1), (100, 1), (block_size, 1), (block_size + 1, 1)]
    check(specs, heads, kv_heads, block_size=block_size, dtype=dtype, seed=block_size + heads + kv_heads)
    check(specs, heads, kv_heads, block_size=block_size, dtype=dtype, seed=7, tiles=SMALL)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,block_size", [(4, 2, 16), (4, 1, 32)])
def test_prefill_with_cached_prefix(dtype, heads, kv_heads, block_size):
    # (context, new): fresh prompts, prefix hits ending mid-block and on a block edge, a 2-token chunk.
    specs = [(40, 40), (70, 23), (64, 32), (97, 2), (17, 17)]
    check(specs, heads, kv_heads, block_size=block_size, dtype=dtype, seed=11)
    check(specs, heads, kv_heads, block_size=block_size, dtype=dtype, seed=12, tiles=SMALL)


@interpreter
@pytest.mark.parametrize("window", [1, 20, 48])
def test_sliding_window(window):
    """Decodes (split or not) and extends over a window that starts mid-tile, so a row's
    first tiles can hold no visible key."""
    specs = [(50, 1), (60, 25), (9, 1), (33, 33), (130, 1), (48, 3)]
    check(specs, 4, 2, block_size=16, seed=31, window=window)
    check(specs, 4, 1, block_size=16, seed=32, window=window, tiles=SMALL, num_splits=4)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_writes_every_element(dtype):
    # Decodes interleaved with extends, plus 3 padded rows past num_actual_tokens (must come back 0).
    specs = [(50, 1), (60, 25), (9, 1), (33, 33), (130, 1), (48, 3)]
    check(specs, 4, 2, block_size=16, dtype=dtype, seed=21, pad_tokens=3)
    check(specs, 4, 1, block_size=32, dtype=dtype, seed=22, pad_tokens=3, tiles=SMALL)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_long_context(dtype):
    specs = [(700, 1), (40, 1), (1, 1), (513, 1)]
    for splits in (3, 8):  # 8 splits of the short contexts leave empty splits to merge
        md = check(specs, 4, 2, dtype=dtype, seed=30 + splits, num_splits=splits, tiles=SMALL)
        assert md.num_splits == splits
    # Left to the policy (4 simulated SMs on CPU): 2 long decodes x 2 KV heads get split.
    assert plan_num_splits(2, 2, 700, num_sms=4) == 2
    md = check([(700, 1), (513, 1)], 4, 2, dtype=dtype, seed=33)
    assert md.num_splits is None and list(md._scratch) == [(4, 2, 32)]


@interpreter
@pytest.mark.parametrize("num_splits", [1, 4])
def test_graph_padding_rows(num_splits):
    """A CUDA-graph decode batch padded with fake requests (seq_len 0, slot -1, split
    count pinned): real rows match the reference, padded rows come back zero, and
    the padded tokens write nothing to the cache."""
    q, k, v, kc, vc, common = make_batch([(30, 1), (70, 1)], 4, 2, 32, 16, torch.bfloat16, seed=80)
    kc2, vc2 = kc.clone(), vc.clone()
    expected = TorchReferenceBackend(4, 2, 32, 32**-0.5, 16).forward(q, k, v, kc, vc, common)
    pad = 2
    qp, kp, vp = (torch.cat([x, torch.randn(pad, *x.shape[1:]).to(x.dtype)]) for x in (q, k, v))
    padded = CommonAttentionMetadata(
        num_reqs=2 + pad, num_actual_tokens=2 + pad,
        query_start_loc=torch.arange(3 + pad, dtype=torch.int32),
        seq_lens=torch.tensor([30, 70] + [0] * pad, dtype=torch.int32),
        block_table=torch.cat([common.block_table, torch.zeros(pad, common.block_table.shape[1], dtype=torch.int32)]),
        slot_mapping=torch.cat([common.slot_mapping, torch.full((pad,), -1)]),
        query_start_loc_cpu=list(range(3 + pad)), seq_lens_cpu=[30, 70] + [0] * pad,
        max_query_len=1, max_seq_len=70, block_size=16,
    )
    md = TritonAttentionBackend.build_metadata(padded)
    md.num_splits = num_splits
    out = torch.full_like(qp, float("nan"))
    TritonAttentionBackend(4, 2, 32, 32**-0.5, 16).forward(qp, kp, vp, kc2, vc2, md, output=out)
    torch.testing.assert_close(out[:2].float(), expected.float(), **TOL[torch.bfloat16])
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    torch.testing.assert_close(kc2, kc, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc2, vc, atol=0, rtol=0, equal_nan=True)


def check_narrow_cache(cache_dtype: torch.dtype, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    """Queries in `dtype` over a narrower cache (kv_cache_dtype): the kernels read the stored
    values as the reference does, and store the new K/V converted exactly as it does."""
    from pagedserve.attention import kv_dtype

    specs = [(37, 1), (100, 1), (70, 23), (17, 17), (160, 1)]
    q, k, v, kc, vc, common = make_batch(specs, 4, 2, 32, 16, dtype, seed=5, device=device)
    kc, vc = kv_dtype.to_cache(kc, cache_dtype), kv_dtype.to_cache(vc, cache_dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    expected = TorchReferenceBackend(4, 2, 32, 32**-0.5, 16).forward(q, k, v, kc, vc, common)
    out = torch.full_like(q, float("nan"))
    got = TritonAttentionBackend(4, 2, 32, 32**-0.5, 16).forward(q, k, v, kc2, vc2,
                                                                   TritonAttentionBackend.build_metadata(common),
                                                                   output=out)
    torch.testing.assert_close(got.float(), expected.float(), **(TOL if device == "cpu" else GPU_TOL)[dtype])
    assert torch.equal(kc2.view(torch.uint8), kc.view(torch.uint8))  # (bytes: the untouched slots are NaN)


@interpreter
def test_float32_queries_over_a_float16_cache():
    """(bfloat16 and float8 caches run on the GPU, test_gpu_narrow_kv_caches: the interpreter
    converts float32 to bfloat16 by truncation, and numpy has no float8.)"""
    check_narrow_cache(torch.float16)


def test_int8_kv_is_refused_by_name(tmp_path):
    """int8 rows carry their scale inline; these kernels do not read them: refused at start-up."""
    from pagedserve import LLM
    from tests.e2e.conftest import make_tiny_checkpoint

    make_tiny_checkpoint("llama", str(tmp_path))
    with pytest.raises(ValueError, match="kv_cache_dtype='int8': the triton attention backend cannot read it"):
        LLM(str(tmp_path), attention_backend="triton", kv_cache_dtype="int8", device="cpu")


@interpreter
def test_odd_group_and_head_dim():
    # GQA group 3 and head_dim 24: exercises every row/column mask.
    check([(45, 1), (50, 13), (19, 19)], heads=6, kv_heads=2, dim=24, block_size=16, seed=40)
    check([(45, 1), (50, 13), (19, 19)], heads=6, kv_heads=2, dim=24, block_size=16, seed=41, tiles=SMALL)


@interpreter
def test_store_skips_padded_slots():
    q, k, v, kc, vc, common = make_batch([(20, 8)], 2, 2, 16, 16, torch.float32, seed=50)
    common.slot_mapping[[1, 5]] = -1
    kc0 = kc.clone()
    TritonAttentionBackend(2, 2, 16, 0.25, 16).forward(q, k, v, kc, vc, common)
    flat, flat0 = kc.view(-1, 2, 16), kc0.view(-1, 2, 16)
    for t, slot in enumerate(common.slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], k[t])
    changed = (~(flat.isnan() & flat0.isnan()) & (flat != flat0)).any(-1).any(-1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(s for s in common.slot_mapping.tolist() if s >= 0)


def test_plan_num_splits():
    assert plan_num_splits(0, 8, 4096, 132) == 1
    assert plan_num_splits(256, 8, 4096, 132) == 1  # the batch alone fills the GPU
    assert plan_num_splits(1, 8, MIN_SPLIT_TOKENS - 1, 132) == 1  # too short to be worth it
    many = plan_num_splits(1, 8, 32768, 132)
    assert 1 < many <= 16 and many & (many - 1) == 0  # a power of two: few kernel variants
    assert plan_num_splits(1, 8, 3 * MIN_SPLIT_TOKENS, 132) == 2
    assert plan_num_splits(1, 8, 2 * MIN_SPLIT_TOKENS, 132) == 2  # each split keeps >= MIN_SPLIT_TOKENS


def test_metadata_split_decode_and_extend():
    _, _, _, _, _, common = make_batch([(5, 1), (9, 4), (3, 1), (7, 7)], 2, 1, 16, 16, torch.float32, 0)
    md = TritonAttentionBackend.build_metadata(common)
    assert isinstance(md, TritonAttentionMetadata)
    assert md.num_decodes == 2 and md.decode_reqs.tolist() == [0, 2] and md.max_decode_seq_len == 5
    assert md.extend_reqs == [1, 3]
    tile_req, tile_q0, n = md.extend_tiles(2)
    assert n == 2 + 4  # 4 new tokens -> 2 tiles, 7 -> 4 tiles
    assert sorted(zip(tile_req.tolist(), tile_q0.tolist(), strict=True)) == [(1, 0), (1, 2), (3, 0), (3, 2), (3, 4), (3, 6)]


@interpreter
def test_bad_inputs_raise_value_error():
    q, k, v, kc, vc, common = make_batch([(10, 2)], 4, 2, 16, 16, torch.float32, seed=60)
    tri = TritonAttentionBackend(4, 2, 16, 0.25, 16)
    with pytest.raises(ValueError, match="key must be"):
        tri.forward(q, k[:, :1], v, kc, vc, common)
    with pytest.raises(ValueError, match="k_cache must be"):
        tri.forward(q, k, v, kc[:, :8], vc, common)
    with pytest.raises(ValueError, match="metadata of type"):
        tri.forward(q, k, v, kc, vc, {"not": "metadata"})
    with pytest.raises(ValueError, match="not a multiple"):
        TritonAttentionBackend(3, 2, 16, 0.25, 16).forward(q[:, :3], k, v, kc, vc, common)
    common.query_start_loc_cpu = [0, 20]
    with pytest.raises(ValueError, match="new tokens but seq_len"):
        TritonAttentionBackend.build_metadata(common)


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=full_env)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter suite runs in this process")
def test_interpreter_suite_in_fresh_process():
    res = _run(f"import sys, pytest; sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', {str(Path(__file__))!r}]))",
               TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


def test_cpu_tensors_need_the_interpreter():
    """Compiled mode (no TRITON_INTERPRET) with CPU tensors: a clear ValueError."""
    code = (
        "import torch, pytest\n"
        "from pagedserve.attention.triton_backend import TritonAttentionBackend as B\n"
        "z = torch.zeros\n"
        "with pytest.raises(ValueError, match='needs CUDA tensors'):\n"
        "    B(2, 2, 16, 0.25, 16).forward(z(1, 2, 16), z(1, 2, 16), z(1, 2, 16), z(3, 16, 2, 16),\n"
        "                                  z(3, 16, 2, 16), None)\n"
        "print('ok')\n"
    )
    res = _run(code, CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]


@interpreter
def test_bench_kernels_dry_run(tmp_path):
    """The GPU benchmark's plumbing (batches, peers, reporting, sweep) on tiny CPU cases."""
    import json

    from pagedserve.benchmarks import bench_kernels

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            bench_kernels.main([])
    out = tmp_path / "rows.json"
    bench_kernels.main(["--dry-run", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    impls = {(r["case"].split()[0], r["impl"]) for r in rows}
    assert {("store", "triton"), ("decode", "triton decode"), ("extend", "triton extend"),
            ("mixed", "triton forward"), ("decode", "torch_ref")} <= impls
    assert all(float(r["maxdiff"]) < 3e-2 for r in rows if "maxdiff" in r)
    bench_kernels.main(["--dry-run", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dtype", "float32",
                        "--only", "decode", "--sweep"])


_SM90_COMPILE = """
import inspect
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve.attention.triton_backend import default_config
from pagedserve.attention.triton_kernels import get_kernels
k = get_kernels()
assert not k.interpreted


def build(fn, dt, **consts):
    sig = {n: "constexpr" if n in consts else ("*" + dt if n in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr",
           "key_ptr", "value_ptr") else "*fp32" if n.startswith("part_") else "*i64" if n == "slot_mapping_ptr"
           else "*i32" if n.endswith("_ptr") else "fp32" if n == "scale_log2e" else "i32")
           for n in inspect.signature(fn.fn).parameters}
    # What the JIT infers for real launches: 16-aligned pointers and strides (the block table's aside).
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t.startswith("*") or (n.startswith("stride") and n != "stride_bt")}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


build(k.store_kv_kernel, "bf16", NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128)
build(k.decode_reduce_kernel, "bf16", NUM_HEADS=16, HEAD_DIM=128, NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=128)
for dtype, dt, prec in ((torch.bfloat16, "bf16", "tf32"), (torch.float32, "fp32", "tf32x3")):
    cfg = default_config(dtype, 128)
    build(k.decode_kernel, dt, NUM_HEADS=16, GROUP=2, HEAD_DIM=128, CACHE_BLOCK=16, BLOCK_G=16, BLOCK_D=128,
          BLOCK_N=cfg.decode_block_n, NUM_SPLITS=4, UPCAST=False, DOT_PREC=prec)
    build(k.extend_kernel, dt, GROUP=2, HEAD_DIM=128, CACHE_BLOCK=16, BLOCK_M=cfg.extend_block_m,
          BLOCK_Q=cfg.extend_block_m // 2, BLOCK_D=128, BLOCK_N=cfg.extend_block_n, UPCAST=False, DOT_PREC=prec)
print("ok")
"""


def test_kernels_compile_for_sm90():
    """Lowering to an H100 binary needs no GPU: this catches what the interpreter
    tolerates but the compiler rejects (types, constexpr branches, dot shapes)."""
    res = _run(_SM90_COMPILE, CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-4000:]


def test_importable_without_triton():
    """The selector imports the backend module to test for triton: without triton that
    must be a plain ImportError, and the rest of pagedserve.attention must still load."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import pagedserve.attention.torch_ref\n"
        "try:\n    import pagedserve.attention.triton_backend\nexcept ImportError as e:\n    print('ok', e)\n"
    )
    res = _run(code)
    assert res.returncode == 0 and res.stdout.startswith("ok"), res.stderr


# ---------------------------------------------------------------- compiled kernels (CUDA)


@cuda
@pytest.mark.parametrize(("dtype", "cache_dtype"), [
    (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float8_e4m3fn)], ids=str)
def test_gpu_narrow_kv_caches(dtype, cache_dtype):
    check_narrow_cache(cache_dtype, dtype, "cuda")


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_realistic(dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    decodes = [(int(n), 1) for n in torch.randint(1, 4096, (48,), generator=gen)]
    extends = [(1500, 500), (700, 700), (4000, 37), (130, 2)]
    kw = dict(heads=16, kv_heads=8, dim=128, block_size=block_size, dtype=dtype, device="cuda", tol=GPU_TOL)
    check(decodes + extends, seed=1, pad_tokens=5, **kw)  # mixed batch, planned splits
    check(decodes[:4], seed=2, num_splits=8, **kw)  # forced split-KV
    check(extends, seed=3, heads=32, kv_heads=4, **{k: v for k, v in kw.items() if "heads" not in k})
