"""Building our C++ CPU kernels for this machine, once, into torch's extension cache.

The kernels (attention/csrc/paged_decode.cpp, layers/csrc/quant_linear.cpp, and with
LoRA enabled layers/csrc/lora.cpp) compile
with torch.utils.cpp_extension for this machine's CPU (`-march=native`: AVX-512 where
the CPU has it, AVX2/FMA where it has that, plain loops otherwise; capped like torch
itself when ATEN_CPU_CAPABILITY says so).  The build directory's name carries a hash
of the source, the CPU's flags, the torch and Python versions, the compiler flags and
the compiler, so a cache shared across machines never runs code built for another CPU.
A finished build is imported directly, without asking torch's builder: its ninja file
names the include paths of the environment that built it, so through the builder a
fresh virtual environment (CI's, each run) would rebuild every kernel (~20 s each),
although the same torch and Python versions make the same module.

Builders take an OS file lock (flock) on the build directory, not only torch's own
"lock" file: torch's marker stays behind when a process dies mid-build (a CLI run that
answered before its background build finished, a killed worker), and every later
build of that kernel would wait on it forever.  The flock dies with its process, so
whoever holds it knows a leftover marker is stale and removes it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.cpu_info import cpu_flags, kernel_isa_cflags
from pagedserve.utils import record_startup

logger = logging.getLogger("pagedserve")
# Compiler flags that turn an instruction-set extension off, and the CPU flag of each.
_ISA_OFF = {"-mno-avx512f": "avx512f", "-mno-avx2": "avx2", "-mno-fma": "fma"}


def extension_build_dir(prefix: str, source: Path,
                        extra_cflags: tuple[str, ...] | None = None) -> tuple[str, Path, list[str]]:
    """(module name, build directory, compiler flags) of `source` built with `extra_cflags`
    (default: whatever keeps it within torch's own ISA; tests and benchmarks pass
    "-mno-avx512f" for the AVX2 path, or also "-mno-avx2 -mno-fma" for the plain loops)."""
    if extra_cflags is None:
        extra_cflags = kernel_isa_cflags()
    # Turning off an extension the CPU lacks changes nothing under -march=native: dropped,
    # so such a build shares the native one's cache (on an AVX2-only CPU the "AVX2" build
    # is the native build, not a second 40 s compile).
    have = cpu_flags()
    extra_cflags = tuple(f for f in extra_cflags if _ISA_OFF.get(f, "") in have or f not in _ISA_OFF)
    flags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
    key = (source.read_bytes() + " ".join(sorted(cpu_flags())).encode() + torch.__version__.encode()
           + " ".join(flags).encode() + "\0".join(_build_environment()).encode())
    name = f"{prefix}_{hashlib.sha1(key).hexdigest()[:12]}"
    # Our own directory under torch's extension root ($TORCH_EXTENSIONS_DIR or its default), so
    # whether a build is needed is known before starting one (for the log line).
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or default_build_root()
    return name, Path(root) / name, flags


def default_build_root() -> str:
    """torch.utils.cpp_extension.get_default_build_root(), without importing that module:
    it imports setuptools (0.24 s of a `generate`'s start on Zen 4), which only a build needs."""
    import torch._appdirs

    return os.path.realpath(torch._appdirs.user_cache_dir(appname="torch_extensions"))


def _build_environment() -> tuple[str, ...]:
    """What else decides the module: the Python that imports it (its version and ABI)
    and the compiler.  Not the environment's paths (see the module docstring)."""
    import importlib.machinery

    # The ABI from the import system's extension suffix, not sysconfig: its first read fills
    # a shared dict, and a build started on a background thread while another thread read
    # sysconfig saw it empty (a second name for the same build: a 20 s rebuild, and a
    # compiled graph saved with the other name's operators did not load).
    return (sys.version, importlib.machinery.EXTENSION_SUFFIXES[0], os.environ.get("CXX", "c++"))


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """The finished build in `build_dir`, imported; None when there is none yet."""
    library = build_dir / f"{name}.so"
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_cpu_extension(prefix: str, source: Path, what: str,
                        extra_cflags: tuple[str, ...] | None = None) -> ModuleType:
    """Compile (or load the cached build of) `source` as module `prefix_<hash>` (see
    extension_build_dir).  `what` names it in the one log line a fresh build prints."""
    name, build_dir, flags = extension_build_dir(prefix, source, extra_cflags)
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "pagedserve.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per directory, across threads and processes
        try:
            stale = build_dir / "lock"  # torch's marker; no live builder can own it while we hold the flock
            if stale.exists():
                logger.warning("removing %s, left by a build that was interrupted", stale)
                stale.unlink()
            built = _import_built(name, build_dir)
            if built is not None:
                return built
            logger.info("building the %s for this machine (once, ~20 s)", what)
            from torch.utils import cpp_extension

            return cpp_extension.load(name=name, sources=[str(source)], extra_cflags=flags,
                                      extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class CpuKernel:
    """One of our C++ kernels in this process: built (or loaded) on first use, once, by
    whichever thread asks first while the others wait; a failed build is remembered, not
    retried.  `on_load` runs once on the loaded module (registering its operators' shapes
    for tracing, say); `phase` names its time in the start-up breakdown; `cflags` are
    flags its source always builds with, after the ISA's (the fused kernels': no FMA
    contraction, so float32 results round where torch's ops round; no trapping math, so
    GCC vectorises their clamps)."""

    def __init__(self, prefix: str, source: Path, what: str, phase: str,
                 on_load: Callable[[ModuleType], None] | None = None, cflags: tuple[str, ...] = ()) -> None:
        self.prefix, self.source, self.what, self.phase, self.on_load = prefix, source, what, phase, on_load
        self.cflags = cflags
        self._module: ModuleType | None = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def get(self, extra_cflags: tuple[str, ...] | None = None) -> ModuleType:
        """The module for this machine; `extra_cflags` builds another variant (tests and
        benchmarks: the AVX2 and plain paths), not kept here.  Raises what the build raised."""
        if self._module is not None and extra_cflags is None:  # the per-call path: nothing else to do
            return self._module
        if extra_cflags is not None:
            return build_cpu_extension(self.prefix, self.source, self.what, self._with_own_cflags(extra_cflags))
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"the {self.what} did not build in this process ({self._error})")
            if self._module is None:
                t0 = time.perf_counter()
                try:
                    module = build_cpu_extension(self.prefix, self.source, self.what, self._with_own_cflags(None))
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    self._error = f"{type(e).__name__}: {msg[-1] if msg else ''}"
                    raise
                if self.on_load is not None:
                    self.on_load(module)
                self._module = module
                record_startup(self.phase, time.perf_counter() - t0)
            return self._module

    def _with_own_cflags(self, extra_cflags: tuple[str, ...] | None) -> tuple[str, ...] | None:
        """`extra_cflags` (None: the default ISA's) followed by this kernel's own flags."""
        if not self.cflags:
            return extra_cflags
        return (kernel_isa_cflags() if extra_cflags is None else extra_cflags) + self.cflags

    def error(self) -> str | None:
        """None when the kernel builds (or is built) here, else why not (no compiler, ...)."""
        if self._module is None:
            try:
                self.get()
            except Exception:  # noqa: BLE001 - no compiler, headers, ...: the caller decides
                pass
        return self._error
