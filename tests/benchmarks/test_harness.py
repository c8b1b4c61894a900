"""The benchmarks' shared harness (pagedserve/benchmarks/harness.py): process-tree memory
and Prometheus text.  Its server launcher runs in every benchmark test that starts one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from pagedserve.benchmarks import harness
from pagedserve.benchmarks.harness import metric_samples, process_rss


def test_rss_counts_same_executable_children_and_shows_others_apart() -> None:
    """A tensor-parallel worker (same executable) is the server's memory; a compiler a kernel
    build started is not, and counting it once failed the short soak on a clean CI machine;
    nor is a fork that has not yet run its program (the server's own command line: a
    subprocess starting), and counting one doubled the soak's RSS in CI."""
    script = ("import os, subprocess, sys, time\n"
              "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "o = subprocess.Popen(['sleep', '60'])\n"
              "if os.fork() == 0: time.sleep(60); os._exit(0)\n"
              "print('up', flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 30
        sample = process_rss(parent.pid)
        while time.monotonic() < deadline:  # until both children have exec'd (the python one takes longer)
            sample = process_rss(parent.pid)
            if sample is not None and (sample.num_workers, sample.num_transient) == (1, 2):
                break
            time.sleep(0.02)
        with open(f"/proc/{parent.pid}/task/{parent.pid}/children") as f:
            kids = [int(c) for c in f.read().split()]
        assert sample is not None
        assert (sample.num_workers, sample.num_transient) == (1, 2)
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


_TINY_SERVER = ("import http.server, sys\n"
                "class H(http.server.BaseHTTPRequestHandler):\n"
                "    def do_GET(self):\n"
                "        self.send_response(200); self.end_headers(); self.wfile.write(b'mine')\n"
                "    def log_message(self, *a): pass\n"
                "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


class _TinyServer(harness.LocalServer):
    what = "tiny server"
    ready_timeout = 30.0

    def command(self, port: int) -> list[str]:
        return [sys.executable, "-c", _TINY_SERVER, str(port)]


@pytest.mark.parametrize("status", [200, 503])
def test_a_server_whose_port_another_process_took_starts_on_another(monkeypatch, status) -> None:
    """Another server already listens on the first port drawn (two servers started at once
    took the same free port, and a test's requests went to the other, which refused its
    API key), ready (200) or still loading (503): ready means this process listens, so it
    starts on a new port."""
    import http.server
    import threading

    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"foreign")

        def log_message(self, *args: object) -> None:
            pass

    foreign = http.server.HTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    taken = foreign.server_address[1]
    ports = iter([taken, harness.free_port()])
    monkeypatch.setattr(harness, "free_port", lambda: next(ports))
    server = _TinyServer()
    try:
        assert server.port != taken and server.proc.poll() is None
        assert harness.listens_on(server.proc.pid, server.port) is True
        assert harness.listens_on(server.proc.pid, taken) is False
        assert httpx.get(server.url + "/health", timeout=5).text == "mine"
    finally:
        server.stop()
        foreign.shutdown()
