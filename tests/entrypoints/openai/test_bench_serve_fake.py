"""`pagedserve bench serve` and client disconnects over a real socket, against uvicorn
serving the fake engine in a thread (milliseconds per request, no model)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from pagedserve.benchmarks import serve as bench
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app
from tests.engine.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    engine = FakeEngine(step_time=0.002)
    state = ServerState(served_model_names=["fake"])
    app = build_app(state)
    state.attach(Attachment.local(AsyncLLM(engine, log_stats=False), 4096))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.01)
    assert server.started
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=10)


def test_bench_serve_reports_exact_counts(fake_server, capsys):
    url, _ = fake_server
    summary = bench.main(["--base-url", url, "--num-prompts", "12", "--random-input-len", "20",
                          "--random-output-len", "9", "--max-concurrency", "4", "--request-rate", "200",
                          "--metric-percentiles", "50,99"])
    out = capsys.readouterr().out
    assert summary["completed"] == 12 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 12 * 9
    # Words prompts: the fake tokenizer is per character, so count characters.
    assert summary["total_input_tokens"] > 12 * 20
    assert 0 < summary["mean_ttft_ms"] < summary["mean_e2el_ms"]
    assert summary["p99_itl_ms"] >= summary["median_itl_ms"] > 0
    assert summary["mean_tpot_ms"] > 0 and summary["request_throughput"] > 0
    for title in ("Serving Benchmark Result", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "P50 E2EL (ms):"):
        assert title in out


def test_bench_serve_shared_prefix_chat(fake_server):
    url, _ = fake_server
    summary = bench.main(["--base-url", url, "--endpoint", "/v1/chat/completions", "--num-prompts", "6",
                          "--dataset-name", "shared-prefix", "--shared-prefix-len", "30", "--random-input-len", "5",
                          "--random-output-len", "4"])
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 24


def test_bench_serve_reports_failures(fake_server):
    url, _ = fake_server
    summary = bench.main(["--base-url", url, "--model", "no-such-model", "--num-prompts", "2"])
    assert summary["completed"] == 0 and summary["failed"] == 2
    assert "404" in summary["errors"][0]


def test_disconnect_mid_stream_aborts_in_engine(fake_server):
    url, engine = fake_server
    before = len(engine.aborted)
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", url + "/v1/completions",
                           json={"prompt": "x", "max_tokens": 4000, "stream": True}) as resp:
            assert resp.status_code == 200
            for i, _line in enumerate(resp.iter_lines()):
                if i >= 3:
                    break  # closing the response drops the connection
    deadline = time.time() + 5
    while len(engine.aborted) == before and time.time() < deadline:
        time.sleep(0.01)
    assert len(engine.aborted) == before + 1
    assert not engine.reqs


def test_cli_bench_serve_delegates(fake_server, capsys):
    from pagedserve.entrypoints import cli

    url, _ = fake_server
    cli.main(["bench", "serve", "--base-url", url, "--num-prompts", "3", "--random-output-len", "5"])
    out = capsys.readouterr().out
    assert "Successful requests:                    3" in out
    assert "Total generated tokens:                 15" in out
