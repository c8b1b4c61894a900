"""`pagedserve bench serve` and client disconnects over a real socket, against uvicorn
serving the fake engine in a thread (milliseconds per request, no model)."""

from __future__ import annotations

import json
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


def test_bench_serve_reports_failures(fake_server, capsys, tmp_path):
    """A run in which every request failed exits with an error and prints no latencies
    (it printed 0.00 ms for each and exited 0; then a table of n/a): so does an unreachable server."""
    url, _ = fake_server
    saved = tmp_path / "r.json"
    with pytest.raises(SystemExit, match="every request failed: HTTP 404"):
        bench.main(["--base-url", url, "--model", "no-such-model", "--num-prompts", "2", "--save-result", str(saved)])
    assert "TTFT" not in capsys.readouterr().out and not saved.exists()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{free.getsockname()[1]}"
    with pytest.raises(SystemExit, match="cannot read the model's name from .*/v1/models .*ConnectError"):
        bench.main(["--base-url", dead, "--num-prompts", "2"])


@pytest.mark.parametrize(("flags", "error"), [
    (["--num-warmups", "-1"], "--num-warmups must be >= 0"), (["--request-rate", "nan"], "--request-rate must be > 0"),
    (["--random-range-ratio", "-3"], "--random-range-ratio must be within"),
    (["--shared-prefix-len", "-4"], "--shared-prefix-len must be >= 0"),
])
def test_bench_serve_refuses_bad_flags_before_sending(flags, error):
    with pytest.raises(SystemExit, match=error):
        bench.main(["--base-url", "http://127.0.0.1:9", "--model", "m", *flags])


def test_bench_serve_percentiles_are_checked_at_parse_and_interpolated_as_numpy():
    """P50 is the median (nearest rank made them disagree); out-of-range or malformed
    percentiles are refused before the run (they failed after it, or printed "P250")."""
    import numpy as np

    values = [0.001, 0.002, 0.003, 0.1]
    stats = bench._stats("x", values, [50, 90, 99])
    assert stats["p50_x_ms"] == stats["median_x_ms"] == 2.5
    for p in (90, 99):
        assert stats[f"p{p}_x_ms"] == pytest.approx(np.percentile([v * 1000 for v in values], p))
    for bad in ("abc", "250", "-1"):
        with pytest.raises(SystemExit):
            bench.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--metric-percentiles", bad])


def test_bench_serve_warmups_share_no_prompt_with_the_measured_run(fake_server, monkeypatch):
    """Warm-ups sent the measured prompts, so the prefix cache answered them before they
    were timed (TTFT 12x better); they have prompts of their own (without the shared
    prefix), under the concurrency cap."""
    sent: list[tuple[str, int]] = []
    send_one = bench.send_one

    async def recording(client, args, prompt, max_tokens, tokenizer=None):
        sent.append((prompt, max_tokens))
        return await send_one(client, args, prompt, max_tokens, tokenizer)

    monkeypatch.setattr(bench, "send_one", recording)
    url, _ = fake_server
    summary = bench.main(["--base-url", url, "--num-prompts", "3", "--num-warmups", "5", "--max-concurrency", "2",
                          "--random-output-len", "5", "--dataset-name", "shared-prefix", "--shared-prefix-len", "20"])
    assert summary["completed"] == 3 and summary["total_output_tokens"] == 15
    warm, measured = sent[:5], sent[5:]
    assert len(measured) == 3 and all(n == 4 for _, n in warm)
    prefix = " ".join(measured[0][0].split()[:20])
    assert all(p.startswith(prefix) for p, _ in measured) and not any(p.startswith(prefix[:40]) for p, _ in warm)


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


def test_bench_serve_chat_with_a_tokenizer_sends_text_and_times_tool_calls(fake_server, monkeypatch, smollm2_path):
    """With --tokenizer, a chat message is the ids' text (it was the Python repr of the
    id list: 277 prompt tokens for 32); a chunk that is only a tool call or reasoning is
    output (its TTFT), not nothing."""
    sent: list[object] = []
    send_one = bench.send_one

    async def recording(client, args, prompt, max_tokens, tokenizer=None):
        sent.append(prompt)
        return await send_one(client, args, prompt, max_tokens, tokenizer)

    monkeypatch.setattr(bench, "send_one", recording)
    url, _ = fake_server
    summary = bench.main(["--base-url", url, "--endpoint", "/v1/chat/completions", "--num-prompts", "2",
                          "--random-input-len", "16", "--random-output-len", "3", "--tokenizer", smollm2_path])
    assert summary["completed"] == 2 and all(isinstance(p, str) and "[" not in p[:1] for p in sent)
    assert bench.has_output({"delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}, chat=True)
    assert bench.has_output({"delta": {"reasoning_content": "hm"}}, chat=True)
    assert not bench.has_output({"delta": {"role": "assistant", "content": ""}}, chat=True)
    assert not bench.has_output({"text": ""}, chat=False) and bench.has_output({"text": " a"}, chat=False)


def test_bench_serve_token_prompts_hold_no_special_token():
    """A drawn special id, decoded into a chat message, came back as the real token (an
    `<|im_end|>` ending the turn early)."""
    import argparse
    import random

    class Tokenizer:
        special_tokens_map = {"eos_token": "<e>", "additional_special_tokens": ["<a>", "<b>"]}

        def convert_tokens_to_ids(self, token: str) -> int:
            return {"<e>": 0, "<a>": 1, "<b>": 2}[token]

        def get_added_vocab(self) -> dict[str, int]:
            return {f"<added{i}>": i for i in range(3, 8)}

        def __len__(self) -> int:
            return 10

    args = bench.add_cli_args(argparse.ArgumentParser()).parse_args(["--num-prompts", "4", "--random-input-len", "50"])
    prompts = bench.make_prompts(args, random.Random(0), tokenizer=Tokenizer())
    assert {t for p, _ in prompts for t in p} == {8, 9}


def test_a_stream_cut_short_is_a_failure_and_tokens_without_text_are_output():
    """A stream that ended without [DONE] or a finish_reason counted as a short answer;
    one whose tokens were all special (no visible text) counted as a failure."""
    import argparse
    import asyncio

    args = bench.add_cli_args(argparse.ArgumentParser()).parse_args(["--model", "m"])
    bench.check_args(args)

    def serving(*events):
        body = "".join(f"data: {e}\n\n" for e in events)
        return httpx.MockTransport(lambda request: httpx.Response(200, text=body))

    async def one(transport):
        async with httpx.AsyncClient(transport=transport) as client:
            return await bench.send_one(client, args, "hi", 4)

    text = '{"choices": [{"text": "a", "finish_reason": %s}]}'
    cut = asyncio.run(one(serving(text % "null", text % "null")))
    assert not cut.ok and "ended before [DONE]" in cut.error
    whole = asyncio.run(one(serving(text % "null", text % '"length"', "[DONE]")))
    assert whole.ok and whole.output_tokens == 2
    usage = '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}'
    silent = asyncio.run(one(serving('{"choices": [{"text": "", "finish_reason": "length"}]}', usage, "[DONE]")))
    assert silent.ok and silent.output_tokens == 4 and silent.ttft > 0


def test_a_server_without_usage_is_counted_with_the_tokenizer_as_vllm_counts_it():
    """Output tokens were the chunks (a chunk may carry several), and input tokens 0."""
    import argparse
    import asyncio

    from tests.engine.helpers import make_tokenizer

    tok = make_tokenizer()
    args = bench.add_cli_args(argparse.ArgumentParser()).parse_args(["--model", "m", "--goodput", "ttft:5",
                                                                      "e2el:9"])
    bench.check_args(args)
    assert args.goodput == {"ttft": 5.0, "e2el": 9.0}  # (vLLM's spelling: one pair per word; the second was refused)
    words = ["the cat sat", " on the mat", " and the dog"]
    body = "".join(f"data: {json.dumps({'choices': [{'text': w, 'finish_reason': None}]})}\n\n" for w in words)
    body += 'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\ndata: [DONE]\n\n'

    async def one(prompt, tokenizer):
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body))
        async with httpx.AsyncClient(transport=transport) as client:
            return await bench.send_one(client, args, prompt, 9, tokenizer)

    counted = asyncio.run(one("a b c", tok))
    assert counted.output_tokens == len(tok.encode("".join(words), add_special_tokens=False)) > 3
    assert counted.prompt_tokens == len(tok.encode("a b c", add_special_tokens=False))
    assert asyncio.run(one([5, 6, 7, 8], tok)).prompt_tokens == 4
    bare = asyncio.run(one("a b c", None))
    assert (bare.output_tokens, bare.prompt_tokens) == (3, 0)  # (no tokenizer: the chunks)


def test_vllms_bench_serve_command_lines_run(fake_server, capsys, tmp_path):
    """`vllm bench serve` flags (they were unrecognized) and its saved JSON: standard JSON
    (Infinity was not), vLLM's keys, per-request lists."""
    import json

    url, _ = fake_server
    host, port = url.removeprefix("http://").split(":")
    conversations = [{"conversations": [{"from": "human", "value": f"question number {i} is this"},
                                        {"from": "gpt", "value": "a b c d e f"}]} for i in range(5)]
    (tmp_path / "sg.json").write_text(json.dumps(conversations + [{"conversations": [{"value": "x"}]}]))
    summary = bench.main(["--backend", "openai-chat", "--host", host, "--port", port, "--num-prompts", "4",
                          "--dataset-name", "sharegpt", "--dataset-path", str(tmp_path / "sg.json"),
                          "--percentile-metrics", "ttft,e2el", "--goodput", "ttft:60000 e2el:60000",
                          "--burstiness", "0.5", "--request-rate", "100", "--save-result", "--result-dir",
                          str(tmp_path), "--result-filename", "r.json", "--disable-tqdm"])
    out = capsys.readouterr().out
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 4 * 6  # (the answers' 6 words)
    assert "Mean TTFT" in out and "Mean E2EL" in out and "Mean TPOT" not in out
    assert "Request goodput (req/s):" in out and summary["request_goodput"] > 0
    saved = json.loads((tmp_path / "r.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert saved["backend"] == "openai-chat" and saved["output_lens"] == [6] * 4 and len(saved["ttfts"]) == 4
    assert saved["errors"] == [""] * 4 and saved["duration"] > 0 and len(saved["generated_texts"]) == 4
    summary = bench.main(["--base-url", url, "--num-prompts", "2", "--random-prefix-len", "30",
                          "--random-input-len", "5", "--save-result", str(tmp_path / "inf.json")])
    assert summary["total_input_tokens"] > 2 * 30 and json.loads((tmp_path / "inf.json").read_text(),
                                                                 parse_constant=lambda c: pytest.fail(c)
                                                                 )["request_rate"] == "inf"


@pytest.mark.parametrize(("flags", "error"), [
    (["--dataset-name", "sharegpt"], "--dataset-name sharegpt and --dataset-path go together"),
    (["--host", "h"], "--base-url, or --host and --port: not both"),
    (["--backend", "openai", "--endpoint", "/v1/chat/completions"], "--backend openai sends /v1/completions"),
    (["--percentile-metrics", "ttft,goodness"], "--percentile-metrics takes"),
    (["--burstiness", "0"], "--burstiness must be > 0"),
    (["--result-dir", "."], "--result-dir and --result-filename name where --save-result"),  # (were ignored)
    (["--save-result", "--result-dir", "/no/such/dir"], "is not a directory"),
    (["--save-result", "/"], "--save-result '/': not a file that can be written"),  # (a traceback after the run)
    (["--save-result", "/no/such/dir/r.json"], "not a file that can be written"),
    (["--save-result", "--result-filename", "no/such/r.json"], "--result-filename .*not a file that can be written"),
])
def test_vllms_bench_serve_flags_are_checked(flags, error):
    with pytest.raises(SystemExit, match=error):
        bench.main(["--base-url", "http://127.0.0.1:9", "--model", "m", *flags])
