"""The periodic log line and the engine-stats snapshot it reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.metrics import IterationStats, LoggingStatLogger, PrometheusStatLogger, SchedulerStats


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
                           grammar_cache_hits=9, grammar_compile_seconds=0.25, spec_decode_num_drafts=3,
                           spec_decode_num_draft_tokens=8, spec_decode_num_accepted_tokens=5,
                           spec_decode_num_accepted_tokens_per_pos=[3, 2])
    assert SchedulerStats.from_engine(full) == SchedulerStats(1, 2, 0.5, 4, 3, 7, 2, 5, 9, 0.25, 3, 8, 5, [3, 2])
    del full.num_preemptions  # a renamed engine field must fail loudly, not read as 0
    with pytest.raises(AttributeError):
        SchedulerStats.from_engine(full)


def test_speculative_decoding_acceptance_in_the_log_line_and_prometheus():
    from prometheus_client import CollectorRegistry

    t0 = 100.0
    log = LoggingStatLogger(interval=5.0, device="CPU", start=t0)
    first = SchedulerStats(num_running=1, spec_decode_num_drafts=4, spec_decode_num_draft_tokens=10,
                           spec_decode_num_accepted_tokens=6, spec_decode_num_accepted_tokens_per_pos=[4, 2])
    log.record(first, IterationStats(num_generation_tokens=10))
    assert log.maybe_log(now=t0 + 10.0).endswith("Draft acceptance rate: 60.0% (6/10 tokens)")
    second = SchedulerStats(num_running=1, spec_decode_num_drafts=5, spec_decode_num_draft_tokens=14,
                            spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=[5, 2])
    log.record(second, IterationStats(num_generation_tokens=2))
    assert log.maybe_log(now=t0 + 20.0).endswith("Draft acceptance rate: 25.0% (1/4 tokens)")  # this interval's

    registry = CollectorRegistry()
    prom = PrometheusStatLogger(registry, "m")
    prom.record(first, IterationStats())
    prom.record(second, IterationStats())

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("vllm:spec_decode_num_drafts_total") == 5
    assert value("vllm:spec_decode_num_draft_tokens_total") == 14
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 7
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 5
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
