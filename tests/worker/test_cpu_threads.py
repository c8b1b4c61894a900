"""A thread that built an engine or ran an offline batch keeps no OpenMP worker threads
(worker/cpu_threads.py): while it kept them, every step of the thread that runs the
model next was throttled.  Each check runs in a fresh process, whose only threads are
the ones it makes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch  # noqa: F401 - loads torch's OpenMP runtime, which the skip looks for

from pagedserve.worker.cpu_threads import _libgomp_paths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Threads of the process that Python did not start: torch's import-time thread and the
# OpenMP runtimes' workers.
_NATIVE = """
import os, threading
def native():
    python = {t.native_id for t in threading.enumerate()}
    return len([t for t in os.listdir(f"/proc/{os.getpid()}/task") if int(t) not in python])
def settled(want):
    # A released worker leaves /proc a moment after the release returns: wait up to 5 s.
    import time
    for _ in range(100):
        if native() == want:
            break
        time.sleep(0.05)
    return native()
"""

_RAW = _NATIVE + """
import torch
from pagedserve.worker.cpu_threads import release_openmp_threads
before = native()
torch.ones(1 << 20).sum()  # a parallel region: this thread's pool of workers
during = native()
assert release_openmp_threads()
print(before, during, settled(before))
"""

_ENGINE = _NATIVE + """
import torch
from pagedserve import LLM, SamplingParams
before = native()
llm = LLM("smollm2-135m-instruct", max_model_len=256, max_num_seqs=1, speculative_config="off")
built = settled(before)
llm.generate(["Hi"], SamplingParams(max_tokens=4), use_tqdm=False)
print(before, built, settled(before))
"""


def run(script: str) -> list[int]:
    # Two OpenMP threads whatever the suite's workers run with (tests/conftest.py gives each
    # one core): a pool has a worker only with two or more.
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(x) for x in out.stdout.split()[-3:]]


# (torch on LLVM's or Intel's OpenMP keeps no pool per thread: nothing to hand back there)
needs_threads = pytest.mark.skipif(not sys.platform.startswith("linux") or not _libgomp_paths(),
                                   reason="needs Linux's /proc and torch on GNU OpenMP (libgomp)")


@needs_threads
def test_release_frees_the_calling_threads_workers():
    before, during, after = run(_RAW)
    assert during > before and after == before


@needs_threads
def test_building_an_engine_and_a_batch_leave_no_workers_on_the_calling_thread():
    before, built, after = run(_ENGINE)
    assert built == before and after == before
