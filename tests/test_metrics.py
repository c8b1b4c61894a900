"""The periodic log line and the engine-stats snapshot it reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.metrics import IterationStats, LoggingStatLogger, SchedulerStats


def test_logging_stat_logger_rates():
    t0 = 100.0
    log = LoggingStatLogger(interval=5.0, device="CPU", start=t0)
    log.record(SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, prefix_cache_queries=200,
                              prefix_cache_hits=50), IterationStats(num_prompt_tokens=100, num_generation_tokens=40))
    assert log.maybe_log(now=t0 + 1.0) is None  # interval not reached
    line = log.maybe_log(now=t0 + 10.0)
    assert line == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 4.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, CPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%, "
                    "Structured-output reqs: 0")


def test_scheduler_stats_copy_every_field_and_refuse_a_missing_one():
    full = SimpleNamespace(num_running=1, num_waiting=2, kv_cache_usage=0.5, prefix_cache_queries=4,
                           prefix_cache_hits=3, num_preemptions=7, num_structured_requests=2, grammar_compiles=5,
                           grammar_cache_hits=9, grammar_compile_seconds=0.25)
    assert SchedulerStats.from_engine(full) == SchedulerStats(1, 2, 0.5, 4, 3, 7, 2, 5, 9, 0.25)
    del full.num_preemptions  # a renamed engine field must fail loudly, not read as 0
    with pytest.raises(AttributeError):
        SchedulerStats.from_engine(full)
