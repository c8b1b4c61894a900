"""Keep glibc from handing large CPU tensors back to the kernel after every use.

A forward pass allocates and frees many multi-MB activations per layer.  glibc serves
allocations above its mmap threshold with fresh mmap()s and unmaps them on free, so
every layer pays page faults on memory it just released: measured on the 2-core dev
machine, a 4096-token SmolLM2 prefill took 3.2 s with glibc's defaults and 1.75 s
with large blocks kept on the heap (SiluAndMul alone went from 22 ms to 4 ms a call).
jemalloc/tcmalloc fix the same thing when preloaded; this needs no preload.  It is
process-wide and only raises thresholds, so it is harmless to anything else running.

Also bounds oneDNN's shape-keyed caches (`bound_onednn_caches`), the other thing that
made a long-running CPU server's memory climb.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import sys
import threading

logger = logging.getLogger("pagedserve")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30  # serve allocations up to 1 GiB from the heap, and keep up to 1 GiB free there
_done = False

# bf16 matmuls on CPU run through oneDNN, which keeps a compiled primitive per exact shape
# in two caches: its own primitive cache and ideep's per-op cache (PyTorch's glue), 1024
# entries each by default, some of them ~0.3 MB.  Prefill attention's batched matmuls take
# a new shape with almost every step (query and context lengths vary), so over hours a
# server's RSS climbed by hundreds of MB (1.19 -> 1.64 GB at rest in a 20-minute soak on
# 2 Zen 4 cores), where float32 matmuls (MKL) stayed flat.  One step reuses its few
# shapes across all layers, so a small cache keeps every hit that matters: 32 entries
# measured no slower than 1024 (`pagedserve bench throughput`, 64 random requests:
# 920 vs 872 total tok/s, within noise), and bounds the growth to tens of MB.
ONEDNN_CACHE_CAPACITY = 32
_ONEDNN_CACHE_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


@functools.cache
def _libc() -> ctypes.CDLL:
    """glibc, looked up once: `find_library` runs `ldconfig -p` in a child process on every
    call, and an idle engine trims the heap at every pause (a fork of the whole server,
    briefly counted as a second copy of it by anything reading its children's RSS)."""
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def keep_freed_memory_on_heap() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; False where not glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = _libc()
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES) == 1
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    _done = ok
    if ok:
        logger.debug("glibc malloc: mmap and trim thresholds raised to %d bytes", _KEEP_BYTES)
    return ok


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the kernel (glibc's malloc_trim, every arena).
    Loading a quantized model frees as much as it keeps (unpacked codes, numpy scratch)
    in pieces that glibc keeps: SmolLM2-1.7B's Q4_0 blocks (918 MB) left 1.72 GB
    resident before this, 1.2 GB after.  Called once the weights are in, before the
    thresholds above are raised, and by an idle engine (engine/inproc_client.py): never
    between steps, whose freed activations it would hand back only to fault in again."""
    if not sys.platform.startswith("linux"):
        return
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


def note_freed_memory() -> None:
    """Memory was freed outside the engine's steps (a prompt's decoded images, on an
    intake thread: its malloc arena keeps up to the raised trim threshold, and each
    thread has its own): the engine's next idle pause hands it back
    (`take_freed_memory_note`)."""
    _FREED_ELSEWHERE.set()


def take_freed_memory_note() -> bool:
    """Whether memory was noted freed since the last call (and forget it)."""
    noted = _FREED_ELSEWHERE.is_set()
    _FREED_ELSEWHERE.clear()
    return noted


_FREED_ELSEWHERE = threading.Event()


def collect_and_release() -> None:
    """Collect garbage (a model's reference cycles), then hand the heap's free pages back."""
    gc.collect()
    release_freed_memory()


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's two shape-keyed caches (see ONEDNN_CACHE_CAPACITY) unless the user set
    them.  Both libraries read their variable when first used, so this must run before
    the process's first bf16 matmul (the model runner calls it before its first forward);
    later it changes nothing."""
    for var in _ONEDNN_CACHE_VARS:
        if os.environ.setdefault(var, str(capacity)) != str(capacity):
            logger.debug("oneDNN cache: %s=%s kept from the environment", var, os.environ[var])
