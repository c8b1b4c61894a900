"""The server under abuse, in-process over the fake engine: body limits (413 before
parsing), the API key on every route but /health, backpressure (503 + Retry-After),
request timeouts, aborting everything at shutdown, and error bodies without internals."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.async_llm import AsyncLLM, EngineShutdownError
from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app
from tests.engine.fake_engine import FakeEngine
from tests.entrypoints.openai.test_api_fake_engine import call, events

KEY = {"Authorization": "Bearer k"}


def make(engine: FakeEngine | None = None, **state_kwargs) -> tuple[ServerState, object]:
    """App and state; AsyncLLM options go in `state_kwargs["llm"]`."""
    llm_kwargs = state_kwargs.pop("llm", {})
    state = ServerState(served_model_names=["fake"], api_key="k", **state_kwargs)
    app = build_app(state)
    state.attach(Attachment.local(AsyncLLM(engine or FakeEngine(), log_stats=False, **llm_kwargs), 4096))
    return state, app


def test_body_over_the_limit_is_413_by_length_and_when_chunked():
    _, app = make(max_request_bytes=1000)
    big = b'{"prompt": "' + b"a" * 5000 + b'"}'

    async def chunks():
        for i in range(0, len(big), 100):
            yield big[i:i + 100]

    async def fn(c):
        by_length = await c.post("/v1/completions", content=big, headers={**KEY, "content-type": "application/json"})
        chunked = await c.post("/v1/completions", content=chunks(),
                               headers={**KEY, "content-type": "application/json"})
        small_chunked = await c.post("/v1/completions", content=_iter(b'{"prompt": "hi", "max_tokens": 2}'),
                                     headers={**KEY, "content-type": "application/json"})
        return by_length, chunked, small_chunked

    by_length, chunked, small_chunked = call(app, fn)
    for r in (by_length, chunked):
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert "1000 bytes" in err["message"] and err["code"] == "request_too_large"
    assert small_chunked.status_code == 200 and small_chunked.json()["choices"][0]["text"] == "ab"


async def _iter(data: bytes):
    yield data


def test_key_on_every_route_but_health_and_metrics_opt_out():
    _, app = make()
    _, open_metrics = make(metrics_without_auth=True)

    async def fn(c):
        return {path: (await c.get(path)).status_code for path in ("/health", "/metrics", "/version", "/v1/models")} | {
            "/tokenize": (await c.post("/tokenize", json={"prompt": "x"})).status_code,
            "/detokenize": (await c.post("/detokenize", json={"tokens": [65]})).status_code,
            "/metrics+key": (await c.get("/metrics", headers=KEY)).status_code,
            "/tokenize+key": (await c.post("/tokenize", json={"prompt": "x"}, headers=KEY)).status_code,
        }

    assert call(app, fn) == {"/health": 200, "/metrics": 401, "/version": 401, "/v1/models": 401,
                             "/tokenize": 401, "/detokenize": 401, "/metrics+key": 200, "/tokenize+key": 200}
    assert call(open_metrics, fn)["/metrics"] == 200


def test_waiting_queue_bound_refuses_with_503_and_retry_after():
    # Two requests run, everything else waits: with max_waiting_requests=3 the 6th is refused.
    engine = FakeEngine(step_time=0.005, max_running=2)
    state, app = make(engine, llm={"max_waiting_requests": 3})

    async def fn(c):
        body = {"prompt": "hi", "max_tokens": 40}
        tasks = []
        for _ in range(5):
            tasks.append(asyncio.ensure_future(c.post("/v1/completions", json=body, headers=KEY)))
            await asyncio.sleep(0.03)  # each is accepted (and counted as waiting) before the next
        refused = await c.post("/v1/completions", json=body, headers=KEY)
        done = await asyncio.gather(*tasks)
        after = await c.post("/v1/completions", json={**body, "max_tokens": 2}, headers=KEY)
        return refused, done, after

    refused, done, after = call(app, fn)
    assert refused.status_code == 503, refused.text
    assert refused.headers["retry-after"] == "1"
    err = refused.json()["error"]
    assert err["code"] == "server_overloaded" and "max_waiting_requests" in err["message"]
    assert [r.status_code for r in done] == [200] * 5  # nothing accepted is lost
    assert after.status_code == 200  # the queue drained: admitted again
    assert state.engine.num_open_requests == 0


def test_request_timeout_aborts_and_frees_both_ways():
    engine = FakeEngine(step_time=0.02)
    state, app = make(engine, llm={"request_timeout": 0.3})

    async def fn(c):
        full = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1000}, headers=KEY)
        stream = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1000, "stream": True},
                              headers=KEY)
        quick = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}, headers=KEY)
        await asyncio.sleep(0.1)  # the engine thread applies the aborts
        return full, stream, quick

    full, stream, quick = call(app, fn)
    assert full.status_code == 408 and full.json()["error"]["code"] == "request_timeout"
    assert "0.3 s" in full.json()["error"]["message"]
    assert full.headers["x-should-retry"] == "false"  # (the SDKs ran it three times over)
    evs = events(stream.text)
    assert evs[-1] == "[DONE]" and evs[-2]["error"]["code"] == "request_timeout"
    assert any("choices" in e for e in evs[:-2])  # tokens flowed before the deadline
    assert quick.status_code == 200
    assert len(engine.aborted) == 2 and not engine.reqs  # both timed-out requests left the engine


def test_a_responses_stream_that_times_out_ends_with_response_failed():
    """The Responses API's shape of a mid-stream error: an `error` event, then
    `response.failed` carrying the response with status "failed" and its error."""
    import json

    state, app = make(FakeEngine(step_time=0.02), llm={"request_timeout": 0.3})

    async def fn(c):
        return await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1000, "stream": True},
                            headers=KEY)

    r = call(app, fn)
    data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in data[-2:]] == ["error", "response.failed"]
    assert data[-2]["code"] == "request_timeout"  # (the server's own code: in the error event)
    failed = data[-1]["response"]
    # the response's error.code in OpenAI's values, which its SDK's types validate
    # (request_timeout failed them); the whole response too
    from openai.types.responses import Response

    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert Response.model_validate(failed).error.message.startswith("The request ran longer")
    assert [d["sequence_number"] for d in data] == list(range(len(data)))


def test_abort_all_ends_open_streams_with_an_error_event_and_admission_closes():
    engine = FakeEngine(step_time=0.02)
    state, app = make(engine)

    async def fn(c):
        stream = asyncio.ensure_future(c.post("/v1/completions", headers=KEY, json={
            "prompt": "hi", "max_tokens": 1000, "stream": True}))
        full = asyncio.ensure_future(c.post("/v1/completions", headers=KEY, json={"prompt": "hi", "max_tokens": 1000}))
        while state.engine.num_open_requests < 2:
            await asyncio.sleep(0.01)
        state.engine.close_admission(EngineShutdownError("The server is shutting down and accepts no new requests."))
        refused = await c.post("/v1/completions", headers=KEY, json={"prompt": "hi", "max_tokens": 2})
        state.engine.abort_all(EngineShutdownError("The server shut down before this request finished."))
        results = await asyncio.gather(stream, full)
        await asyncio.sleep(0.1)
        return refused, *results

    refused, stream, full = call(app, fn)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert full.status_code == 503 and "shut down before" in full.json()["error"]["message"]
    evs = events(stream.text)
    assert evs[-1] == "[DONE]" and evs[-2]["error"]["code"] == "shutting_down"
    assert not engine.reqs and state.engine.num_open_requests == 0


def test_an_unexpected_error_is_a_500_without_internals():
    class Exploding(FakeEngine):
        def encode_chat(self, *args, **kwargs):
            raise KeyError("/secret/path/to/template.jinja")

    _, app = make(Exploding())

    async def fn(c):
        bad = await c.post("/v1/chat/completions", headers=KEY,
                           json={"messages": [{"role": "user", "content": "x"}]})
        ok = await c.post("/v1/completions", headers=KEY, json={"prompt": "hi", "max_tokens": 2})
        return bad, ok

    transport_app = app

    async def main():
        transport = httpx.ASGITransport(app=transport_app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await fn(c)

    bad, ok = asyncio.run(main())
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "KeyError" in err["message"]
    assert "/secret" not in bad.text and "Traceback" not in bad.text
    assert ok.status_code == 200  # the server keeps serving


def test_engine_death_fails_open_requests_and_calls_on_dead():
    seen: list[str] = []
    engine = FakeEngine(step_time=0.01, fail_after_steps=2)

    async def main():
        llm = AsyncLLM(engine, log_stats=False, on_dead=lambda e: seen.append(type(e).__name__))
        stream = await llm.add_request("r", "hi", _params(50))
        try:
            async for _ in stream:
                pass
        except Exception as e:  # noqa: BLE001
            seen.append(str(e))
        await asyncio.sleep(0.05)
        return llm

    llm = asyncio.run(main())
    assert llm.errored
    assert "RuntimeError" in seen  # on_dead: the server exits non-zero
    (message,) = [m for m in seen if m != "RuntimeError"]
    assert message.startswith("The engine failed (RuntimeError") and "simulated" not in message


def _params(max_tokens: int):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens)


def test_a_stream_nobody_reads_holds_one_snapshot_not_every_step():
    """A client that stops reading costs one cumulative output, however many steps run."""
    engine = FakeEngine(step_time=0.001)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        stream = await llm.add_request("r", "hi", _params(300))
        while engine.reqs:  # the engine runs all 300 steps while nobody reads
            await asyncio.sleep(0.01)
        held = [stream._collector.item]  # what is buffered for the request: one object
        outs = [out async for out in stream]
        return held, outs

    held, outs = asyncio.run(main())
    assert held[0] is not None and len(outs) == 1  # intermediate snapshots were replaced, not queued
    assert outs[0].finished and len(outs[0].outputs[0].token_ids) == 300


# ------------------------------------------------------------ slow clients, hosts, keys
def _uvicorn_server(app, read_timeout: float, **config):
    """The app behind a real uvicorn (in a thread) with the server's protocol: the header
    deadline lives in the HTTP protocol, below anything an ASGI test client reaches."""
    import socket
    import threading

    import uvicorn

    from pagedserve.entrypoints.openai.http_utils import header_timeout_protocol

    # Bound here and handed over: a port drawn and released could be another server's by
    # the time uvicorn binds it (another test worker's), and this would wait forever.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", http=header_timeout_protocol(read_timeout), **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.01)
    return server, thread, port


def test_slow_headers_and_bodies_are_cut_off():
    import socket

    _, app = make(FakeEngine(step_time=0.1), http_read_timeout=0.5)
    server, thread, port = _uvicorn_server(app, 0.5)
    try:
        # Pipelined: a second request already buffered behind the first is served whole,
        # not cut off by a header timer armed while it ran.
        body = b'{"prompt": "hi", "max_tokens": 8}'
        first = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                 b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(first + first)  # each takes 0.8 s, past the 0.5 s header deadline
            got = b""
            while got.count(b"HTTP/1.1 200") < 2:
                chunk = s.recv(65536)
                assert chunk, got[-300:]  # closed before the second answer
                got += chunk
        # Headers trickling in: the connection is closed once the deadline passes, though
        # bytes keep arriving (uvicorn's own keep-alive timer restarts on every byte).
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            t0 = time.monotonic()
            closed = False
            for ch in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
                try:
                    s.sendall(bytes([ch]))
                    time.sleep(0.05)
                    s.setblocking(False)
                    if s.recv(1) == b"":
                        closed = True
                        break
                except BlockingIOError:
                    pass
                except OSError:
                    closed = True
                    break
                finally:
                    s.setblocking(True)
            assert closed and time.monotonic() - t0 < 3
        # A body that stops short of its Content-Length: 408 at the deadline.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
            t0 = time.monotonic()
            reply = b""
            while b"--http-read-timeout" not in reply:  # the head and the body may come apart
                chunk = s.recv(65536)
                assert chunk, reply[-300:]
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
            assert time.monotonic() - t0 < 3
        # A prompt client is served as before.
        r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert r.status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_body_of_many_tiny_chunks_is_refused_and_one_of_fewer_is_served():
    """Each chunk of a chunked body costs the event loop its parsing in Python (h11): a
    client sending one-byte chunks held it whole (/health 2 s).  Past MAX_BODY_PIECES
    chunks averaging under MIN_BODY_PIECE_BYTES, a 400 that says so; the same body in
    fewer chunks is served."""
    import socket

    from pagedserve.request_limits import MAX_BODY_PIECES, MIN_BODY_PIECE_BYTES

    _, app = make(FakeEngine(script="ab"))
    server, thread, port = _uvicorn_server(app, 30.0)
    body = b'{"prompt": "hi", "max_tokens": 2}' + b" " * (MAX_BODY_PIECES + 100)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")

    def send(size: int) -> bytes:
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size])
                          for i in range(0, len(body), size))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head + chunks + b"0\r\n\r\n")
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith((b"}", b".")):
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        return reply

    try:
        tiny = send(1)
        assert tiny.startswith(b"HTTP/1.1 400") and b"%d chunks" % MAX_BODY_PIECES in tiny, tiny[-300:]
        served = send(MIN_BODY_PIECE_BYTES)
        assert served.startswith(b"HTTP/1.1 200") and b'"text":"ab"' in served, served[-300:]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_a_compressed_body_is_refused_by_its_encoding():
    """Content-Encoding was never read: a gzip body was "not UTF-8 text", and the header on a
    plain body was ignored."""
    import gzip

    _, app = make()
    body = b'{"prompt": "hi", "max_tokens": 2}'

    async def fn(c):
        return [await c.post("/v1/completions", content=content, headers={
            **KEY, "content-type": "application/json", "content-encoding": encoding})
            for content, encoding in ((gzip.compress(body), "gzip"), (body, "gzip"), (body, "identity"))]

    zipped, labelled, plain = call(app, fn)
    for r in (zipped, labelled):
        assert r.status_code == 415 and "Content-Encoding 'gzip' is not supported" in r.json()["error"]["message"]
    assert plain.status_code == 200


def test_allowed_hosts_defaults_and_flag():
    from pagedserve.entrypoints.openai.http_utils import parse_allowed_hosts

    assert parse_allowed_hosts(None, "127.0.0.1") == {"127.0.0.1", "localhost", "::1"}
    assert parse_allowed_hosts(None, "0.0.0.0") is None and parse_allowed_hosts(None, "::") is None
    assert parse_allowed_hosts("api.example.com, 10.0.0.5", "0.0.0.0") == {"api.example.com", "10.0.0.5"}
    assert parse_allowed_hosts("*", "127.0.0.1") is None
    state, app = make()
    state.allowed_hosts = parse_allowed_hosts(None, "127.0.0.1")

    async def fn(c):
        return [(await c.get("/health", headers={"Host": h})).status_code
                for h in ("127.0.0.1:8000", "LOCALHOST", "127.0.0.2", "[::1]:80", "evil.example", "rebind.test:8000")]

    assert call(app, fn) == [200, 200, 200, 200, 400, 400]


def test_an_api_key_clients_cannot_send_is_refused_at_start():
    import subprocess
    import sys

    for key in ("ключ", " k"):
        proc = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--api-key", key,
                               "--port", "1"], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "printable ASCII" in proc.stderr, proc.stderr[-500:]


@pytest.mark.parametrize("flags, message", [
    (["--log-stats-interval", "-5"], "--log-stats-interval must be a number of seconds > 0"),  # (logged every step)
    (["--log-stats-interval", "0"], "--log-stats-interval must be"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be >= 0"),
    (["--enable-log-requests", "--disable-log-requests"], "contradict each other"),
    (["--max-log-len", "-1"], "--max-log-len must be >= 0"),
    (["--request-timeout", "nan"], "request_timeout must be a positive number"),  # (every request timed out)
    (["--api-key", ""], "--api-key is empty"),  # (the server ran without a key)
    (["--host", ""], "--host must not be empty"),  # (it bound every interface)
    (["--port", "70000"], "--port must be in 0..65535"),  # (refused by uvicorn after the model loaded)
    (["--served-model-name", ""], "--served-model-name: a name must not be empty"),  # (it answered as "")
    (["--seed", str(10**23)], "seed must be a 64-bit integer"),  # ("Overflow when unpacking long long")
])
def test_server_flags_out_of_range_are_refused_at_start(flags, message):
    import argparse

    from pagedserve.entrypoints.openai.api_server import configure, make_arg_parser

    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["smollm2-135m-instruct", *flags])
    with pytest.raises(SystemExit, match=message):
        configure(args)


def test_the_api_key_comes_from_the_flag_then_ours_then_vllms_variable(monkeypatch):
    """A deployment moved from vLLM keeps its $VLLM_API_KEY: it was not read, and the
    server ran open."""
    import argparse

    from pagedserve.entrypoints.openai.api_server import configure, make_arg_parser

    def key(*flags: str) -> str | None:
        return configure(make_arg_parser(argparse.ArgumentParser()).parse_args(["smollm2-135m-instruct", *flags])
                         )[1].api_key

    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert key() is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert key() == "from-vllm"
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "ours")
    assert key() == "ours" and key("--api-key", "flag") == "flag"
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "")
    monkeypatch.setenv("VLLM_API_KEY", " spaced")
    with pytest.raises(SystemExit, match=r"\$VLLM_API_KEY\) must be printable ASCII"):
        key()


def test_a_modifier_without_the_flag_it_modifies_is_warned_of(caplog):
    """`--max-log-len 100` alone logs no request, `--allow-credentials` alone opens no
    CORS, `--max-loras 4` alone serves no adapter: each is named at start (it passed in
    silence); with its flag, nothing is said."""
    import argparse

    from pagedserve.entrypoints.openai.api_server import configure, make_arg_parser

    parser = make_arg_parser(argparse.ArgumentParser())
    with caplog.at_level("WARNING", logger="pagedserve"):
        configure(parser.parse_args(["smollm2-135m-instruct", "--max-log-len", "100", "--allow-credentials",
                                     "--max-loras", "4"]))
    said = [r.getMessage() for r in caplog.records if "has no effect without" in r.getMessage()]
    assert sorted(said) == sorted(["--max-log-len has no effect without --enable-log-requests",
                                   "--allow-credentials has no effect without --allowed-origins",
                                   "max_loras has no effect without enable_lora (--enable-lora)"])
    caplog.clear()
    with caplog.at_level("WARNING", logger="pagedserve"):
        configure(parser.parse_args(["smollm2-135m-instruct", "--max-log-len", "100", "--enable-log-requests"]))
    assert not [r for r in caplog.records if "has no effect without" in r.getMessage()]


def test_api_key_is_compared_as_bytes():
    state, app = make()

    async def fn(c):
        good = await c.get("/v1/models", headers={"Authorization": "Bearer k"})
        bad = await c.get("/v1/models", headers={"Authorization": b"Bearer k\xc3\xa9"})
        return good.status_code, bad.status_code

    assert call(app, fn) == (200, 401)


def test_x_request_id_names_the_answer_and_is_echoed_with_the_flag(caplog):
    """vLLM's X-Request-Id: the answer's id is "<kind>-<header>" (over the body's
    request_id); --enable-request-id-headers puts it (or a new one) on every answer;
    --enable-log-requests logs each accepted request with its body, cut to --max-log-len."""
    import logging

    _, plain = make()
    _, flagged = make(request_id_headers=True, log_requests=40)
    ask = {"model": "fake", "prompt": "hello there", "max_tokens": 2}

    async def fn(c):
        named = await c.post("/v1/completions", json={**ask, "request_id": "body"},
                             headers={**KEY, "X-Request-Id": "trace-7"})
        chat = await c.post("/v1/chat/completions", headers={**KEY, "X-Request-Id": "trace-8"},
                            json={"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        bad = await c.post("/v1/completions", json=ask, headers={**KEY, "X-Request-Id": "x" * 300})
        return named, chat, bad

    named, chat, bad = call(plain, fn)
    assert named.json()["id"] == "cmpl-trace-7" and chat.json()["id"] == "chatcmpl-trace-8"
    assert "x-request-id" not in named.headers  # (only with the flag)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    with caplog.at_level(logging.INFO, logger="pagedserve.api_server"):
        named, chat, _ = call(flagged, fn)
    assert named.headers["x-request-id"] == "trace-7" and chat.headers["x-request-id"] == "trace-8"

    async def bare(c):
        return await c.get("/v1/models", headers=KEY)

    assert len(call(flagged, bare).headers["x-request-id"]) == 32  # (none given: a new one)
    [line] = [r.getMessage() for r in caplog.records if "cmpl-trace-7" in r.getMessage()]
    assert line.startswith('request cmpl-trace-7 accepted on /v1/completions: {"model": "fake", ')
    assert line.endswith("...") and len(line.split(": ", 1)[1]) == 40 + 3


@settings(max_examples=60, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=30),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
                    max_leaves=30),
       st.integers(0, 200))
def test_a_logged_bodys_head_is_its_json_cut(value, limit):
    """--enable-log-requests encodes a body only as far as --max-log-len (it encoded all of
    a 30 MB body on the event loop): the same characters json.dumps gives, cut."""
    import json

    from pagedserve.entrypoints.openai.routers.generation import json_head

    full = json.dumps(value, ensure_ascii=False)
    assert json_head(value, limit) == (full[:limit], len(full) > limit)


def test_a_queued_stream_sends_its_role_with_its_first_token():
    """A chat stream waiting behind a full batch sends nothing until its first token: its
    role chunk came at once, which clients (vLLM's benchmark too) took for the first token."""
    import threading

    engine = FakeEngine(step_time=0.05, max_running=1)
    _, app = make(engine)
    server, thread, port = _uvicorn_server(app, 30)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        blocker = threading.Thread(target=httpx.post, args=(url,), kwargs={
            "json": {"messages": [{"role": "user", "content": "a"}], "max_tokens": 40}, "headers": KEY,
            "timeout": 30})
        blocker.start()
        deadline = time.monotonic() + 10
        while engine.steps == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        body = {"messages": [{"role": "user", "content": "b"}], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", url, json=body, headers=KEY, timeout=30) as r:
            lines = (line for line in r.iter_lines() if line)
            first = next(lines)
            steps_at_first = engine.steps
            rest = list(lines)
        blocker.join()
        assert '"role":"assistant"' in first.replace(" ", "")
        assert steps_at_first >= 40  # the blocker's 40 tokens came first
        assert rest[-1] == "data: [DONE]" and '"content":"a"' in rest[0].replace(" ", "")
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "-5"], "max_model_len must be"),  # (these two: only once the socket was bound)
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--api-server-count", "2"], "--api-server-count 2 is not supported here: one API process"),
    (["--response-role", "user"], "--response-role 'user' is not supported here"),
    (["--return-tokens-as-token-ids"], "--return-tokens-as-token-ids True is not supported"),
    (["--chat-template-content-format", "openai"], "vLLM's auto"),
    (["--ssl-keyfile", "/nonexistent.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/nonexistent.pem", "--ssl-certfile", "/nonexistent.pem"], "--ssl-keyfile: no file"),
    # a file that is not PEM ended the start in uvicorn's traceback; CA flags without HTTPS were ignored
    (["--ssl-keyfile", __file__, "--ssl-certfile", __file__], "not a PEM certificate"),
    (["--ssl-ca-certs", __file__], "need HTTPS"), (["--ssl-cert-reqs", "2"], "need HTTPS"),
    (["--root-path", "api"], "--root-path must start with '/'"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' is neither an address nor a name"),
    (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--chat-template", "{{ x }"], "chat_template is not a valid Jinja template"),
])
def test_vllms_server_flags_are_checked_at_start(flags, message):
    import argparse

    from pagedserve.entrypoints.openai.api_server import configure, make_arg_parser

    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["smollm2-135m-instruct", *flags])
    with pytest.raises(SystemExit, match=message):
        configure(args)


def test_a_config_file_gives_flags_the_command_line_overrides(tmp_path):
    import argparse

    from pagedserve.entrypoints.openai.api_server import configure, make_arg_parser, parse_args

    (tmp_path / "c.yaml").write_text("port: 8123\nmax-model-len: 2k\nenable_prefix_caching: false\n"
                                     "served-model-name: [a, b]\ndisable-fastapi-docs: true\n"
                                     "default-chat-template-kwargs: {enable_thinking: false}\nhost: 0.0.0.0\n"
                                     "allowed-origins: ['https://a.example']\n")
    parser = make_arg_parser(argparse.ArgumentParser(allow_abbrev=False))
    args = parse_args(parser, ["smollm2-135m-instruct", "--config", str(tmp_path / "c.yaml"), "--port", "9000"])
    assert (args.port, args.host, args.served_model_name, args.model_tag) == (9000, "0.0.0.0", ["a", "b"],
                                                                            ["smollm2-135m-instruct"])
    engine_args, state = configure(args)
    assert engine_args.max_model_len == 2000 and engine_args.enable_prefix_caching is False
    assert state.serving_options.default_chat_template_kwargs == {"enable_thinking": False}
    assert not state.fastapi_docs and state.served_model_names == ["a", "b"]
    assert state.cors.allow_origins == ["https://a.example"]  # (a list for a JSON flag: its JSON)
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(SystemExit):
        parse_args(parser, ["--config", str(tmp_path / "bad.yaml")])
    with pytest.raises(SystemExit, match="--config: give one config file"):  # (a parse that skipped the file)
        configure(parser.parse_args(["--config", str(tmp_path / "c.yaml")]))
    with pytest.raises(SystemExit, match="--config: give one config file"):  # (it said the parse skipped it)
        configure(parse_args(parser, ["--config", str(tmp_path / "c.yaml"), "--config", str(tmp_path / "c.yaml")]))


def test_server_wide_request_defaults_and_no_docs():
    """--default-chat-template-kwargs reach the template under a request's own keys;
    --enable-force-include-usage ends every stream with usage; --disable-fastapi-docs."""
    from pagedserve.entrypoints.openai.serving_engine import ServingOptions

    seen = []

    class Recording(FakeEngine):
        def encode_chat(self, messages, chat_template=None, add_generation_prompt=True, **kwargs) -> dict:
            seen.append(kwargs.get("chat_template_kwargs"))
            return super().encode_chat(messages, chat_template, add_generation_prompt, **kwargs)

    state, app = make(Recording(), serving_options=ServingOptions({"enable_thinking": False, "x": 1}, True),
                      fastapi_docs=False)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def fn(c):
        await c.post("/v1/chat/completions", json={**chat, "chat_template_kwargs": {"x": 2}}, headers=KEY)
        streamed = await c.post("/v1/chat/completions", json={**chat, "stream": True}, headers=KEY)
        completion = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                                  headers=KEY)
        return streamed, completion, [(await c.get(p, headers=KEY)).status_code for p in ("/docs", "/openapi.json")]

    streamed, completion, docs = call(app, fn)
    assert seen[0] == {"enable_thinking": False, "x": 2} and seen[1] == {"enable_thinking": False, "x": 1}
    for r in (streamed, completion):
        assert events(r.text)[-2]["usage"]["completion_tokens"] == 2, r.text[-300:]
    assert docs == [404, 404]


def test_server_load_counts_requests_at_work_until_their_last_byte():
    _, app = make(FakeEngine(step_time=0.02), server_load=0)
    _, untracked = make()

    async def fn(c):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True}
        work = [asyncio.create_task(c.post("/v1/chat/completions", json=body, headers=KEY)) for _ in range(2)]
        seen = []
        while not all(t.done() for t in work):
            seen.append((await c.get("/load", headers=KEY)).json()["server_load"])
            await asyncio.sleep(0.01)
        await c.post("/tokenize", json={"prompt": "x"}, headers=KEY)  # (not engine work)
        return seen, (await c.get("/load", headers=KEY)).json()

    seen, after = call(app, fn)
    assert max(seen) == 2 and after == {"server_load": 0}

    async def off(c):
        return await c.get("/load", headers=KEY)

    r = call(untracked, off)
    assert r.status_code == 404 and "--enable-server-load-tracking" in r.json()["error"]["message"]


def test_http_series_count_answers_by_route_template_status_and_method():
    """vLLM's http_requests_total and http_request_duration_seconds; a made-up path or
    method adds no series of its own."""
    _, app = make()

    async def fn(c):
        await c.get("/v1/models", headers=KEY)
        await c.get("/v1/models/fake", headers=KEY)
        await c.get("/v1/models/fake")  # (401: before any route)
        for i in range(3):
            await c.get(f"/no/such/{i}", headers=KEY)
        await c.request("BREW", "/v1/models", headers=KEY)
        await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True}, headers=KEY)
        await c.get("/api/tags", headers=KEY)  # (Ollama's routes too: their JSON rule copied the scope)
        return (await c.get("/metrics", headers=KEY)).text

    text = call(app, fn)
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("http_requests_total{")}
    assert series['http_requests_total{handler="/v1/models",method="GET",status="2xx"}'] == 1
    assert series['http_requests_total{handler="/v1/models/{model_id:path}",method="GET",status="2xx"}'] == 1
    assert series['http_requests_total{handler="none",method="GET",status="4xx"}'] == 4
    assert series['http_requests_total{handler="/v1/completions",method="POST",status="2xx"}'] == 1
    assert series['http_requests_total{handler="/api/tags",method="GET",status="2xx"}'] == 1
    assert any('method="OTHER"' in k for k in series) and len(series) == 6, series
    assert 'http_request_duration_seconds_count{handler="/v1/completions",method="POST"} 1.0' in text


def test_behind_a_root_path_every_guard_sees_the_routes_path():
    """uvicorn puts --root-path in front of the path: /health asked for the key, /load
    counted nothing, Anthropic's errors lost their shape."""
    _, app = make(FakeEngine(), server_load=0)
    server, thread, port = _uvicorn_server(app, 30, root_path="/api")
    base = f"http://127.0.0.1:{port}"
    try:
        assert httpx.get(base + "/health", timeout=10).status_code == 200  # (no key: a public route)
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
        r = httpx.post(base + "/v1/messages", json={"model": "fake"}, headers={"x-api-key": "k"}, timeout=10)
        assert r.status_code == 400 and r.json()["type"] == "error" and r.headers.get("request-id")
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(base + "/v1/completions", json=body, headers=KEY, timeout=10).status_code == 200
        metrics = httpx.get(base + "/metrics", headers=KEY, timeout=10).text
        assert 'http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1.0' in metrics
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_tools_beside_an_answer_format_no_grammar_joins_are_named():
    """tool_choice auto beside a response format: where no one grammar holds both (the
    pythonic format, a regex answer), a 400 names it: the answer would have called no tool."""
    from pagedserve.entrypoints.openai.tool_parsers import HermesToolParser, PythonicToolParser

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}}
    results = []
    for parser, extra in ((PythonicToolParser(), {"response_format": fmt}),
                          (HermesToolParser(), {"structured_outputs": {"regex": "[ab]+"}})):
        state = ServerState(served_model_names=["fake"], api_key="k")
        app = build_app(state)
        state.attach(Attachment.local(AsyncLLM(FakeEngine(), log_stats=False), 4096), parser)

        async def fn(c, extra=extra):
            return await c.post("/v1/chat/completions", headers=KEY, json={
                "messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2, **extra})

        results.append(call(app, fn))
    pythonic, regex = results
    assert pythonic.status_code == 400 and "the pythonic tool-call format" in pythonic.json()["error"]["message"]
    assert regex.status_code == 400 and "not a regex" in regex.json()["error"]["message"]
