"""The quantized linear kernels that could run a CPU's weight-only layers, side by side.

    python -m pagedserve.benchmarks.bench_quant            # this CPU's best ISA
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python -m pagedserve.benchmarks.bench_quant

One [8192, 2048] projection (SmolLM2-1.7B's MLP shape), twelve different weights cycled
so they stream from memory as a real model's layers do, at 1, 8, 32 and 512 activation
rows.  Candidates: pagedserve's kernel (layers/csrc/quant_linear.cpp) with 4-bit and
8-bit blocks of 32, each with 16-bit (the default) and 8-bit activations; torch's own weight-only CPU ops `_weight_int4pack_mm_for_cpu`
(groups of 32) and `_weight_int8pack_mm` (per channel); and the 16-bit (or, where bf16 is
emulated, 32-bit) dense matmul the model would otherwise run; and float32 through the
engine's linear (operands swapped at 2-4 rows) against plain F.linear.  Prints ms per matmul and
the weight bytes per second that implies.  A benchmark: it prints figures, asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedserve.config import QUANT_ACTIVATION_BITS
from pagedserve.cpu_info import bf16_support, describe_cpu
from pagedserve.layers.linear import PackedLinear
from pagedserve.layers.quantization import pack, quant_kernel, quantize, quantized_matmul

N, K, COPIES = 8192, 2048, 12


def bench(fn: Callable[[], object], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def torch_int4(ws: list[torch.Tensor], dtype: torch.dtype) -> Callable[[torch.Tensor], list[torch.Tensor]] | None:
    try:
        packed = []
        for w in ws:
            q = quantize(w, "int4")  # the same blocks of 32: codes 0..15, scale d, zero point 8
            codes = q.codes.to(torch.int32)
            wp = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            d = q.d.float().T.contiguous()  # [K/32, N]
            sz = torch.stack([d, torch.zeros_like(d)], dim=-1).contiguous()  # tinygemm: w = (u - 8) * d + 0
            packed.append((wp, sz))

        def run(x: torch.Tensor) -> list[torch.Tensor]:  # (its scales must be in x's dtype)
            return [torch.ops.aten._weight_int4pack_mm_for_cpu(x, wp, 32, sz.to(x.dtype)) for wp, sz in packed]
        run(torch.randn(1, K, dtype=dtype))
        return run
    except (RuntimeError, AttributeError) as e:
        print(f"  torch int4pack unavailable: {e}")
        return None


def torch_int8(ws: list[torch.Tensor]) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    packed = []
    for w in ws:
        scale = w.abs().amax(1) / 127
        packed.append((torch.round(w / scale[:, None]).to(torch.int8), scale))

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ops.aten._weight_int8pack_mm(x, q, s.to(x.dtype)) for q, s in packed]
    return run


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 3, 8, 32, 512])
    args = p.parse_args(argv)
    dtype = torch.bfloat16 if bf16_support().native else torch.float32
    print(f"CPU: {describe_cpu()}; threads {torch.get_num_threads()}; kernel {quant_kernel().isa()}; "
          f"dense dtype {dtype}")
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(N, K, generator=g) * 0.02 for _ in range(COPIES)]
    candidates: dict[str, tuple[Callable[[torch.Tensor], object], int]] = {}
    for method in ("int4", "int8"):
        pws = [pack(quantize(w, method)) for w in ws]
        for bits in QUANT_ACTIVATION_BITS:
            candidates[f"pagedserve {method}, {bits}-bit activations"] = (
                lambda x, pws=pws, bits=bits: [quantized_matmul(x, [(0, pw)], N, bits=bits) for pw in pws],
                pws[0].nbytes())
    int4 = torch_int4(ws, dtype)
    if int4 is not None:
        candidates["torch _weight_int4pack_mm_for_cpu (groups of 32)"] = (int4, N * K // 2 + N * K // 32 * 8)
    candidates["torch _weight_int8pack_mm (per channel)"] = (torch_int8(ws), N * K + N * 4)
    dense = [w.to(dtype) for w in ws]
    candidates[f"dense {str(dtype).removeprefix('torch.')} F.linear"] = (
        lambda x: [torch.nn.functional.linear(x, w) for w in dense], N * K * dense[0].element_size())
    # float32 as the engine runs it (operands swapped for 2-4 rows: layers/linear.py), and as F.linear does.
    linear = PackedLinear()
    candidates["dense float32, the engine's linear"] = (
        lambda x: [linear(x.float(), w, None) for w in ws], N * K * 4)
    candidates["dense float32 F.linear"] = (lambda x: [torch.nn.functional.linear(x.float(), w) for w in ws], N * K * 4)
    print(f"{'':52}" + "".join(f"{'M=' + str(m):>22}" for m in args.rows))
    for name, (fn, nbytes) in candidates.items():
        cells = []
        for m in args.rows:
            x = torch.randn(m, K, generator=g).to(dtype)
            seconds = bench(lambda fn=fn, x=x: fn(x), 3 if m >= 128 else 10) / COPIES
            cells.append(f"{seconds * 1e3:8.2f} ms {nbytes / seconds / 1e9:5.1f} GB/s")
        print(f"{name:52}" + "".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
