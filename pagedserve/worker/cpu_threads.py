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
thread gets a new one if it starts a parallel region again (a thread created per worker,
so a loop of small offline batches pays that once a batch).
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

_OMP_PAUSE_SOFT = 1


def _libgomp_paths() -> set[str]:
    """The files of every GNU OpenMP runtime mapped into this process: torch's, and any a
    library bundles (sentencepiece's wheel brings its own, renamed libgomp-<hash>.so)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as f:
            lines = [line for line in f if "libgomp" in line]
    except OSError:  # not Linux
        return set()
    paths = set()
    for line in lines:
        fields = line.rstrip("\n").split(maxsplit=5)  # the path is the rest (it may hold spaces)
        if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith(" (deleted)"):
            paths.add(fields[5])
    return paths


@functools.cache
def _pause_function(path: str) -> Callable[[int], int] | None:
    """`path`'s omp_pause_resource_all (the loaded copy: dlopen of a loaded file returns
    it), or None (older than OpenMP 5.0)."""
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads in every GNU runtime loaded (call it
    outside any parallel region); False where none could.  Only libgomp: its pause frees
    the caller's pool alone, where LLVM's and Intel's runtimes pause the whole process's
    (and keep no pool per thread, the cause here)."""
    fns = [fn for fn in map(_pause_function, sorted(_libgomp_paths())) if fn is not None]
    return any([fn(_OMP_PAUSE_SOFT) == 0 for fn in fns])
