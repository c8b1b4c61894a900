"""worker/cpu_malloc.py: the heap settings and oneDNN's cache bound that keep a long-running
CPU server's memory flat."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedserve.worker import cpu_malloc


def test_trimming_the_heap_starts_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle engine trims at every pause: looking glibc up each time forked the server
    (`ldconfig -p`), a copy of it that a soak's RSS reading counted once as a worker."""
    cpu_malloc.release_freed_memory()  # the first lookup may run ldconfig
    started: list[object] = []

    def popen(*args: object, **kwargs: object) -> None:
        started.append(args)
        raise OSError("no processes here")

    monkeypatch.setattr(subprocess, "Popen", popen)
    for _ in range(3):
        cpu_malloc.release_freed_memory()
    assert cpu_malloc.keep_freed_memory_on_heap() in (True, False)
    assert started == []


def test_bound_onednn_caches_sets_both_unless_the_user_did(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    cpu_malloc.bound_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(cpu_malloc.ONEDNN_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"  # the user's choice stands


# Random-shaped bf16 batched matmuls, as prefill attention issues them: RSS growth in MiB.
_GROWTH = textwrap.dedent("""
    import random, sys, torch
    from pagedserve.worker import cpu_malloc
    if sys.argv[1] == "bounded":
        cpu_malloc.bound_onednn_caches()
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
    random.seed(0)
    torch.set_num_threads(1)
    torch.bmm(torch.ones(3, 96, 64, dtype=torch.bfloat16), torch.ones(3, 64, 96, dtype=torch.bfloat16))
    start = rss()
    for _ in range(500):
        b, q, kv = random.randint(1, 4), random.randint(1, 200), 16 * random.randint(1, 16)
        s = torch.bmm(torch.randn(3 * b, 3 * q, 64, dtype=torch.bfloat16),
                      torch.randn(3 * b, 64, kv, dtype=torch.bfloat16))
        torch.bmm(s.softmax(-1), torch.randn(3 * b, kv, 64, dtype=torch.bfloat16))
    print(rss() - start)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="bf16 matmuls here do not run through oneDNN (no AVX-512), so it caches nothing")
def test_bounded_caches_stop_the_growth_of_random_shaped_bf16_matmuls() -> None:
    """The variable names and the moment they are set both matter: a typo, or setting them
    after oneDNN's first use, leaves the default 1024-entry caches and this fails."""
    clean = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    growth = {}
    for mode in ("default", "bounded"):
        out = subprocess.run([sys.executable, "-c", _GROWTH, mode], capture_output=True, text=True,
                             env=clean, check=True, timeout=300)
        growth[mode] = float(out.stdout.split()[-1])
    assert growth["bounded"] < 0.5 * growth["default"], growth
