"""The benchmarks' shared harness (pagedserve/benchmarks/harness.py): process-tree memory
and Prometheus text.  Its server launcher runs in every benchmark test that starts one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pagedserve.benchmarks.harness import metric_samples, process_rss


def test_rss_counts_same_executable_children_and_shows_others_apart() -> None:
    """A tensor-parallel worker (same executable) is the server's memory; a compiler a kernel
    build started is not, and counting it once failed the short soak on a clean CI machine."""
    script = ("import subprocess, sys, time\n"
              "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "o = subprocess.Popen(['sleep', '60'])\n"
              "print('up', flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 30
        sample = process_rss(parent.pid)
        while time.monotonic() < deadline:  # until both children have exec'd (the python one takes longer)
            sample = process_rss(parent.pid)
            if sample is not None and (sample.num_workers, sample.num_transient) == (1, 1):
                break
            time.sleep(0.02)
        with open(f"/proc/{parent.pid}/task/{parent.pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
        assert sample is not None
        assert (sample.num_workers, sample.num_transient) == (1, 1)
        assert sample.total == sample.main + sample.workers
        assert sample.transient > 0 and sample.workers > 0
    finally:
        for kid in kids:
            os.kill(kid, signal.SIGKILL)
        parent.kill()
        parent.wait()
    assert process_rss(parent.pid) is None  # gone


def test_metric_samples_keep_every_labelled_sample() -> None:
    text = "\n".join([
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 5.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 7.0',
        'vllm:num_requests_running{engine="0"} 2.0',
    ])
    samples = metric_samples(text)
    assert samples["vllm:prefix_cache_hits_total"] == [({"engine": "0", "model_name": "m"}, 5.0),
                                                        ({"engine": "1", "model_name": "m"}, 7.0)]
    assert samples["vllm:num_requests_running"] == [({"engine": "0"}, 2.0)]
    assert metric_samples("") == {}
