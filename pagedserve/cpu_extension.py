"""Building our C++ CPU kernels for this machine, once, into torch's extension cache.

Both kernels (attention/csrc/paged_decode.cpp, layers/csrc/quant_linear.cpp) compile
with torch.utils.cpp_extension for this machine's CPU (`-march=native`: AVX-512 where
the CPU has it, AVX2/FMA where it has that, plain loops otherwise; capped like torch
itself when ATEN_CPU_CAPABILITY says so).  The build directory's name carries a hash
of the source, the CPU's flags, the torch version and the compiler flags, so a cache
shared across machines never runs code built for another CPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.cpu_info import cpu_flags, kernel_isa_cflags

logger = logging.getLogger("pagedserve")


def build_cpu_extension(prefix: str, source: Path, what: str,
                        extra_cflags: tuple[str, ...] | None = None) -> ModuleType:
    """Compile (or load the cached build of) `source` as module `prefix_<hash>`.
    `extra_cflags` (default: whatever keeps it within torch's own ISA; tests and
    benchmarks pass "-mno-avx512f" for the AVX2 path, or also "-mno-avx2 -mno-fma" for
    the plain loops) become part of the cache key.  `what` names it in the one log line
    a fresh build prints."""
    from torch.utils import cpp_extension

    if extra_cflags is None:
        extra_cflags = kernel_isa_cflags()
    flags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
    key = (source.read_bytes() + " ".join(sorted(cpu_flags())).encode() + torch.__version__.encode()
           + " ".join(flags).encode())
    name = f"{prefix}_{hashlib.sha1(key).hexdigest()[:12]}"
    # Our own directory under torch's extension root ($TORCH_EXTENSIONS_DIR or its default), so
    # whether a build is needed is known before starting one (for the log line).
    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name
    build_dir.mkdir(parents=True, exist_ok=True)
    if not (build_dir / f"{name}.so").exists():
        logger.info("building the %s for this machine (once, ~30 s)", what)
    return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              build_directory=str(build_dir), verbose=False)
