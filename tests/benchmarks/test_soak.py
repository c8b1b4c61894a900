"""A short run of the soak (pagedserve/benchmarks/soak.py) against a real server on a tiny
random model: a few hundred requests instead of thousands, but the same mix (streams and
not, cancels, invalid and over-long requests) and the same end conditions, so a leak of
KV blocks, a stuck request or a 500 on a bad input fails CI rather than a long soak."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.benchmarks import soak
from tests.entrypoints.openai.conftest import (
    API_KEY,
    MODEL_NAME,
    SERVER_FLAGS,
    ServerProcess,
    make_tiny_model,
)


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of its own: the RSS and drain checks need one no other test is loading."""
    model_dir = tmp_path_factory.mktemp("soak-tiny-llama")
    make_tiny_model(model_dir)
    proc = ServerProcess([str(model_dir), *SERVER_FLAGS], tmp_path_factory.mktemp("soak-log") / "server.log")
    yield proc
    proc.stop()


def test_metrics_parser_reads_gauges_and_abort_counter() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running Requests in the running batch.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="a"} 2.0',
        'vllm:num_requests_running{model_name="b"} 1.0',
        'vllm:num_requests_waiting{model_name="a"} 0.0',
        'vllm:kv_cache_usage_perc{model_name="a"} 0.25',
        'vllm:request_success_total{finished_reason="abort",model_name="a"} 7.0',
        'vllm:request_success_total{finished_reason="length",model_name="a"} 9.0',
    ])
    g = soak.gauges_from_metrics(text)
    assert (g.running, g.waiting, g.kv_usage, g.aborts) == (3.0, 0.0, 0.25, 7.0)
    assert not g.idle()
    assert soak.ServerGauges(0.0, 0.0, 0.0).idle()
    assert soak.gauges_from_metrics("").running is None  # a missing gauge is not a zero


def test_stream_check_needs_done_usage_and_length() -> None:
    plan = soak.PlannedRequest(0, "valid", "completions/stream", "/v1/completions", {}, stream=True, max_tokens=3)
    good = soak.StreamCheck(plan)
    for event in ({"choices": [{"index": 0, "text": "ab", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]},
                  {"choices": [], "usage": {"completion_tokens": 3}}):
        good.feed("data: " + json.dumps(event))
    good.feed("")
    good.feed("data: [DONE]")
    assert good.verdict() == (None, 3)

    cut = soak.StreamCheck(plan)
    cut.feed("data: " + json.dumps({"choices": [{"index": 0, "text": "c", "finish_reason": "length"}]}))
    assert "[DONE]" in cut.verdict()[0]

    errored = soak.StreamCheck(plan)
    errored.feed('data: {"error": {"message": "boom", "type": "server_error"}}')
    errored.feed("data: [DONE]")
    assert errored.verdict()[0].startswith("in-band error")


def test_short_soak(soak_server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    summary = soak.main([
        "--base-url", soak_server.url, "--pid", str(soak_server.proc.pid), "--api-key", API_KEY,
        "--server-log", str(soak_server.log_path), "--num-requests", "250", "--duration", "25",
        "--concurrency", "8", "--warmup-requests", "100", "--max-tokens", "1:12", "--seed", "1",
        "--request-timeout", "60", "--settle", "1", "--progress-interval", "0", "--json", str(out),
    ])
    assert summary["model"] == MODEL_NAME
    assert not summary["failed_conditions"], (summary["failed_conditions"], summary["failures"], soak_server.log())
    assert all(ok is not None for ok in summary["conditions"].values())  # none skipped: RSS and log checked too
    assert summary["server_5xx"] == 0 and summary["warmup"]["server_5xx"] == 0
    assert summary["completed"] > 0 and summary["cancelled"] > 0
    assert summary["sent"] == summary["completed"] + summary["cancelled"] + summary["refused"]
    invalid = {k: n for k, n in summary["refused_by_reason"].items() if k.startswith("invalid/")}
    assert sum(invalid.values()) == summary["by_kind"].get("invalid", 0) > 0
    assert all(" HTTP 4" in k for k in invalid)
    overlong = [k for k in summary["refused_by_reason"] if k.startswith("overlong/")]
    assert all(" HTTP 400 " in k for k in overlong)
    assert summary["end_gauges"]["running"] == 0 and summary["end_gauges"]["kv_cache_usage"] == 0
    assert json.loads(out.read_text())["sent"] == summary["sent"]
    assert not summary["server_log"]["by_exception"], summary["server_log"]["first"]
