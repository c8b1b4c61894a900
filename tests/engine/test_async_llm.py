"""AsyncLLM against a fake engine: streaming, joining the batch, aborts, errors, and
that the engine thread does not starve the event loop."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from pagedserve.engine.core_client import EngineInfo
from pagedserve.metrics import make_prometheus_loggers
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.fake_engine import FakeEngine


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=30))


async def collect(llm: AsyncLLM, rid: str, max_tokens: int = 5, prompt="hi"):
    outs = []
    async for out in llm.generate(prompt, SamplingParams(max_tokens=max_tokens), rid):
        outs.append(out)
    return outs


def test_streams_cumulative_outputs_from_engine_thread():
    engine = FakeEngine(script="xyz")

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        outs = await collect(llm, "r1", max_tokens=7)
        llm.shutdown()
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].text == "xyzxyzx"
    assert outs[-1].outputs[0].finish_reason == "length"
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 7
    assert all(not o.finished for o in outs[:-1])
    assert threading.get_ident() not in engine.thread_ids  # the engine never ran on the loop thread
    assert len(engine.thread_ids) == 1


def test_output_kind_delta_and_final_only_as_vllms_asyncllm():
    """SamplingParams.output_kind (vLLM's): DELTA yields only what is new, also to a
    consumer slower than the engine (its outputs merged meanwhile); FINAL_ONLY the final
    output alone.  It was refused as an unknown argument."""
    engine = FakeEngine(script="xyz", step_time=0.002)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        deltas = []
        async for out in llm.generate("hi", SamplingParams(max_tokens=40, output_kind=RequestOutputKind.DELTA), "d"):
            deltas.append(out)
            await asyncio.sleep(0.005 * (len(deltas) % 3))  # now and then slower than a step
        finals = [out async for out in llm.generate(
            "hi", SamplingParams(max_tokens=40, output_kind=RequestOutputKind.FINAL_ONLY), "f")]
        [whole] = [o for o in await collect(llm, "c", max_tokens=40) if o.finished]
        llm.shutdown()
        return deltas, finals, whole

    deltas, finals, whole = run(main())
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].text for d in deltas) == whole.outputs[0].text == "xyz" * 13 + "x"
    assert [t for d in deltas for t in d.outputs[0].token_ids] == whole.outputs[0].token_ids
    assert all(len(d.outputs[0].token_ids) < 40 for d in deltas)
    assert len(finals) == 1 and finals[0].outputs[0].text == whole.outputs[0].text
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")


def test_new_request_joins_running_batch():
    engine = FakeEngine(step_time=0.001)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        long_stream = await llm.add_request("long", "hi", SamplingParams(max_tokens=1_000_000))
        await long_stream.__anext__()
        # The long request cannot finish for 10^6 steps: the short one must join its batch.
        short = await collect(llm, "short", max_tokens=3)
        long_running = "long" in engine.reqs
        long_stream.close()  # aborts it, at the engine thread's next turn
        while engine.has_unfinished_requests():
            await asyncio.sleep(0.001)
        llm.shutdown()
        return short, long_running

    short, long_running = run(main())
    assert short[-1].finished and len(short[-1].outputs[0].token_ids) == 3
    assert long_running and engine.aborted == ["long"]


def test_cancelled_consumer_aborts_request():
    engine = FakeEngine(step_time=0.002)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        got_first = asyncio.Event()

        async def consume():
            async for _ in llm.generate("p", SamplingParams(max_tokens=10_000), "victim"):
                got_first.set()

        task = asyncio.ensure_future(consume())
        await got_first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.005)
        # Breaking out of the loop (closing the iterator) aborts too.
        gen = llm.generate("p", SamplingParams(max_tokens=10_000), "closer")
        await gen.__anext__()
        await gen.aclose()
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.005)
        llm.shutdown()

    run(main())
    assert engine.aborted == ["victim", "closer"]
    assert not engine.reqs


def test_value_error_propagates_without_disturbing_others():
    engine = FakeEngine(step_time=0.002)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        good = asyncio.ensure_future(collect(llm, "good", max_tokens=20))
        with pytest.raises(ValueError, match="the prompt is empty"):
            await collect(llm, "bad", prompt=[])
        outs = await good
        # The engine still works afterwards, and the failed id can be reused.
        again = await collect(llm, "bad", max_tokens=2)
        llm.shutdown()
        return outs, again

    outs, again = run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 20
    assert again[-1].finished


def test_engine_failure_marks_dead_and_fails_inflight():
    engine = FakeEngine(step_time=0.001, fail_after_steps=3)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        with pytest.raises(EngineDeadError, match=r"failed \(RuntimeError") as info:
            await collect(llm, "doomed", max_tokens=100)
        assert "simulated device failure" in str(info.value.__cause__)
        assert llm.errored and not llm.client.is_running
        with pytest.raises(EngineDeadError):
            await collect(llm, "later")

    run(main())


def test_gil_holding_steps_do_not_starve_the_event_loop():
    """Every step spins in pure Python (holding the GIL) until the event loop has run
    once more, so a request can only finish if the loop runs while steps hold the GIL."""
    ticked = threading.Event()
    engine = FakeEngine(spin_until=ticked)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        task = asyncio.ensure_future(collect(llm, "busy", max_tokens=20))
        while not task.done():
            ticked.set()  # this line runs on the loop, between the engine thread's bytecodes
            await asyncio.sleep(0.001)
        llm.shutdown()
        return task.result()

    outs = run(main())
    assert outs[-1].finished and engine.steps >= 20


def test_stat_loggers_see_tokens_and_finishes():
    from prometheus_client import CollectorRegistry

    engine = FakeEngine()
    registry = CollectorRegistry()

    async def main():
        llm = AsyncLLM(engine, stat_loggers=[make_prometheus_loggers(registry, "fake")[0]], log_stats=True,
                       log_interval=1000)
        await asyncio.gather(collect(llm, "a", max_tokens=4, prompt="abc"),
                             collect(llm, "b", max_tokens=6, prompt="de"))
        llm.shutdown()
        return llm.log_stats

    log_stats = run(main())

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "fake", "engine": "0", **labels})

    assert value("vllm:prompt_tokens_total") == 5
    assert value("vllm:generation_tokens_total") == 10
    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:time_to_first_token_seconds_count") == 2
    assert value("vllm:inter_token_latency_seconds_count") == 3 + 5
    assert value("vllm:e2e_request_latency_seconds_count") == 2
    assert value("vllm:num_requests_running") == 0
    assert value("vllm:request_params_max_tokens_sum") == 4 + 6
    line = log_stats.maybe_log(now=time.monotonic() + 2000)
    assert line is not None and "Avg generation throughput:" in line and "Running: 0 reqs" in line
    assert "CPU KV cache usage: 0.0%" in line and "Prefix cache hit rate: 0.0%" in line
    # One all-zero line marks the end of activity (as vLLM does), then silence.
    assert "Avg generation throughput: 0.0 tokens/s" in log_stats.maybe_log(now=time.monotonic() + 4000)
    assert log_stats.maybe_log(now=time.monotonic() + 6000) is None


def test_a_request_without_max_tokens_is_in_the_max_tokens_histogram_at_what_the_context_leaves():
    """vLLM records the effective max_tokens; an unset one was left out, so the histogram's
    count fell behind the other per-request histograms'."""
    from prometheus_client import CollectorRegistry

    engine = FakeEngine(max_model_len=20)
    registry = CollectorRegistry()

    async def main():
        llm = AsyncLLM(engine, stat_loggers=[make_prometheus_loggers(registry, "fake")[0]], log_stats=False)
        [_ async for _ in llm.generate("abc", SamplingParams(max_tokens=None), "x")]
        llm.shutdown()

    run(main())

    def value(name):
        return registry.get_sample_value(name, {"model_name": "fake", "engine": "0"})

    assert value("vllm:request_params_max_tokens_count") == value("vllm:request_params_n_count") == 1
    assert value("vllm:request_params_max_tokens_sum") == 20 - 3


def test_an_unexpected_error_adding_one_request_fails_it_alone():
    class Buggy(FakeEngine):
        def add_request(self, request_id, prompt, params, arrival_time=None, priority=0, lora_request=None):
            if prompt == "boom":
                raise KeyError("a bug reached by this input")
            return super().add_request(request_id, prompt, params, arrival_time, priority, lora_request)

    async def main():
        llm = AsyncLLM(Buggy(), log_stats=False)
        with pytest.raises(KeyError):
            await llm.add_request("bad", "boom", SamplingParams(max_tokens=2))
        assert not llm.errored
        return await collect(llm, "good", max_tokens=3)

    run(main())


def test_bad_words_are_tokenized_off_the_engine_thread_once():
    """The engine thread gets the request with its bad words already as token ids (it
    once tokenized 1,024 long words per choice there, freezing every stream)."""
    engine = FakeEngine()

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        params = SamplingParams(max_tokens=3, n=4, bad_words=["xy", "zz"])
        async for _ in llm.generate("hi", params, "r1"):
            pass
        llm.shutdown()

    run(main())
    (seen,) = engine.params_seen
    assert seen.bad_words_token_ids == [[120, 121], [122, 122]]
    assert engine.bad_words_threads and not engine.bad_words_threads & engine.thread_ids


def test_a_pause_after_work_checks_the_kv_cache_and_a_broken_one_stops_the_engine(monkeypatch):
    """The integrity check runs once the engine has been idle a while after work, never
    while requests run; a broken invariant kills the engine (wrong answers would be worse)
    and the next request is told so."""
    import pagedserve.engine.inproc_client as inproc_client

    monkeypatch.setattr(inproc_client, "IDLE_TRIM_SECONDS", 0.05)
    engine = FakeEngine()

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        await collect(llm, "r1")
        deadline = time.monotonic() + 10
        while engine.invariant_checks == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert engine.invariant_checks == 1  # once per pause, not once per idle wake-up

        def broken() -> None:
            raise AssertionError("KV-cache invariant broken: test")

        engine.check_invariants = broken
        await collect(llm, "r2")
        while not llm.errored and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await collect(llm, "r3")
        llm.shutdown()

    run(main())


def test_an_executor_that_fails_while_idle_kills_the_engine_at_once(monkeypatch):
    """A tensor-parallel worker that dies while nothing runs: the idle engine notices
    within its wake-up interval and the engine is dead (the server answered /health 200
    until the next request's step found it)."""
    import pagedserve.engine.inproc_client as inproc_client

    monkeypatch.setattr(inproc_client, "IDLE_STATS_SECONDS", 0.05)
    engine = FakeEngine()

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        await collect(llm, "r1")
        assert not llm.errored
        engine.health_error = RuntimeError("tensor-parallel worker rank 1 (pid 1) was killed by SIGKILL")
        deadline = time.monotonic() + 10
        while not llm.errored and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert llm.errored and "rank 1" in str(llm.dead_error)
        with pytest.raises(EngineDeadError):
            await collect(llm, "r2")
        llm.shutdown()

    run(main())


def test_a_pause_after_work_hands_the_engine_threads_openmp_workers_back(monkeypatch):
    """Once idle a while after work, the engine thread frees its OpenMP workers: an idle
    engine's pool would keep another model's busy one from spinning (worker/cpu_threads.py)."""
    import threading

    import pagedserve.engine.inproc_client as inproc_client

    monkeypatch.setattr(inproc_client, "IDLE_TRIM_SECONDS", 0.05)
    released: list[threading.Thread] = []  # (engines other tests left running release too: counted apart)
    monkeypatch.setattr(inproc_client, "release_openmp_threads",
                        lambda: released.append(threading.current_thread()) or True)
    engine = FakeEngine()
    before = set(threading.enumerate())

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        await collect(llm, "r1")
        mine = [t for t in threading.enumerate() if t not in before]  # (its engine thread, started by now)
        deadline = time.monotonic() + 10
        while not [t for t in released if t in mine] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # (idle wake-ups without work in between release nothing more)
        llm.shutdown()
        return mine

    mine = run(main())
    ours = [t for t in released if t in mine]
    assert len(ours) == 1 and ours[0].name == "pagedserve-engine"


def test_memory_freed_at_intake_goes_back_at_the_idle_engines_next_pause(monkeypatch):
    """A prompt's decoded images are freed on an intake thread (cpu_malloc.note_freed_memory):
    the idle engine trims the heap at its next wake-up, once, and nothing trims without
    such a note or work."""
    import threading

    import pagedserve.engine.inproc_client as inproc_client
    from pagedserve.worker import cpu_malloc

    trims: list[threading.Thread] = []  # (engines other tests left running trim too: counted apart)
    monkeypatch.setattr(inproc_client, "release_freed_memory", lambda: trims.append(threading.current_thread()))
    monkeypatch.setattr(inproc_client, "IDLE_STATS_SECONDS", 0.05)
    cpu_malloc.take_freed_memory_note()  # (a note left by an earlier test's images)
    before = set(threading.enumerate())

    async def main():
        llm = AsyncLLM(FakeEngine(), log_stats=False)
        mine = [t for t in threading.enumerate() if t not in before]
        await asyncio.sleep(0.3)
        assert not [t for t in trims if t in mine]  # idle, nothing freed: nothing to hand back
        cpu_malloc.note_freed_memory()
        deadline = time.monotonic() + 10
        while not trims and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        llm.shutdown()
        return mine

    mine = run(main())
    # Acted on once, by an idle engine: this one, or one an earlier test left running in
    # this process (its own pauses after work may trim too, so only ours are counted).
    assert trims and len([t for t in trims if t in mine]) <= 1 and not cpu_malloc.take_freed_memory_note()


def test_the_waiting_bound_counts_the_queue_after_aborts_and_lets_a_fan_out_in_whole():
    """max_waiting_requests counts the scheduler's queue: waiting requests aborted while
    nothing steps leave it (a stale count had refused every later request with a 503,
    /health still 200), and a request of several prompts is let in or refused whole, its
    own prompts never counted against it."""
    engine = FakeEngine(max_running=0, step_time=0.01)  # every request waits: nothing is generated

    async def main():
        llm = AsyncLLM(engine, log_stats=False, max_waiting_requests=2)
        params = SamplingParams(max_tokens=3)
        fan_out = [await llm.add_request(f"f{i}", "hi", params, admitted=i > 0) for i in range(3)]  # past the bound
        with pytest.raises(EngineOverloadedError, match="2 requests are already waiting"):
            await llm.add_request("late", "hi", params)
        for stream in fan_out:
            stream.close()  # aborted: the engine is empty and steps no more
        deadline = time.monotonic() + 10
        while llm.client.num_waiting and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert llm.client.num_waiting == 0
        (await llm.add_request("after", "hi", params)).close()  # let in again
        llm.shutdown()

    run(main())


class _Client:
    """A client whose waiting count the test sets: AsyncLLM's admission alone, which is
    the same over every client (in-process or data-parallel)."""

    def __init__(self) -> None:
        self.info = EngineInfo(None, 256, 1000, {}, "guidance", "generate", None, 64, "CPU")
        self.dead_error: BaseException | None = None
        self.num_waiting = 0
        self.serving = True

    def start(self, sink) -> None:
        pass


def test_front_door_admission_is_the_same_for_every_client() -> None:
    client = _Client()
    client.num_waiting = 3
    door = AsyncLLM(client=client, log_stats=False, max_waiting_requests=3)
    with pytest.raises(EngineOverloadedError, match="3 requests are already waiting"):
        door._admit("a")
    client.num_waiting = 0
    door._admit("a")
    door._collectors["a"] = object()
    with pytest.raises(ValueError, match="already in use"):
        door._admit("a")
    door.close_admission(RuntimeError("shutting down"))
    with pytest.raises(RuntimeError, match="shutting down"):
        door._admit("b")
    # A client-worded dead error (the replicas' own) reaches requests as it is worded, a
    # new instance each time; any other failure is told by its kind only.
    client.dead_error = EngineDeadError("every engine replica has been down for over 600 s")
    errors = []
    for _ in range(2):
        with pytest.raises(EngineDeadError, match="every engine replica") as info:
            door._admit("c")
        errors.append(info.value)
    assert errors[0] is not errors[1] and errors[0] is not door.dead_error
    client.dead_error = OSError("/secret/path unreadable")
    with pytest.raises(EngineDeadError, match=r"The engine failed \(OSError") as info:
        door._admit("c")
    assert "/secret" not in str(info.value) and info.value.__cause__ is door.dead_error


def test_from_engine_args_builds_the_engine_on_a_thread_that_ends(monkeypatch):
    """Loading runs OpenMP regions, and libgomp keeps a worker pool per thread that ran one
    for as long as that thread lives: building on the caller's thread left two pools and
    a decode step 40% slower on the engine thread.  The build thread has ended by the time
    from_engine_args returns; its result and its exceptions come back to the caller."""
    from pagedserve.engine import async_llm
    from pagedserve.engine.arg_utils import EngineArgs
    from pagedserve.engine.inproc_client import InprocClient

    built_on: list[threading.Thread] = []

    def build(args):
        built_on.append(threading.current_thread())
        return FakeEngine(script="ab")

    monkeypatch.setattr(async_llm.LLMEngine, "from_engine_args", staticmethod(build))
    llm = AsyncLLM.from_engine_args(EngineArgs(), log_stats=False)
    assert isinstance(llm.client, InprocClient) and isinstance(llm.client.engine, FakeEngine)
    assert built_on[0] is not threading.current_thread() and not built_on[0].is_alive()

    def fail(args):
        raise ValueError("no such model")

    monkeypatch.setattr(async_llm.LLMEngine, "from_engine_args", staticmethod(fail))
    with pytest.raises(ValueError, match="no such model"):
        AsyncLLM.from_engine_args(EngineArgs(), log_stats=False)


def test_the_request_timeout_counts_from_arrival_preparation_included(monkeypatch):
    """The deadline was set once the engine had the request: tokenizing and a grammar's
    compile (seconds for some schemas) came on top of --request-timeout."""
    from pagedserve.engine.async_llm import RequestTimeoutError

    engine = FakeEngine(step_time=0.01)

    async def main():
        llm = AsyncLLM(engine, log_stats=False, request_timeout=1.0)
        llm.start()
        prepare = llm.client.prepare

        async def slow_prepare(*args, **kwargs):
            await asyncio.sleep(1.0)  # (its whole timeout: past the deadline once prepared)
            return await prepare(*args, **kwargs)

        monkeypatch.setattr(llm.client, "prepare", slow_prepare)
        t0 = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            async for _ in llm.generate("hi", SamplingParams(max_tokens=100_000), "slow"):
                pass
        elapsed = time.monotonic() - t0
        llm.shutdown()
        return elapsed

    assert run(main()) < 1.6  # (it ran 1 s more: the whole timeout after preparing)


def test_the_request_timeout_aborts_a_request_whose_stream_is_not_read() -> None:
    """The deadline was checked only when the stream read its next output: a client that
    stopped reading (its socket full, the writer blocked) kept its request stepping on the
    engine past the deadline, to max_tokens.  Now the request is aborted at the deadline,
    and the stream's next read raises the timeout."""
    from pagedserve.engine.async_llm import RequestTimeoutError

    async def main() -> tuple[int, float]:
        engine = FakeEngine(step_time=0.01)
        llm = AsyncLLM(engine, log_stats=False, request_timeout=0.3)
        stream = await llm.add_request("unread", "hello", SamplingParams(max_tokens=10_000, ignore_eos=True))
        t0 = time.monotonic()
        while engine.get_num_unfinished_requests() and time.monotonic() - t0 < 5:  # (100 s if it ran on)
            await asyncio.sleep(0.01)
        left, waited = engine.get_num_unfinished_requests(), time.monotonic() - t0
        with pytest.raises(RequestTimeoutError):
            await stream.__anext__()
        llm.shutdown()
        return left, waited

    left, waited = asyncio.run(main())
    assert left == 0 and waited < 2


async def _finished_unread(request_timeout: float, wait: float) -> tuple[AsyncLLM, Any]:
    """A front end and the stream of a 3-token request ("r") left unread for `wait` s
    (it finishes in ~30 ms)."""
    llm = AsyncLLM(FakeEngine(step_time=0.01), log_stats=False, request_timeout=request_timeout)
    stream = await llm.add_request("r", "hello", SamplingParams(max_tokens=3, ignore_eos=True), final_only=True)
    await asyncio.sleep(wait)
    return llm, stream


def test_a_request_finished_in_time_but_read_late_keeps_its_output() -> None:
    """The deadline's timer fires after the final output came in, unread: the reader gets
    the answer (the engine's work was done in time), not a timeout."""

    async def main() -> str:
        llm, stream = await _finished_unread(request_timeout=0.3, wait=0.6)
        out = await stream.__anext__()
        llm.shutdown()
        return out.outputs[0].finish_reason

    assert asyncio.run(main()) == "length"


def test_a_stream_closed_with_its_final_output_unread_frees_its_request_id() -> None:
    """Closing a stream whose request finished but was not read releases it: its id can be
    used again (the collector is not kept)."""

    async def main() -> str:
        llm, stream = await _finished_unread(request_timeout=30, wait=0.3)
        stream.close()
        again = await llm.add_request("r", "hello", SamplingParams(max_tokens=2, ignore_eos=True),
                                      final_only=True)
        out = await again.__anext__()
        llm.shutdown()
        return out.outputs[0].finish_reason

    assert asyncio.run(main()) == "length"


def test_a_client_gone_as_the_engine_takes_its_request_leaves_nothing_running(monkeypatch) -> None:
    """The client leaves (its task cancelled) after the engine thread took the add but before
    the loop ran the answer it queued: the request was never aborted and ran to max_tokens
    with no client, holding a batch slot and its KV blocks (found by a soak of disconnects)."""
    from pagedserve.engine import inproc_client

    async def main() -> int:
        engine = FakeEngine(step_time=0.01)
        llm = AsyncLLM(engine, log_stats=False)
        loop, tasks = asyncio.get_running_loop(), []
        take = inproc_client.InprocClient._take

        def take_then_leave(self, cmd):  # the disconnect's cancel lands just before the answer
            call_soon = self._call_soon
            self._call_soon = lambda *a: (loop.call_soon_threadsafe(tasks[0].cancel), call_soon(*a))
            try:
                take(self, cmd)
            finally:
                self._call_soon = call_soon

        monkeypatch.setattr(inproc_client.InprocClient, "_take", take_then_leave)

        async def handler() -> None:
            async for _ in await llm.add_request("gone", "hello", SamplingParams(max_tokens=10_000, ignore_eos=True)):
                pass

        tasks.append(asyncio.ensure_future(handler()))
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        monkeypatch.undo()
        for _ in range(500):  # (10,000 steps of 10 ms if it ran on)
            if engine.get_num_unfinished_requests() == 0:
                break
            await asyncio.sleep(0.01)
        left = engine.get_num_unfinished_requests()
        llm.shutdown()
        return left

    assert asyncio.run(main()) == 0


def test_a_step_of_an_earlier_request_keeps_its_arrival_time() -> None:
    """`arrival_time` reaches the engine (a beam search's steps keep the search's place in
    the queue); without it, the request arrives when it is handed in."""
    engine = FakeEngine()

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        try:
            before = time.time()
            for rid, arrival in (("step", 12.5), ("new", None)):
                stream = await llm.add_request(rid, "hi", SamplingParams(max_tokens=2), arrival_time=arrival)
                async for _ in stream:
                    pass
            return before
        finally:
            llm.shutdown()

    before = run(main())
    assert engine.arrivals["step"] == 12.5 and before <= engine.arrivals["new"] <= time.time()
