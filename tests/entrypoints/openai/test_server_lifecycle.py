"""The real server process under signals and an engine fault: SIGTERM drains (new
requests 503, running ones finish, exit 0), past --shutdown-timeout the rest end with
an error event, a second signal exits at once, and an engine failure gives every open
request an error and exits 1 so a supervisor restarts it."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.conftest import API_KEY, MODEL_NAME, SERVER_FLAGS, ServerProcess

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


# Steps of at least 10 ms: a stream of 200 tokens lasts 2 s or more, so it is still running
# when the test signals and looks, however fast the machine.
SLOW_STEPS = {"module": "tests.entrypoints.openai.faulty_server", "env": {"STEP_DELAY_S": "0.01"}}


def start(tiny_model_dir, tmp_path, *extra: str, **kwargs) -> ServerProcess:
    return ServerProcess([str(tiny_model_dir), *SERVER_FLAGS, *extra], tmp_path / "server.log", **kwargs)


class Stream:
    """A streaming completion read in a thread: its events, and when the first arrived."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.events: list = []
        self.started = threading.Event()
        self.error: BaseException | None = None
        body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        self.events.append(data if data == "[DONE]" else json.loads(data))
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e
            self.started.set()

    def join(self) -> list:
        self.thread.join(timeout=60)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.events


def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_0(tiny_model_dir, tmp_path):
    srv = start(tiny_model_dir, tmp_path, "--shutdown-timeout", "60", **SLOW_STEPS)
    stream = Stream(srv.url, max_tokens=200)
    assert stream.started.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(srv.url + "/v1/completions", headers=HEADERS, timeout=10,
                         json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    health = httpx.get(srv.url + "/health", timeout=10)
    events = stream.join()
    assert srv.proc.wait(timeout=60) == 0, srv.log()
    srv.stop()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])  # it ran to the end
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_past_the_shutdown_timeout_open_streams_end_with_an_error_event(tiny_model_dir, tmp_path):
    srv = start(tiny_model_dir, tmp_path, "--shutdown-timeout", "0", **SLOW_STEPS)
    stream = Stream(srv.url, max_tokens=240)
    assert stream.started.wait(30)
    srv.proc.send_signal(signal.SIGTERM)
    events = stream.join()
    assert srv.proc.wait(timeout=60) == 0, srv.log()
    srv.stop()
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "shutting_down", events[-2]


def test_a_second_signal_exits_at_once(tiny_model_dir, tmp_path):
    srv = start(tiny_model_dir, tmp_path, "--shutdown-timeout", "60", **SLOW_STEPS)
    stream = Stream(srv.url, max_tokens=240)
    assert stream.started.wait(30)
    srv.proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    srv.proc.send_signal(signal.SIGINT)
    assert srv.proc.wait(timeout=10) == 128 + signal.SIGINT, srv.log()
    srv.stop()


@pytest.mark.timeout(180)
def test_an_engine_fault_fails_open_requests_and_exits_1(tiny_model_dir, tmp_path):
    srv = start(tiny_model_dir, tmp_path, module="tests.entrypoints.openai.faulty_server",
                env={"FAULT_AFTER_STEPS": "5"})
    stream = Stream(srv.url, max_tokens=100)
    events = stream.join()
    assert srv.proc.wait(timeout=60) == 1, srv.log()
    log = srv.log()
    srv.stop()
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_dead"
    assert "RuntimeError" in err["message"] and "/some/kernel" not in err["message"]  # no paths in bodies
    assert "injected fault" in log  # the details are in the log


def test_a_flood_past_the_waiting_bound_gets_503s_and_memory_stays_flat(tiny_model_dir, tmp_path):
    import asyncio

    import psutil

    srv = start(tiny_model_dir, tmp_path, "--max-waiting-requests", "4", "--max-num-seqs", "2")
    rss = psutil.Process(srv.proc.pid).memory_info

    async def flood(n: int) -> list[int]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, headers=HEADERS, timeout=60, limits=limits) as c:
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 16, "ignore_eos": True}
            rs = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(n)))
        for r in rs:
            if r.status_code == 503:
                assert r.headers["retry-after"] and r.json()["error"]["code"] == "server_overloaded"
        return [r.status_code for r in rs]

    asyncio.run(flood(100))  # warm-up
    before = rss().rss
    codes = [c for _ in range(2) for c in asyncio.run(flood(100))]
    after = rss().rss
    final = httpx.post(srv.url + "/v1/completions", headers=HEADERS, timeout=30,
                       json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    srv.stop()
    assert set(codes) == {200, 503} and codes.count(503) > codes.count(200), codes
    assert after - before < 32 << 20, (before, after)  # refusals cost no memory that stays
    assert final.status_code == 200


def test_the_ready_line_names_the_port_the_system_chose_for_port_0():
    """`--port 0` binds any free port; the log's ready line names that one, not 0."""
    import asyncio

    import uvicorn

    from pagedserve.entrypoints.openai.api_server import bound_url

    async def app(scope, receive, send) -> None:  # (never called: only bound)
        raise AssertionError(scope)

    async def bind() -> tuple[str, str]:
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="error"))
        before = bound_url(server, "127.0.0.1", 0)
        serving = asyncio.ensure_future(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        after = bound_url(server, "127.0.0.1", 0)
        server.should_exit = True
        await serving
        return before, after

    before, after = asyncio.run(bind())
    assert before == "http://127.0.0.1:0"
    port = int(after.rsplit(":", 1)[1])
    assert after == f"http://127.0.0.1:{port}" and 0 < port < 65536
