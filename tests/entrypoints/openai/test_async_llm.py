"""AsyncLLM against a fake engine: streaming, joining the batch, aborts, errors, and
that the engine thread does not starve the event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_engine import FakeEngine

from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
from pagedserve.metrics import LoggingStatLogger, PrometheusStatLogger
from pagedserve.sampling_params import SamplingParams


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


def test_new_request_joins_running_batch():
    engine = FakeEngine(step_time=0.005)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        long_task = asyncio.ensure_future(collect(llm, "long", max_tokens=100))
        while engine.steps < 5:
            await asyncio.sleep(0.005)
        short = await collect(llm, "short", max_tokens=3)
        long_running_when_short_done = not long_task.done()
        long_outs = await long_task
        llm.shutdown()
        return short, long_running_when_short_done, long_outs

    short, overlapped, long_outs = run(main())
    assert short[-1].finished and len(short[-1].outputs[0].token_ids) == 3
    assert overlapped, "the short request had to wait for the long one to finish"
    assert len(long_outs[-1].outputs[0].token_ids) == 100


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
        with pytest.raises(EngineDeadError, match="simulated device failure"):
            await collect(llm, "doomed", max_tokens=100)
        assert llm.errored and not llm.is_running
        with pytest.raises(EngineDeadError):
            await collect(llm, "later")

    run(main())


def test_busy_engine_does_not_starve_event_loop():
    """Steps that hold the GIL for 30 ms (pure-Python work) must still let the loop run:
    a 5 ms sleep should never come back more than ~one switch interval late."""
    engine = FakeEngine(step_time=0.03, busy=True)

    async def main():
        llm = AsyncLLM(engine, log_stats=False)
        task = asyncio.ensure_future(collect(llm, "busy", max_tokens=20))
        while engine.steps < 2:
            await asyncio.sleep(0.001)
        lateness = []
        while not task.done():
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            lateness.append(time.perf_counter() - t0 - 0.005)
        llm.shutdown()
        return sorted(lateness)

    lateness = run(main())
    assert len(lateness) > 20
    median = lateness[len(lateness) // 2]
    assert median < 0.02 and lateness[-1] < 0.1, (median, lateness[-1])


def test_stat_loggers_see_tokens_and_finishes():
    from prometheus_client import CollectorRegistry

    engine = FakeEngine()
    registry = CollectorRegistry()

    async def main():
        llm = AsyncLLM(engine, stat_loggers=[PrometheusStatLogger(registry, "fake")], log_stats=True,
                       log_interval=1000)
        await asyncio.gather(collect(llm, "a", max_tokens=4, prompt="abc"),
                             collect(llm, "b", max_tokens=6, prompt="de"))
        llm.shutdown()
        return llm.log_stats

    log_stats = run(main())

    def value(name, **labels):
        return registry.get_sample_value(name, {"model_name": "fake", **labels})

    assert value("vllm:prompt_tokens_total") == 5
    assert value("vllm:generation_tokens_total") == 10
    assert value("vllm:request_success_total", finished_reason="length") == 2
    assert value("vllm:time_to_first_token_seconds_count") == 2
    assert value("vllm:inter_token_latency_seconds_count") == 3 + 5
    assert value("vllm:e2e_request_latency_seconds_count") == 2
    assert value("vllm:num_requests_running") == 0
    line = log_stats.maybe_log(now=time.monotonic() + 2000)
    assert line is not None and "Avg generation throughput:" in line and "Running: 0 reqs" in line
    assert "GPU KV cache usage: 0.0%" in line and "Prefix cache hit rate: 0.0%" in line
    # One all-zero line marks the end of activity (as vLLM does), then silence.
    assert "Avg generation throughput: 0.0 tokens/s" in log_stats.maybe_log(now=time.monotonic() + 4000)
    assert log_stats.maybe_log(now=time.monotonic() + 6000) is None


def test_logging_stat_logger_rates():
    from pagedserve.metrics import IterationStats, SchedulerStats

    log = LoggingStatLogger(interval=5.0)
    t0 = log._last_time
    log.record(SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=200,
                              prefix_cache_hits=50), IterationStats(num_prompt_tokens=100, num_generation_tokens=40))
    assert log.maybe_log(now=t0 + 1.0) is None  # interval not reached
    line = log.maybe_log(now=t0 + 10.0)
    assert line == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 4.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
