"""CpuPagedBackend: torch_paged plus a C++ decode-attention kernel (csrc/paged_decode.cpp).

Why a kernel: in a CPU decode step the attention math is tiny; what costs is moving
K/V.  The torch path gathers each request's blocks into a contiguous copy and then
multiplies (two passes over memory, plus a dozen op dispatches per layer); the kernel
reads every block where it lies, once for K and once for V, and keeps scores and
accumulators in float32 registers.  On SmolLM2 shapes (32 sequences of 150 tokens,
30 layers) the kernel itself takes about half the torch path's time, and the whole
backend step, K/V store and planning included, about three quarters
(`python -m pagedserve.attention.bench --backend cpu_paged` / `--backend torch_paged`).

It is compiled with torch.utils.cpp_extension for this machine's CPU (`-march=native`:
AVX-512 where the CPU has it, AVX2/FMA where it has that, plain loops otherwise; capped
like torch itself when ATEN_CPU_CAPABILITY says so) into torch's extension cache,
the first time in a process that needs it (~30 s once per machine, then a cached
load).  The build directory name carries a hash of the source, the CPU's flags, the
torch version and the compiler flags, so a cache shared across machines never runs
code built for another CPU.  Without a C++
compiler, or on any build error, the backend keeps the torch path for decodes too;
the reason is logged once.  Prefill chunks always take the torch path (their matmuls
are big enough for oneDNN to do well).  `attention_backend="torch_paged"` is the same
backend without the kernel.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.attention.torch_paged import TorchPagedBackend
from pagedserve.cpu_info import cpu_flags, kernel_isa_cflags
from pagedserve.platforms import is_cpu

logger = logging.getLogger("pagedserve")

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
HEAD_DIMS = (64, 128)  # the head sizes the kernel is instantiated for
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_state: dict[str, object] = {}


def build(extra_cflags: tuple[str, ...] | None = None, source: Path = SOURCE) -> Callable[..., torch.Tensor]:
    """Compile (or load the cached build of) the kernel for this CPU.  `extra_cflags`
    (default: whatever keeps it within torch's own ISA; tests and benchmarks pass
    "-mno-avx512f" for the AVX2 path, or also "-mno-avx2 -mno-fma" for the plain loops)
    become part of the cache key, as does `source` (benchmarks compare another version)."""
    from torch.utils import cpp_extension

    if extra_cflags is None:
        extra_cflags = kernel_isa_cflags()
    flags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
    key = (source.read_bytes() + " ".join(sorted(cpu_flags())).encode() + torch.__version__.encode()
           + " ".join(flags).encode())
    name = f"pagedserve_paged_decode_{hashlib.sha1(key).hexdigest()[:12]}"
    # Our own directory under torch's extension root ($TORCH_EXTENSIONS_DIR or its default), so
    # whether a build is needed is known before starting one (for the log line).
    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{name}.so").exists():
        logger.info("building the CPU decode-attention kernel for this machine (once, ~30 s)")
    module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                build_directory=str(build_dir), verbose=False)
    return module.paged_decode


def paged_decode() -> Callable[..., torch.Tensor] | None:
    """The kernel `paged_decode(q, k_cache, v_cache, block_table, seq_lens, scale) -> [B, H, D]`
    (q [B, H, D]; block_table [B, >= blocks of the longest] and seq_lens [B], int32),
    built once per process; None where it cannot be built."""
    if "fn" in _state:
        return _state["fn"]  # type: ignore[return-value]
    with _lock:
        if "fn" not in _state:
            fn = None
            try:
                fn = build()
            except Exception as e:  # noqa: BLE001 - no compiler, headers, ...: the torch path still works
                msg = str(e).strip().splitlines()
                logger.warning("CPU attention kernel unavailable, using the torch path (%s: %s)",
                               type(e).__name__, msg[-1] if msg else "")
            _state["fn"] = fn
    return _state["fn"]  # type: ignore[return-value]


class CpuPagedBackend(TorchPagedBackend):
    name = "cpu_paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        self.decode_kernel = paged_decode() if head_dim in HEAD_DIMS else None

    def _kernel_for(self, query: torch.Tensor, k_cache: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        ok = (is_cpu(query.device) and query.dtype in DTYPES and k_cache.dtype == query.dtype
              and query.stride(-1) == 1)
        return self.decode_kernel if ok else None
