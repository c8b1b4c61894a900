"""Time one decode step's attention (all layers) of a backend against contiguous math.

The yardstick is what attention costs with no paging at all: K/V already laid out
contiguously per sequence, GQA folded into the rows, two batched matmuls and a
softmax per layer.  The paged
figure includes everything a real step pays: metadata built once, then per layer
the K/V store by slot mapping, the gather and the attention.

usage: python -m pagedserve.benchmarks.bench_attention [--backend cpu_paged] [--batch 32] [--ctx 150]
         [--heads 9] [--kv-heads 3] [--head-dim 64] [--layers 30] [--block-size 16] [--dtype bfloat16]
         [--threads N] [--cpu-time] [--kernel-isa native|avx2|plain]

`--kernel-isa` builds cpu_paged's C++ kernel for a lesser instruction set than the
machine's (avx2: AVX-512 disabled; plain: AVX2/FMA disabled too), to compare the
paths a CPU without AVX-512 gets; `--kernel-source FILE` builds another version of
the kernel's source (e.g. one from git history) the same way.  `--layers 1` keeps K/V
cache-resident (the arithmetic), the default 30 distinct layer caches do not (memory).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from pagedserve.attention.backend import CommonAttentionMetadata
from pagedserve.attention.cpu_paged import SOURCE as KERNEL_SOURCE
from pagedserve.attention.cpu_paged import CpuPagedBackend
from pagedserve.attention.cpu_paged import build as build_kernel
from pagedserve.attention.selector import get_attn_backend
from pagedserve.cpu_info import describe_cpu
from pagedserve.utils import cdiv

KERNEL_ISA_CFLAGS = {"native": (), "avx2": ("-mno-avx512f",), "plain": ("-mno-avx512f", "-mno-avx2", "-mno-fma")}


def _best_of(fns, reps: int, rounds: int = 5, clock=time.perf_counter) -> list[float]:
    """Fastest mean over `rounds` rounds, the candidates interleaved so that load from
    other processes on a shared machine hits them alike.  With one thread,
    `time.process_time` (CPU time) also discounts the time the process waited for a core."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = clock()
            for _ in range(reps):
                fn()
            best[i] = min(best[i], (clock() - t) / reps)
    return best


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cpu_paged")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=150)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cpu-time", action="store_true", help="time by CPU time (use with --threads 1)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kernel-isa", choices=sorted(KERNEL_ISA_CFLAGS), default="native",
                    help="instruction set of cpu_paged's C++ kernel (default: this machine's)")
    ap.add_argument("--kernel-source", type=Path, default=None,
                    help="build cpu_paged's kernel from this .cpp instead of the package's")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dt, b, ctx, bs = getattr(torch, a.dtype), a.batch, a.ctx, a.block_size
    hkv, d, grp = a.kv_heads, a.head_dim, a.heads // a.kv_heads
    nblk = cdiv(ctx, bs)
    pool = max(2048, 2 * b * nblk + 1)
    torch.manual_seed(0)
    block_table = (torch.randperm(pool - 1)[: b * nblk] + 1).view(b, nblk).int()
    slot_mapping = (block_table[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs)
    common = CommonAttentionMetadata(
        num_reqs=b, num_actual_tokens=b, query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens=torch.full((b,), ctx, dtype=torch.int32), block_table=block_table,
        slot_mapping=slot_mapping, query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[ctx] * b,
        max_query_len=1, max_seq_len=ctx, block_size=bs,
    )
    cls = get_attn_backend(a.backend, "cpu")
    impl = cls(a.heads, hkv, d, d**-0.5, bs)
    if (a.kernel_isa != "native" or a.kernel_source) and isinstance(impl, CpuPagedBackend):
        impl.decode_kernel = build_kernel(KERNEL_ISA_CFLAGS[a.kernel_isa], a.kernel_source or KERNEL_SOURCE)
    caches = [tuple(torch.randn(pool, bs, hkv, d, dtype=dt) for _ in range(2)) for _ in range(a.layers)]
    q, k, v = (torch.randn(b, h, d, dtype=dt) for h in (a.heads, hkv, hkv))
    cont = [tuple(torch.randn(b, hkv, ctx, d, dtype=dt) for _ in range(2)) for _ in range(a.layers)]

    def paged_step():
        metadata = cls.build_metadata(common)
        for kc, vc in caches:
            impl.forward(q, k, v, kc, vc, metadata)

    seq_lens = common.seq_lens

    def kernel_step():  # cpu_paged's C++ kernel alone: no K/V store, no planning
        for kc, vc in caches:
            impl.decode_kernel(q, kc, vc, block_table, seq_lens, impl.scale)

    def contiguous_step():
        qf = q.view(b, hkv, grp, d)
        for kc, vc in cont:
            s = torch.matmul(qf, kc.transpose(-1, -2)) * impl.scale
            torch.matmul(s.softmax(-1), vc)

    has_kernel = isinstance(impl, CpuPagedBackend) and impl.decode_kernel is not None
    with torch.inference_mode():
        clock = time.process_time if a.cpu_time else time.perf_counter
        steps = [paged_step, contiguous_step] + ([kernel_step] if has_kernel else [])
        paged, contiguous, *kernel_only = _best_of(steps, a.reps, clock=clock)
    kernel = f", kernel {a.kernel_isa}{' from ' + str(a.kernel_source) if a.kernel_source else ''}" if has_kernel else ""
    print(f"CPU: {describe_cpu()}")
    print(f"{a.backend}{kernel}: {paged * 1e3:.2f} ms per {a.layers}-layer decode step "
          f"(B={b}, ctx={ctx}, {a.heads}/{hkv} heads x {d}, block {bs}, {a.dtype}, {torch.get_num_threads()} threads)")
    if kernel_only:
        print(f"  of which the C++ kernel alone: {kernel_only[0] * 1e3:.2f} ms")
    print(f"contiguous math: {contiguous * 1e3:.2f} ms; ratio {paged / contiguous:.2f}")
    return {"paged_ms": paged * 1e3, "contiguous_ms": contiguous * 1e3,
            **({"kernel_ms": kernel_only[0] * 1e3} if kernel_only else {})}


if __name__ == "__main__":
    main()
