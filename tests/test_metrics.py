"""The periodic log line and the engine-stats snapshot it reads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.metrics import (
    IterationStats,
    LoggingStatLogger,
    RouterMetrics,
    SchedulerStats,
    SeriesStatLogger,
    make_prometheus_loggers,
)


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
    # The hit rate is the interval's lookups' (it was since start-up: 250/300 = 83% here), and an
    # interval without lookups (decode only) keeps the last one's
    log.record(SchedulerStats(num_running=1, prefix_cache_queries=300, prefix_cache_hits=150), IterationStats())
    assert "Prefix cache hit rate: 100.0%," in log.maybe_log(now=t0 + 20.0)
    log.record(SchedulerStats(num_running=1, prefix_cache_queries=300, prefix_cache_hits=150),
               IterationStats(num_generation_tokens=5))
    assert "Prefix cache hit rate: 100.0%," in log.maybe_log(now=t0 + 30.0)


def test_scheduler_stats_copy_every_field_and_refuse_a_missing_one():
    full = SimpleNamespace(num_running=1, num_waiting=2, kv_cache_usage=0.5, prefix_cache_queries=4,
                           prefix_cache_hits=3, num_preemptions=7, external_prefix_cache_queries=11,
                           external_prefix_cache_hits=10, kv_offload_stored_blocks=6, kv_offload_invalid_blocks=1,
                           num_structured_requests=2, grammar_compiles=5,
                           grammar_cache_hits=9, grammar_compile_seconds=0.25, spec_decode_num_drafts=3,
                           spec_decode_num_draft_tokens=8, spec_decode_num_accepted_tokens=5,
                           spec_decode_num_accepted_tokens_per_pos=[3, 2], running_lora_adapters=("a",),
                           waiting_lora_adapters=("b", "c"), max_lora=2)
    assert SchedulerStats.from_engine(full) == SchedulerStats(1, 2, 0.5, 4, 3, 7, 11, 10, 6, 1, 2, 5, 9, 0.25, 3, 8, 5,
                                                              [3, 2], ("a",), ("b", "c"), 2)
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
    prom = make_prometheus_loggers(registry, "m")[0]
    prom.record(first, IterationStats())
    prom.record(second, IterationStats())

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    assert value("vllm:spec_decode_num_drafts_total") == 5
    assert value("vllm:spec_decode_num_draft_tokens_total") == 14
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 7
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 5
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_series_closes_one_point_per_second_with_rates_percentiles_and_deltas():
    clock = _Clock(1000.2)
    series = SeriesStatLogger(seconds=5, clock=clock)
    sched = SchedulerStats(num_running=2, kv_cache_usage=0.5, prefix_cache_queries=100, prefix_cache_hits=40,
                           num_preemptions=1)
    series.record(sched, IterationStats(num_prompt_tokens=30, num_generation_tokens=4,
                                        time_to_first_tokens=[0.1, 0.3], inter_token_latencies=[0.02] * 9 + [0.5]))
    clock.t = 1000.7
    series.record(SchedulerStats(num_running=2, kv_cache_usage=0.6, prefix_cache_queries=200, prefix_cache_hits=90,
                                 num_preemptions=3), IterationStats(num_generation_tokens=6))
    assert series.points_since(None) == []  # the second is not over yet
    clock.t = 1003.1  # two more seconds pass with no step: zero points, usage carried
    p0, p1, p2 = series.points_since(None)
    assert p0["t"] == 1000.0 and p0["prompt_tps"] == 30 and p0["gen_tps"] == 10 and p0["kv_usage"] == 0.6
    assert p0["hit_rate"] == 90 / 200 and p0["preemptions"] == 3 and p0["running"] == 2
    assert p0["ttft_p50"] == 0.3 and p0["itl_p50"] == 0.02 and p0["itl_p95"] == 0.5
    assert p1["t"] == 1001.0 and p1["gen_tps"] == 0 and p1["hit_rate"] is None and p1["ttft_p50"] is None
    assert p1["kv_usage"] == 0.6 and p1["preemptions"] == 0
    assert series.points_since(1001.0) == [p2]


def test_series_keeps_only_its_window_and_skips_a_long_idle_gap():
    clock = _Clock(50.0)
    series = SeriesStatLogger(seconds=5, clock=clock)
    clock.t = 60.0
    assert [p["t"] for p in series.points_since(None)] == [55.0, 56.0, 57.0, 58.0, 59.0]
    clock.t = 1e9  # a long idle: no million-point loop, still the window's worth
    points = series.points_since(None)
    assert len(points) == 5 and points[-1]["t"] == 1e9 - 1


def test_each_engine_has_its_own_series_and_a_restart_starts_its_counters_over():
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    e0, e1 = make_prometheus_loggers(registry, "m", num_engines=2)
    e0.record(SchedulerStats(num_running=3, prefix_cache_queries=100, prefix_cache_hits=40), IterationStats())
    e1.record(SchedulerStats(num_running=1, prefix_cache_queries=10, prefix_cache_hits=10), IterationStats())

    def value(name: str, engine: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": engine})

    assert value("vllm:num_requests_running", "0") == 3 and value("vllm:num_requests_running", "1") == 1
    assert value("vllm:prefix_cache_hits_total", "0") == 40 and value("vllm:prefix_cache_hits_total", "1") == 10
    e0.engine_down()  # a replica went down: its requests with it, not its last figures
    assert value("vllm:num_requests_running", "0") == 0 and value("vllm:prefix_cache_hits_total", "0") == 40
    e1.engine_restarted()  # the replica came back: its cumulative counters begin again at 0
    e1.record(SchedulerStats(prefix_cache_queries=5, prefix_cache_hits=2), IterationStats())
    assert value("vllm:prefix_cache_hits_total", "1") == 12 and value("vllm:prefix_cache_queries_total", "1") == 15
    router = RouterMetrics(registry, "m", num_engines=2)
    router.requests[1].inc()
    router.up[0].set(0)
    assert value("pagedserve:router_requests_total", "1") == 1 and value("pagedserve:router_replica_up", "0") == 0
    assert value("pagedserve:router_replica_up", "1") == 1


def test_replica_log_lines_say_which_replica():
    log = LoggingStatLogger(interval=1.0, device="CPU", start=0.0, prefix="Engine 001: ")
    log.record(SchedulerStats(num_running=1), IterationStats(num_generation_tokens=5))
    assert log.maybe_log(now=1.0).startswith("Engine 001: Avg prompt throughput")


def test_lora_requests_info_shows_the_adapters_now_in_one_series_per_engine():
    """vLLM's vllm:lora_requests_info: the adapters as labels, the time they were read as
    value; the previous label set goes (vLLM keeps every combination ever seen), and with
    LoRA off, or the replica down, there is none."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    prom = make_prometheus_loggers(registry, "m")[0]

    def series() -> list[dict[str, str]]:
        return [s.labels for m in registry.collect() if m.name == "vllm:lora_requests_info" for s in m.samples]

    prom.record(SchedulerStats(), IterationStats())
    assert series() == []  # LoRA off
    prom.record(SchedulerStats(running_lora_adapters=("a1", "a2"), waiting_lora_adapters=("a3",), max_lora=2),
                IterationStats())
    assert series() == [{"model_name": "m", "engine": "0", "max_lora": "2", "waiting_lora_adapters": "a3",
                         "running_lora_adapters": "a1,a2"}]
    prom.record(SchedulerStats(running_lora_adapters=("a3",), max_lora=2), IterationStats())
    assert [(s["running_lora_adapters"], s["waiting_lora_adapters"]) for s in series()] == [("a3", "")]
    prom.engine_down()
    assert series() == []


def test_an_aborted_request_is_in_the_latency_histogram_as_in_its_count():
    """vLLM observes every finished request's e2e latency, aborted ones too (request_success's
    sum and the histogram's count agree)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    prom = make_prometheus_loggers(registry, "m")[0]
    prom.record(SchedulerStats(), IterationStats(finished=[("stop", 1.0), ("abort", 2.0)]))
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:e2e_request_latency_seconds_count", labels) == 2
