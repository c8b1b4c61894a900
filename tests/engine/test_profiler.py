"""On-demand torch profiles (engine/profiler.py): off unless a directory is named; one at a
time; every thread's operators recorded (a server's engine steps on its own thread); a
server's stops itself; and the routes and LLM methods vLLM's scripts call."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from pagedserve.engine.profiler import Profiler, profiler_dir


def _ops(path: str) -> set[str]:
    with open(path) as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def test_a_profile_records_another_threads_operators_and_writes_one_trace(tmp_path) -> None:
    profiler = Profiler(str(tmp_path / "traces"))
    profiler.start("run/../1")  # (a file name: no path of the caller's)
    with pytest.raises(RuntimeError, match="already running"):
        profiler.start()
    engine = threading.Thread(target=lambda: torch.mm(torch.ones(8, 8), torch.ones(8, 8)))
    engine.start()
    engine.join()
    path = profiler.stop()
    assert os.path.dirname(path) == str(tmp_path / "traces") and os.path.basename(path).startswith("run_.._1-")
    assert "aten::mm" in _ops(path)
    with pytest.raises(RuntimeError, match="no profile is running"):
        profiler.stop()


def test_off_unless_a_directory_is_named_and_a_server_profile_stops_itself(tmp_path, monkeypatch) -> None:
    for name in ("PAGEDSERVE_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert profiler_dir() is None
    with pytest.raises(RuntimeError, match="profiling is off"):
        Profiler(None).start()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))
    assert profiler_dir() == str(tmp_path)
    assert profiler_dir({"profiler": "torch", "torch_profiler_dir": "d"}) == "d"
    for bad in ({"profiler": "cuda", "torch_profiler_dir": "d"}, {"torch_profiler_dir": "d", "record_shapes": 1},
                {"profiler": "torch"}):
        with pytest.raises(ValueError, match="profiler_config takes"):
            profiler_dir(bad)
    (tmp_path / "file").write_text("")  # (a file: /start_profile was a 500)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"\$VLLM_TORCH_PROFILER_DIR '.*file' is a file; profiles are written to a"):
        profiler_dir()
    with pytest.raises(ValueError, match="profiler_config's torch_profiler_dir '.*file' is a file"):
        profiler_dir({"profiler": "torch", "torch_profiler_dir": str(tmp_path / "file")})
    with pytest.raises(RuntimeError, match="cannot make the trace directory '.*file/sub' \\(Not a directory\\)"):
        Profiler(str(tmp_path / "file" / "sub")).start()
    bounded = Profiler(str(tmp_path), max_seconds=0.2)
    bounded.start()
    deadline = time.monotonic() + 10
    while not list(tmp_path.glob("*.pt.trace.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(tmp_path.glob("*.pt.trace.json"))) == 1
    bounded.start()  # (the one that stopped itself is over)
    with pytest.raises(RuntimeError, match="no profile is running"):  # (the first one's timer, late: not this one)
        bounded.stop(which=1)
    bounded.stop()


def test_the_servers_routes(tmp_path) -> None:
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.entrypoints.openai.api_server import Attachment, ServerState, build_app
    from tests.engine.fake_engine import FakeEngine
    from tests.entrypoints.openai.test_api_fake_engine import call

    state = ServerState(served_model_names=["fake"])
    app = build_app(state)
    state.attach(Attachment.local(AsyncLLM(FakeEngine(script="hello"), log_stats=False), 2048))

    async def run(client):
        state.profiler = Profiler(None)
        off = await client.post("/start_profile")
        state.profiler = Profiler(str(tmp_path))
        started = await client.post("/start_profile")
        again = await client.post("/start_profile")
        await client.post("/v1/completions", json={"model": "fake", "prompt": "x", "max_tokens": 3})
        stopped = await client.post("/stop_profile")
        return off, started, again, stopped, await client.post("/stop_profile")

    off, started, again, stopped, idle = call(app, run)
    assert off.status_code == 404 and "profiling is off" in off.json()["error"]["message"]
    assert started.status_code == 200 and again.status_code == 409 and idle.status_code == 409
    assert (tmp_path / stopped.json()["trace"]).is_file()
