"""One OpenMP pool at a time: a thread that loads a model, or runs an offline batch,
hands its OpenMP worker threads back when it is done.

torch's OpenMP runtime gives every thread that starts a parallel region a pool of
worker threads of its own, kept until that thread exits.  While two threads own pools
the runtime (libgomp) counts more of its threads than the machine has CPUs and stops
letting idle workers spin: each of the hundreds of parallel regions of a decode step
then wakes its workers from sleep.  A thread that once did the model's work and lived
on made every later step of the thread that runs the model slower: the server's
on-demand model loads run on asyncio's executor threads (two models behind one server,
2 cores, Zen 5: SmolLM2-135M 102.5 against 190-206 tok/s alone), and an offline `LLM`
built on the main thread and then called from another (Gemma 3 270M, 93 against 124
tok/s).  `omp_pause_resource_all` (OpenMP 5.0) frees the calling thread's pool only; the
thread gets a new one if it starts a parallel region again.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Callable

logger = logging.getLogger("pagedserve")

_OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libiomp", "libomp")  # GCC's (torch's on Linux), Intel's, LLVM's


@functools.cache
def _pause_functions() -> tuple[Callable[[int], int], ...]:
    """omp_pause_resource_all of every OpenMP runtime loaded (torch's, and any a library
    bundles: sentencepiece's wheel brings a libgomp of its own), found by the paths they
    are mapped from so that no runtime is loaded that was not (wheels rename theirs)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:  # not Linux
        return ()
    found = []
    for path in sorted(paths):
        if os.path.basename(path).startswith(_RUNTIMES):
            try:
                fn = ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):  # a runtime older than OpenMP 5.0
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            found.append(fn)
    return tuple(found)


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads in every runtime (call it outside
    any parallel region); False where no runtime could."""
    results = [fn(_OMP_PAUSE_SOFT) == 0 for fn in _pause_functions()]
    return any(results)
