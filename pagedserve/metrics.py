"""Serving metrics: per-step statistics, Prometheus collectors and the periodic log line.

The async engine builds one `IterationStats` per engine step (from the outputs it hands
out, so the numbers are exactly what clients received) and passes it, with the engine's
own `EngineStats` snapshot, to every stat logger.  Loggers are called from the engine
thread; prometheus_client is thread-safe and `LoggingStatLogger` guards itself.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

logger = logging.getLogger("pagedserve.metrics")
T = TypeVar("T")

FINISH_REASONS = ("stop", "length", "abort", "error")
# Bucket edges (seconds) close to vLLM's, wide enough for CPU runs.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)
# Token counts (prompt, generation, a step's tokens): vLLM's 1-2-5 series.
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_N_BUCKETS = (1, 2, 5, 10, 20)


@dataclass
class SchedulerStats:
    """The engine-side numbers a logger needs (copied from `LLMEngine.get_stats()`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction in [0, 1]
    prefix_cache_queries: int = 0  # cumulative tokens looked up
    prefix_cache_hits: int = 0  # cumulative tokens found
    num_preemptions: int = 0  # cumulative
    # The KV tier (cumulative): tokens asked of it past the pool's hit, tokens loaded
    # from it (both also in prefix_cache_*), blocks written to it, entries found damaged.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_stored_blocks: int = 0
    kv_offload_invalid_blocks: int = 0
    num_structured_requests: int = 0  # unfinished requests with a grammar (compiling or running)
    grammar_compiles: int = 0  # cumulative grammars compiled
    grammar_cache_hits: int = 0  # cumulative requests whose grammar was already compiled (or compiling)
    grammar_compile_seconds: float = 0.0  # cumulative time spent compiling
    # Speculative decoding (cumulative; all 0 when it is off): verification steps with
    # drafts, drafts proposed, drafts accepted, and acceptances by draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    running_lora_adapters: tuple[str, ...] = ()  # adapters by name (vLLM's lora_requests_info)
    waiting_lora_adapters: tuple[str, ...] = ()
    max_lora: int = 0  # 0: LoRA off (no lora_requests_info series)

    @classmethod
    def from_engine(cls, stats: Any) -> SchedulerStats:
        """Copied field by field: a field the engine's stats lack is an AttributeError, not a silent 0."""
        return cls(**{f.name: getattr(stats, f.name) for f in fields(cls)})

    def hit_rate_since(self, earlier: SchedulerStats) -> float | None:
        """The prefix cache's hit rate over the lookups since `earlier` (None without any)."""
        queries = self.prefix_cache_queries - earlier.prefix_cache_queries
        return (self.prefix_cache_hits - earlier.prefix_cache_hits) / queries if queries > 0 else None


@dataclass
class FinishedRequestStats:
    """One finished request's figures for vLLM's per-request histograms (its phases from
    the engine's own clock: waiting for a first step, prefill, decode)."""

    prompt_tokens: int
    generation_tokens: int  # all its sequences'
    max_generation_tokens: int  # its longest sequence's
    n: int
    max_tokens: int | None
    queue_seconds: float
    prefill_seconds: float
    decode_seconds: float
    inference_seconds: float


@dataclass
class IterationStats:
    """What one engine step delivered to clients (a replica's polls merge several)."""

    num_prompt_tokens: int = 0  # prompts of requests that got their first token this step
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[tuple[str, float]] = field(default_factory=list)  # (finish_reason, e2e seconds)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)  # those that ran to an answer
    step_tokens: list[int] = field(default_factory=list)  # each step's prompt + generation tokens delivered

    def merge(self, other: IterationStats) -> None:
        """Add `other`'s figures (a replica's steps between two polls)."""
        self.num_prompt_tokens += other.num_prompt_tokens
        self.num_generation_tokens += other.num_generation_tokens
        for name in ("time_to_first_tokens", "inter_token_latencies", "finished", "finished_requests", "step_tokens"):
            getattr(self, name).extend(getattr(other, name))


class StatLogger(Protocol):
    def record(self, sched: SchedulerStats, it: IterationStats) -> None: ...


class PrometheusFamilies:
    """The metric families, registered once per registry; each engine's logger binds its labels."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        kw = {"registry": registry, "labelnames": ["model_name", "engine"]}
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", **kw)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", **kw)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", **kw)
        self.pc_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", **kw)
        self.pc_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", **kw)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions.", **kw)
        self.ext_queries = Counter("vllm:external_prefix_cache_queries",
                                   "KV tier (offload) queries past the pool's prefix hit, in tokens.", **kw)
        self.ext_hits = Counter("vllm:external_prefix_cache_hits",
                                "KV tier (offload) hits: tokens loaded instead of computed.", **kw)
        self.offload_stored = Counter("pagedserve:kv_offload_stored_blocks", "KV blocks written to the tier.", **kw)
        self.offload_invalid = Counter("pagedserve:kv_offload_invalid_blocks",
                                       "KV tier entries found truncated, corrupted or foreign (removed).", **kw)
        self.structured = Gauge("pagedserve:num_requests_structured",
                                "Unfinished requests with a structured-output grammar.", **kw)
        self.grammar_compiles = Counter("pagedserve:grammar_compiles", "Grammars compiled.", **kw)
        self.grammar_hits = Counter("pagedserve:grammar_cache_hits",
                                    "Requests whose grammar came from the compile cache.", **kw)
        self.grammar_seconds = Counter("pagedserve:grammar_compile_seconds",
                                       "Time spent compiling grammars (off the engine loop).", **kw)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts",
                                   "Speculative decoding: verification steps with drafts.", **kw)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens",
                                         "Speculative decoding: draft tokens proposed.", **kw)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens",
                                     "Speculative decoding: draft tokens accepted.", **kw)
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Speculative decoding: draft tokens accepted, by draft position.",
                                    registry=registry, labelnames=["model_name", "engine", "position"])
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", **kw)
        self.gen_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", **kw)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               registry=registry, labelnames=["model_name", "engine", "finished_reason"])
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, **kw)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", buckets=_ITL_BUCKETS, **kw)
        # vLLM's older name for the same observations, which its example Grafana dashboard reads.
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token (inter-token latency).",
                              buckets=_ITL_BUCKETS, **kw)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=_E2E_BUCKETS, **kw)
        # vLLM's per-request histograms, observed when a request finishes with an answer.
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens of finished requests.",
                                               buckets=_TOKEN_BUCKETS, **kw)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Generated tokens of finished requests.", buckets=_TOKEN_BUCKETS, **kw)
        self.request_max_generation = Histogram("vllm:request_max_num_generation_tokens",
                                                "Longest sequence's generated tokens of finished requests.",
                                                buckets=_TOKEN_BUCKETS, **kw)
        self.request_params_n = Histogram("vllm:request_params_n", "The n parameter of finished requests.",
                                          buckets=_N_BUCKETS, **kw)
        self.request_params_max_tokens = Histogram("vllm:request_params_max_tokens",
                                                   "The max_tokens parameter of finished requests.",
                                                   buckets=_TOKEN_BUCKETS, **kw)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time from arrival to the first step.",
                                    buckets=_E2E_BUCKETS, **kw)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Time from the first step to the first token.",
                                      buckets=_E2E_BUCKETS, **kw)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "Time from the first token to the last.",
                                     buckets=_E2E_BUCKETS, **kw)
        self.request_tpot = Histogram("vllm:request_time_per_output_token_seconds",
                                      "Mean time per output token of finished requests (decode time over the "
                                      "longest sequence's tokens after its first; 0 for one token, as vLLM's).",
                                      buckets=_ITL_BUCKETS, **kw)
        self.inference_time = Histogram("vllm:request_inference_time_seconds", "Time from the first step to the last token.",
                                        buckets=_E2E_BUCKETS, **kw)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens delivered per engine step.",
                                          buckets=_TOKEN_BUCKETS, **kw)
        # vLLM's: one series per engine, its labels the adapters now, its value when they were read.
        self.lora_info = Gauge("vllm:lora_requests_info", "Running and waiting LoRA adapters (comma-separated names).",
                               registry=registry, labelnames=["model_name", "engine", "max_lora",
                                                              "waiting_lora_adapters", "running_lora_adapters"])


# Metric families already registered, by registry and name: a server of several models
# registers each family once and every model's engine binds its own labels.
_REGISTERED: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def registered_once(registry: Any, name: str, make: Callable[[], T]) -> T:
    """`make()`'s metric (family) on `registry`, made the first time only."""
    families = _REGISTERED.setdefault(registry, {})
    if name not in families:
        families[name] = make()
    return families[name]


def record_cache_config(registry: Any, model_name: str, description: dict[str, Any]) -> None:
    """vLLM's `vllm:cache_config_info` (always 1; the configuration is in its labels):
    block size, number of blocks, what the KV cache stores and its bytes per token, and
    the same under vLLM's label names (`num_gpu_blocks`, `cache_dtype`,
    `enable_prefix_caching`), which dashboards made for vLLM read."""
    from prometheus_client import Gauge

    names = ("block_size", "num_blocks", "kv_cache_dtype", "kv_bytes_per_token")
    vllm_names = {"num_gpu_blocks": str(description.get("num_blocks", "")),
                  "cache_dtype": str(description.get("kv_cache_dtype", "")),
                  "enable_prefix_caching": str(description.get("prefix_caching") == "on")}
    info = registered_once(registry, "cache_config_info", lambda: Gauge(
        "vllm:cache_config_info", "The KV cache's configuration (in the labels).", registry=registry,
        labelnames=["model_name", *names, *vllm_names]))
    info.labels(model_name=model_name, **{n: str(description.get(n, "")) for n in names}, **vllm_names).set(1)


def make_prometheus_loggers(registry: Any, model_name: str, num_engines: int = 1) -> list[PrometheusStatLogger]:
    """One logger per engine (data-parallel replica), sharing one set of families."""
    families = registered_once(registry, "families", lambda: PrometheusFamilies(registry))
    return [PrometheusStatLogger(families, model_name, engine=i) for i in range(num_engines)]


class RouterMetrics:
    """The data-parallel router's own series: requests sent to each replica, those sent
    for its cache (cache_aware affinity), retries after a replica failed, and which
    replicas are up and how often they came back."""

    def __init__(self, registry: Any, model_name: str, num_engines: int) -> None:
        from prometheus_client import Counter, Gauge

        kw = {"registry": registry, "labelnames": ["model_name", "engine"]}
        requests = Counter("pagedserve:router_requests", "Requests the router sent to each replica.", **kw)
        affinity = Counter("pagedserve:router_affinity_hits",
                           "Requests sent to a replica because its prefix index matched the prompt.", **kw)
        up = Gauge("pagedserve:router_replica_up", "1 while the replica serves, 0 while it is down.", **kw)
        restarts = Counter("pagedserve:router_replica_restarts", "Times the replica came back after failing.", **kw)
        engines = [{"model_name": model_name, "engine": str(i)} for i in range(num_engines)]
        self.requests = [requests.labels(**e) for e in engines]
        self.affinity_hits = [affinity.labels(**e) for e in engines]
        self.up = [up.labels(**e) for e in engines]
        self.restarts = [restarts.labels(**e) for e in engines]
        self.retries = Counter("pagedserve:router_retries",
                               "Requests sent again to another replica after theirs failed before any token.",
                               registry=registry, labelnames=["model_name"]).labels(model_name=model_name)
        for gauge in self.up:
            gauge.set(1)


class PrometheusStatLogger:
    """vLLM's metric names on a caller-supplied registry (one per app, so tests can run
    several servers in one process without duplicate-registration errors), one logger per
    engine: every series carries vLLM's `engine` label (its index among data-parallel
    replicas; "0" for a single engine).  Build them with `make_prometheus_loggers`."""

    def __init__(self, families: PrometheusFamilies, model_name: str, engine: int = 0) -> None:
        f = families
        labels = {"model_name": model_name, "engine": str(engine)}

        def lab(metric: Any) -> Any:
            return metric.labels(**labels)

        self.running = lab(f.running)
        self.waiting = lab(f.waiting)
        self.kv_usage = lab(f.kv_usage)
        self.pc_queries = lab(f.pc_queries)
        self.pc_hits = lab(f.pc_hits)
        self.preemptions = lab(f.preemptions)
        self.ext_queries = lab(f.ext_queries)
        self.ext_hits = lab(f.ext_hits)
        self.offload_stored = lab(f.offload_stored)
        self.offload_invalid = lab(f.offload_invalid)
        self.structured = lab(f.structured)
        self.grammar_compiles = lab(f.grammar_compiles)
        self.grammar_hits = lab(f.grammar_hits)
        self.grammar_seconds = lab(f.grammar_seconds)
        self.spec_drafts = lab(f.spec_drafts)
        self.spec_draft_tokens = lab(f.spec_draft_tokens)
        self.spec_accepted = lab(f.spec_accepted)
        self.spec_per_pos_family = f.spec_per_pos
        self.labels = labels
        self.prompt_tokens = lab(f.prompt_tokens)
        self.gen_tokens = lab(f.gen_tokens)
        self.success = {r: f.success.labels(finished_reason=r, **labels) for r in FINISH_REASONS}
        self.ttft = lab(f.ttft)
        self.itl = lab(f.itl)
        self.tpot, self.request_tpot = lab(f.tpot), lab(f.request_tpot)
        self.e2e = lab(f.e2e)
        self.request_prompt_tokens, self.request_generation_tokens, self.request_max_generation = (
            lab(f.request_prompt_tokens), lab(f.request_generation_tokens), lab(f.request_max_generation))
        self.request_params_n, self.request_params_max_tokens = lab(f.request_params_n), lab(f.request_params_max_tokens)
        self.phases = [(lab(f.queue_time), "queue_seconds"), (lab(f.prefill_time), "prefill_seconds"),
                       (lab(f.decode_time), "decode_seconds"), (lab(f.inference_time), "inference_seconds")]
        self.iteration_tokens = lab(f.iteration_tokens)
        self.lora_info_family = f.lora_info
        self._lora_labels: tuple[str, ...] | None = None  # the one lora_requests_info series this engine shows
        self._last = SchedulerStats()

    def engine_restarted(self) -> None:
        """The engine's cumulative counters start again from 0 (a replica came back)."""
        self._last = SchedulerStats()

    def engine_down(self) -> None:
        """A replica went down: its requests went with it, so its gauges read 0 until it
        reports again (not the last figures it sent, for as long as it stays down)."""
        for gauge in (self.running, self.waiting, self.kv_usage, self.structured):
            gauge.set(0)
        if self._lora_labels is not None:
            self.lora_info_family.remove(*self._lora_labels)
            self._lora_labels = None

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        self.running.set(sched.num_running)
        self.waiting.set(sched.num_waiting)
        self.kv_usage.set(sched.kv_cache_usage)
        self.structured.set(sched.num_structured_requests)
        # The engine's counters are cumulative; Prometheus counters want increments.
        for counter, name in ((self.pc_queries, "prefix_cache_queries"), (self.pc_hits, "prefix_cache_hits"),
                              (self.preemptions, "num_preemptions"), (self.grammar_compiles, "grammar_compiles"),
                              (self.ext_queries, "external_prefix_cache_queries"),
                              (self.ext_hits, "external_prefix_cache_hits"),
                              (self.offload_stored, "kv_offload_stored_blocks"),
                              (self.offload_invalid, "kv_offload_invalid_blocks"),
                              (self.grammar_hits, "grammar_cache_hits"),
                              (self.grammar_seconds, "grammar_compile_seconds"),
                              (self.spec_drafts, "spec_decode_num_drafts"),
                              (self.spec_draft_tokens, "spec_decode_num_draft_tokens"),
                              (self.spec_accepted, "spec_decode_num_accepted_tokens")):
            delta = getattr(sched, name) - getattr(self._last, name)
            if delta > 0:
                counter.inc(delta)
        last_pos = self._last.spec_decode_num_accepted_tokens_per_pos
        for pos, n in enumerate(sched.spec_decode_num_accepted_tokens_per_pos):
            delta = n - (last_pos[pos] if pos < len(last_pos) else 0)
            if delta > 0:
                self.spec_per_pos_family.labels(position=str(pos), **self.labels).inc(delta)
        self._last = sched
        if sched.max_lora:
            self._record_loras(sched)
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.gen_tokens.inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
            self.tpot.observe(t)
        for reason, e2e in it.finished:
            self.success.get(reason, self.success["abort"]).inc()
            self.e2e.observe(e2e)  # (every request counted, aborted ones too, as vLLM's)
        for n in it.step_tokens:
            self.iteration_tokens.observe(n)
        for req in it.finished_requests:
            self._record_request(req)

    def _record_request(self, req: FinishedRequestStats) -> None:
        self.request_prompt_tokens.observe(req.prompt_tokens)
        self.request_generation_tokens.observe(req.generation_tokens)
        self.request_max_generation.observe(req.max_generation_tokens)
        self.request_params_n.observe(req.n)
        if req.max_tokens is not None:
            self.request_params_max_tokens.observe(req.max_tokens)
        for histogram, name in self.phases:
            histogram.observe(getattr(req, name))
        after_first = req.max_generation_tokens - 1
        self.request_tpot.observe(req.decode_seconds / after_first if after_first > 0 else 0.0)

    def _record_loras(self, sched: SchedulerStats) -> None:
        """vLLM's lora_requests_info: the adapters now as labels, the time as value.  The
        previous label set is removed, so the series stay one per engine (vLLM's grow with
        every combination of adapters ever seen)."""
        labels = (self.labels["model_name"], self.labels["engine"], str(sched.max_lora),
                  ",".join(sched.waiting_lora_adapters), ",".join(sched.running_lora_adapters))
        if labels != self._lora_labels:
            if self._lora_labels is not None:
                self.lora_info_family.remove(*self._lora_labels)
            self._lora_labels = labels
        self.lora_info_family.labels(*labels).set_to_current_time()


class LoggingStatLogger:
    """Accumulates tokens between log lines; `maybe_log` prints vLLM's periodic line when
    the interval has passed and something happened (silent while the server idles)."""

    def __init__(self, interval: float = 10.0, log: logging.Logger = logger, device: str = "GPU",
                 start: float | None = None, prefix: str = "") -> None:
        """`device` names where the KV cache lives ("GPU", as vLLM says, or "CPU");
        `start`: the monotonic time the first interval counts from (default: now);
        `prefix` starts each line (data-parallel replicas: "Engine 001: ", as vLLM writes)."""
        self.interval = interval
        self.prefix = prefix
        self.device = device
        self.log = log
        self._lock = threading.Lock()
        self._last_time = time.monotonic() if start is None else start
        self._prompt = 0
        self._gen = 0
        self._sched = SchedulerStats()
        self._spec_last = (0, 0)  # (drafted, accepted) at the last line
        # The stats at the last line, and the prefix-cache hit rate of the last interval
        # with lookups: recent, as vLLM's line (since start-up, a long-running server's
        # figure barely moved), and kept through intervals that only decode.
        self._cache_last = SchedulerStats()
        self._hit_rate = 0.0
        self._logged_idle = True

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        with self._lock:
            self._prompt += it.num_prompt_tokens
            self._gen += it.num_generation_tokens
            self._sched = sched

    def maybe_log(self, now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        with self._lock:
            elapsed = now - self._last_time
            if elapsed < self.interval:
                return None
            s = self._sched
            idle = not (self._prompt or self._gen or s.num_running or s.num_waiting)
            if idle and self._logged_idle:
                self._last_time = now
                return None  # nothing new since the last (idle) line
            rate = s.hit_rate_since(self._cache_last)
            self._hit_rate, self._cache_last = (self._hit_rate if rate is None else 100.0 * rate), s
            line = (
                f"{self.prefix}Avg prompt throughput: {self._prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {self._gen / elapsed:.1f} tokens/s, "
                f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"{self.device} KV cache usage: {100.0 * s.kv_cache_usage:.1f}%, "
                f"Prefix cache hit rate: {self._hit_rate:.1f}%, "
                f"Structured-output reqs: {s.num_structured_requests}"
            )
            drafted = s.spec_decode_num_draft_tokens - self._spec_last[0]
            if drafted:  # speculative decoding: acceptance over the interval
                accepted = s.spec_decode_num_accepted_tokens - self._spec_last[1]
                line += f", Draft acceptance rate: {100.0 * accepted / drafted:.1f}% ({accepted}/{drafted} tokens)"
            self._spec_last = (s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens)
            self._prompt = self._gen = 0
            self._last_time = now
            self._logged_idle = idle
        self.log.info(line)
        return line


def _percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already sorted list (None when empty)."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class SeriesStatLogger:
    """The last `seconds` seconds as one point per second, for the dashboard's charts.

    `record` (engine thread, every step) only adds to the current second's sums; a
    second is closed into a point when time passes it, by `record` or by a reader
    (`points_since`), so an idle server still gets its zero points.  Each point:
    t (unix seconds), prompt and generation tokens/s, KV usage, prefix-cache hit rate
    over that second (None without lookups), TTFT and inter-token latency p50/p95
    (None without samples), preemptions, running and waiting requests.
    """

    def __init__(self, seconds: int = 300, clock: Any = time.time) -> None:
        self.seconds = seconds
        self.clock = clock
        self._lock = threading.Lock()
        self.points: deque[dict[str, Any]] = deque(maxlen=seconds)
        self._start = float(int(clock()))
        self._sched = SchedulerStats()
        self._last_closed = SchedulerStats()  # cumulative counters at the last closed second
        self._new_bucket()

    def _new_bucket(self) -> None:
        self._prompt = self._gen = 0
        self._ttft: list[float] = []
        self._itl: list[float] = []

    def _roll(self, now: float) -> None:
        if now - self._start > 2 * self.seconds:  # idle for longer than the window: skip ahead
            self._start = float(int(now)) - self.seconds - 1
        while now >= self._start + 1.0:
            s, last = self._sched, self._last_closed
            ttft, itl = sorted(self._ttft), sorted(self._itl)
            self.points.append({
                "t": self._start, "prompt_tps": self._prompt, "gen_tps": self._gen,
                "kv_usage": s.kv_cache_usage,
                "hit_rate": s.hit_rate_since(last),
                "ttft_p50": _percentile(ttft, 0.5), "ttft_p95": _percentile(ttft, 0.95),
                "itl_p50": _percentile(itl, 0.5), "itl_p95": _percentile(itl, 0.95),
                "preemptions": s.num_preemptions - last.num_preemptions,
                "running": s.num_running, "waiting": s.num_waiting,
            })
            self._last_closed = s
            self._new_bucket()
            self._start += 1.0

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        with self._lock:
            self._roll(self.clock())
            self._sched = sched
            self._prompt += it.num_prompt_tokens
            self._gen += it.num_generation_tokens
            self._ttft.extend(it.time_to_first_tokens)
            self._itl.extend(it.inter_token_latencies)

    def points_since(self, t: float | None = None) -> list[dict[str, Any]]:
        """Closed points newer than `t` (all of them for None), oldest first."""
        with self._lock:
            self._roll(self.clock())
            return [p for p in self.points if t is None or p["t"] > t]
