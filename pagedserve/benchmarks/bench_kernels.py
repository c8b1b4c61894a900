"""Kernel benchmark for the Triton paged-attention backend (needs a CUDA GPU and triton).

    python -m pagedserve.benchmarks.bench_kernels                 # Qwen3-0.6B shapes, bf16
    python -m pagedserve.benchmarks.bench_kernels --sweep --json kernels.json

Each case times (median, L2 flushed between runs: triton.testing.do_bench) the
Triton kernel, the torch reference backend on the same paged batch, and torch SDPA
on dense uniform-length K/V (no paging, no gather: the best torch can do).  Bytes
are the least each case must move (K/V of every context read once, q/out, new K/V);
GB/s is compared with this device's copy bandwidth measured here (read + write,
or --peak-gbps).  Extend also reports TFLOP/s against a measured bf16 matmul.
--sweep retimes the Triton cases over tile configs and split counts, to tune
KernelConfig and plan_num_splits in pagedserve/attention/triton_backend.py.
--dry-run runs tiny cases on CPU through the Triton interpreter (TRITON_INTERPRET=1)
with one untimed-quality run each: it checks the script, not the kernels' speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from pagedserve.attention.backend import CommonAttentionMetadata
from pagedserve.attention.kv_dtype import store as store_kv_cache
from pagedserve.attention.torch_ref import TorchReferenceBackend
from pagedserve.platforms import is_cuda
from pagedserve.utils import cdiv

CASES = dict(
    store=[256, 8192],  # new tokens
    # (requests, context); the 256-request rows are W1's decode steps (contexts 100..2048)
    decode=[(1, 4096), (8, 4096), (32, 8192), (64, 1024), (256, 512), (256, 1024), (256, 2048)],
    extend=[(1, 0, 4096), (8, 0, 1024), (4, 2048, 512), (16, 1000, 64)],  # (requests, cached prefix, new)
    mixed=([(600, 1)] * 200, [(512, 512), (1536, 512)]),  # W1-like step: decodes + two prompt chunks
)
DRY_CASES = dict(store=[8], decode=[(2, 40)], extend=[(2, 8, 24), (1, 0, 16)], mixed=([(20, 1)] * 3, [(30, 10)]))


def _fail(msg: str) -> None:
    raise SystemExit(f"bench_kernels: {msg}")


def _once(fn, **_) -> float:
    """--dry-run's stand-in for do_bench: one call, wall milliseconds."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        if not args.dry_run and not torch.cuda.is_available():
            _fail("needs a CUDA GPU (torch.cuda.is_available() is False); the kernels it times run only there "
                  "(--dry-run checks the script on CPU through the Triton interpreter)")
        try:
            from triton.testing import do_bench

            from pagedserve.attention.triton_backend import KernelConfig, TritonAttentionBackend
            from pagedserve.attention.triton_kernels import language_interpreted
        except ImportError as e:
            _fail(f"needs triton ({e}); pip install triton")
        if args.dry_run:
            if not language_interpreted():
                _fail("--dry-run needs TRITON_INTERPRET=1 set before triton is imported")
            self.dev, self.do_bench = torch.device("cpu"), _once
        else:
            self.dev, self.do_bench = torch.device("cuda"), do_bench
        self.KernelConfig = KernelConfig
        self.a, self.dtype = args, getattr(torch, args.dtype)
        self.elt = torch.finfo(self.dtype).bits // 8
        h, hkv, d = args.heads, args.kv_heads, args.head_dim
        scale = d**-0.5
        self.tri = TritonAttentionBackend(h, hkv, d, scale, args.block_size)
        self.ref = TorchReferenceBackend(h, hkv, d, scale, args.block_size)
        self.rows: list[dict] = []
        self.copy_gbps = args.peak_gbps or self._copy_gbps()
        self.mm_tflops = self._matmul_tflops()
        print(f"{self.device_name()}: copy {self.copy_gbps:,.0f} GB/s (read+write), "
              f"{args.dtype} matmul {self.mm_tflops:,.0f} TFLOP/s; heads {h}/{hkv}, head_dim {d}, "
              f"block {args.block_size}")

    def device_name(self) -> str:
        return torch.cuda.get_device_name() if is_cuda(self.dev) else "cpu (dry run, interpreter)"

    def time_ms(self, fn) -> float:
        return self.do_bench(fn, warmup=10, rep=self.a.rep_ms, return_mode="median")

    def _copy_gbps(self) -> float:
        x = torch.empty(1 << (20 if self.a.dry_run else 30), dtype=torch.uint8, device=self.dev)
        y = torch.empty_like(x)
        return 2 * x.numel() / self.time_ms(lambda: y.copy_(x)) / 1e6

    def _matmul_tflops(self) -> float:
        n = 256 if self.a.dry_run else 8192
        a = torch.randn(n, n, dtype=self.dtype, device=self.dev)
        b = torch.randn(n, n, dtype=self.dtype, device=self.dev)
        return 2 * n**3 / self.time_ms(lambda: a @ b) / 1e9

    def batch(self, specs: list[tuple[int, int]]):
        """A paged batch: specs [(context, new tokens)], blocks scattered over the pool."""
        a, bs, dev = self.a, self.a.block_size, self.dev
        nblocks = [cdiv(ctx, bs) for ctx, _ in specs]
        perm = torch.randperm(sum(nblocks), device=dev, dtype=torch.int32) + 1  # block 0: null
        table = torch.zeros(len(specs), max(nblocks), dtype=torch.int32, device=dev)
        slots, start = [], 0
        for i, ((ctx, n), nb) in enumerate(zip(specs, nblocks, strict=True)):
            table[i, :nb] = perm[start:start + nb]
            start += nb
            pos = torch.arange(ctx - n, ctx, device=dev)
            slots.append(table[i, pos // bs].long() * bs + pos % bs)
        shape = (sum(nblocks) + 1, bs, a.kv_heads, a.head_dim)
        kc, vc = (torch.randn(shape, dtype=self.dtype, device=dev) for _ in range(2))
        qsl = [0]
        for _, n in specs:
            qsl.append(qsl[-1] + n)
        t = qsl[-1]
        q = torch.randn(t, a.heads, a.head_dim, dtype=self.dtype, device=dev)
        k, v = (torch.randn(t, a.kv_heads, a.head_dim, dtype=self.dtype, device=dev) for _ in range(2))
        seq_lens = [ctx for ctx, _ in specs]
        common = CommonAttentionMetadata(
            num_reqs=len(specs), num_actual_tokens=t,
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev), block_table=table,
            slot_mapping=torch.cat(slots), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            max_query_len=max(n for _, n in specs), max_seq_len=max(seq_lens), block_size=bs,
        )
        return q, k, v, kc, vc, common

    def report(self, case: str, impl: str, ms: float, nbytes: float, flops: float = 0.0, **extra) -> None:
        """One timing against its floor: the bytes at the measured copy bandwidth, or the
        FLOPs at the measured matmul rate, whichever takes longer."""
        gbps = nbytes / ms / 1e6
        floor_us = max(nbytes / self.copy_gbps / 1e3, flops / self.mm_tflops / 1e6)
        row = dict(case=case, impl=impl, us=ms * 1e3, gbps=gbps, pct_copy=100 * gbps / self.copy_gbps,
                   floor_us=floor_us, pct_floor=100 * floor_us / (ms * 1e3),
                   tflops=flops / ms / 1e9 if flops else None, **extra)
        self.rows.append(row)
        tf = f"{row['tflops']:8.1f}" if flops else " " * 8
        more = " ".join(f"{k}={v}" for k, v in extra.items())
        print(f"{case:34s} {impl:22s} {row['us']:10.1f} {floor_us:9.1f} {row['pct_floor']:6.1f}% {gbps:9.0f} "
              f"{row['pct_copy']:6.1f}% {tf}  {more}")

    def kv_bytes(self, tokens: int) -> int:
        return 2 * tokens * self.a.kv_heads * self.a.head_dim * self.elt

    def qo_bytes(self, tokens: int) -> int:
        return 2 * tokens * self.a.heads * self.a.head_dim * self.elt

    def check(self, out, q, k, v, kc, vc, common) -> str:
        ref = self.ref.forward(q, k, v, kc, vc, common)
        return f"{(out.float() - ref.float()).abs().max().item():.2e}"

    # ------------------------------------------------------------------ cases

    def store(self, t: int) -> None:
        q, k, v, kc, vc, common = self.batch([(t, t)])
        nbytes = 2 * self.kv_bytes(t) + 8 * t  # read new K/V, write them, read slots
        case = f"store T={t}"
        self.report(case, "triton", self.time_ms(lambda: self.tri.store_kv(k, v, kc, vc, common.slot_mapping, t)),
                    nbytes)
        self.report(case, "torch index_copy_", self.time_ms(
            lambda: store_kv_cache(k, v, kc, vc, common.slot_mapping)), nbytes)

    def decode(self, b: int, ctx: int) -> None:
        q, k, v, kc, vc, common = self.batch([(ctx, 1)] * b)
        metadata = self.tri.build_metadata(common)
        out = torch.empty_like(q)
        nbytes = self.kv_bytes(b * ctx) + self.qo_bytes(b)
        case = f"decode B={b} ctx={ctx}"
        self.tri.forward(q, k, v, kc, vc, metadata, output=out)
        err = self.check(out, q, k, v, kc, vc, common)
        self.report(case, "triton decode", self.time_ms(lambda: self.tri.decode(q, kc, vc, metadata, out)), nbytes,
                    maxdiff=err)
        self.report(case, "triton forward", self.time_ms(lambda: self.tri.forward(q, k, v, kc, vc, metadata, output=out)),
                    nbytes + self.kv_bytes(b) * 2)
        self.report(case, "torch_ref", self.time_ms(lambda: self.ref.forward(q, k, v, kc, vc, common)), nbytes)
        qd = q.view(b, 1, self.a.heads, -1).transpose(1, 2)
        kd, vd = (torch.randn(b, self.a.kv_heads, ctx, self.a.head_dim, dtype=self.dtype, device=self.dev)
                  for _ in range(2))
        self._sdpa(case, qd, kd, vd, nbytes, causal=None)
        if self.a.sweep:
            self._sweep(case, nbytes, 0.0, lambda: self.tri.decode(q, kc, vc, metadata, out), decode=True, metadata=metadata)

    def extend(self, b: int, prefix: int, n: int) -> None:
        ctx = prefix + n
        q, k, v, kc, vc, common = self.batch([(ctx, n)] * b)
        metadata = self.tri.build_metadata(common)
        out = torch.empty_like(q)
        a = self.a
        nbytes = self.kv_bytes(b * ctx) + self.qo_bytes(b * n)
        flops = 4 * a.heads * a.head_dim * b * (n * prefix + n * (n + 1) / 2)
        case = f"extend B={b} prefix={prefix} new={n}"
        self.tri.forward(q, k, v, kc, vc, metadata, output=out)
        err = self.check(out, q, k, v, kc, vc, common)
        self.report(case, "triton extend", self.time_ms(lambda: self.tri.extend(q, kc, vc, metadata, out)), nbytes,
                    flops, maxdiff=err)
        self.report(case, "torch_ref", self.time_ms(lambda: self.ref.forward(q, k, v, kc, vc, common)), nbytes, flops)
        qd = q.view(b, n, a.heads, -1).transpose(1, 2)
        kd, vd = (torch.randn(b, a.kv_heads, ctx, a.head_dim, dtype=self.dtype, device=self.dev) for _ in range(2))
        self._sdpa(case, qd, kd, vd, nbytes, flops, causal=(n, ctx))
        if self.a.sweep:
            self._sweep(case, nbytes, flops, lambda: self.tri.extend(q, kc, vc, metadata, out), decode=False, metadata=metadata)

    def mixed(self, decodes: list[tuple[int, int]], extends: list[tuple[int, int]]) -> None:
        specs = decodes + extends
        q, k, v, kc, vc, common = self.batch(specs)
        out = torch.empty_like(q)
        ctx = sum(c for c, _ in specs)
        nbytes = self.kv_bytes(ctx) + self.qo_bytes(common.num_actual_tokens)
        case = f"mixed {len(decodes)} decodes + {len(extends)} chunks"
        t0 = time.perf_counter()
        for _ in range(20):
            metadata = self.tri.build_metadata(common)
        host_us = (time.perf_counter() - t0) / 20 * 1e6
        self.tri.forward(q, k, v, kc, vc, metadata, output=out)
        err = self.check(out, q, k, v, kc, vc, common)
        self.report(case, "triton forward", self.time_ms(lambda: self.tri.forward(q, k, v, kc, vc, metadata, output=out)),
                    nbytes, maxdiff=err, build_metadata_us=f"{host_us:.0f}")
        self.report(case, "torch_ref", self.time_ms(lambda: self.ref.forward(q, k, v, kc, vc, common)), nbytes)

    def _sdpa(self, case, q, k, v, nbytes, flops=0.0, causal=None) -> None:
        """Dense peer: uniform lengths, contiguous K/V.  GQA through enable_gqa where the
        chosen SDPA kernel takes it, else with K/V heads expanded before timing."""
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        mask, is_causal = None, False
        if causal is not None:
            n, ctx = causal
            if n == ctx:
                is_causal = True
            else:
                mask = causal_lower_right(n, ctx)
        group = self.a.heads // self.a.kv_heads
        for label, kk, vv, kw in (
            ("sdpa dense (gqa)", k, v, dict(enable_gqa=group > 1)),
            ("sdpa dense (heads expanded)", k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), {}),
        ):
            def fn(kk=kk, vv=vv, kw=kw):
                return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=is_causal, **kw)
            try:
                fn()
            except RuntimeError as e:
                print(f"{case:34s} {label:22s} not supported here: {str(e).splitlines()[0][:80]}")
                continue
            self.report(case, label, self.time_ms(fn), nbytes, flops)
            return

    def _sweep(self, case, nbytes, flops, fn, decode: bool, metadata) -> None:
        """Retime one case over tile configs (and split counts for decode); print the best."""
        KC, default = self.KernelConfig, self.tri.config
        if decode:
            cands = [dict(decode_block_n=bn, decode_warps=w, decode_stages=s)
                     for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
        else:
            cands = [dict(extend_block_m=bm, extend_block_n=bn, extend_warps=w, extend_stages=s)
                     for bm in (64, 128) for bn in (32, 64) for w in (4, 8) for s in (2, 3)]
        results = []
        for c in cands:
            self.tri.config = dataclasses.replace(default or KC(), **c)
            try:
                results.append((self.time_ms(fn), c))
            except Exception as e:  # a config that does not fit (shared memory, registers) is skipped
                print(f"  sweep {c}: {type(e).__name__}")
        self.tri.config = default
        if decode:
            for splits in (1, 2, 4, 8, 16):
                metadata.num_splits = splits
                results.append((self.time_ms(fn), dict(num_splits=splits)))
            metadata.num_splits = None
        results.sort(key=lambda r: r[0])
        for ms, c in results[:3]:
            self.report(case, "sweep", ms, nbytes, flops, config=json.dumps(c).replace(" ", ""))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rep-ms", type=int, default=100, help="time budget per measurement (do_bench rep)")
    p.add_argument("--peak-gbps", type=float, default=None, help="bandwidth floor to compare with (default: measure)")
    p.add_argument("--only", choices=["store", "decode", "extend", "mixed"], default=None)
    p.add_argument("--sweep", action="store_true", help="also sweep tile configs and split counts")
    p.add_argument("--json", default=None, help="write all rows to this JSON file")
    p.add_argument("--dry-run", action="store_true", help="tiny cases on CPU via the Triton interpreter")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        _fail(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    bench = Bench(args)
    print(f"{'case':34s} {'impl':22s} {'us':>10s} {'floor us':>9s} {'%floor':>7s} {'GB/s':>9s} {'%copy':>7s} "
          f"{'TFLOP/s':>8s}")
    cases = DRY_CASES if args.dry_run else CASES
    with torch.inference_mode():
        if args.only in (None, "store"):
            for t in cases["store"]:
                bench.store(t)
        if args.only in (None, "decode"):
            for b, ctx in cases["decode"]:
                bench.decode(b, ctx)
        if args.only in (None, "extend"):
            for b, prefix, n in cases["extend"]:
                bench.extend(b, prefix, n)
        if args.only in (None, "mixed"):
            bench.mixed(*cases["mixed"])
    if args.json:
        meta = dict(device=bench.device_name(), copy_gbps=bench.copy_gbps, matmul_tflops=bench.mm_tflops,
                    args=vars(args))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=bench.rows), f, indent=1)


if __name__ == "__main__":
    main()
