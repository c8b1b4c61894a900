"""What a soak (benchmarks/soak.py) sends and how it judges what comes back: the run's
configuration, the seeded request mix, the checks of full and streamed answers, and
the server facts read at the end (Prometheus gauges, tracebacks in its log).

Apart from the runner so each piece is a plain function or class of plain data,
testable without a server (tests/benchmarks/test_soak.py), and the runner reads as the
phases it goes through.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from pagedserve.benchmarks.harness import metric_samples

# vLLM's metric names, which pagedserve's /metrics uses (pagedserve/metrics.py).
METRIC_RUNNING = "vllm:num_requests_running"
METRIC_WAITING = "vllm:num_requests_waiting"
METRIC_KV_USAGE = "vllm:kv_cache_usage_perc"
METRIC_SUCCESS = "vllm:request_success_total"

# Short ASCII words: prompts made of them tokenize to at most one token per character
# with byte-level BPE and SentencePiece alike, and to at least one token per word.
_WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from or had "
          "by word but what some we can out other were all there when up use your how said an each she which do "
          "their time if will way about many then them write would like so these her long make thing see him two "
          "has look more day could go come did number sound no most people my over know water than call first who "
          "may down side been now find any new work part take get place made live where after back little only "
          "round man year came show every good me give our under name very just form great think say help low").split()
_SHARED_PREFIXES = ("You are a helpful assistant. Answer briefly.", "Context: the quick brown fox jumps over the dog.",
                    "Summarize the following text in one line:")


# --------------------------------------------------------------------------- configuration
@dataclass
class SoakConfig:
    """What one soak run does; the CLI flags map onto these fields one to one."""

    base_url: str
    api_key: str | None = None
    model: str | None = None  # None: the first id of GET /v1/models
    pid: int | None = None  # the server's process, for RSS; None: RSS is not checked
    server_log: str | None = None  # the server's log, scanned for tracebacks; None: not checked
    num_requests: int | None = None  # main phase; with duration too, whichever ends first
    duration: float | None = None  # seconds of main phase
    concurrency: int = 16
    seed: int = 0
    warmup_requests: int = 64
    min_tokens: int = 1  # the max_tokens of a valid request is drawn from [min_tokens, max_tokens]
    max_tokens: int = 32
    cancel_fraction: float = 0.25  # of the valid requests
    invalid_fraction: float = 0.10  # of all requests
    overlong_fraction: float = 0.05  # of all requests
    max_model_len: int | None = None  # None: from GET /v1/models
    request_timeout: float = 120.0  # seconds for one request, end to end: longer counts as a hang
    drain_timeout: float = 30.0  # seconds to wait for running = waiting = 0 and KV usage = 0
    rss_tolerance: float = 0.10
    # Seconds of quiet before each RSS sample that is compared: under load the allocator
    # holds freed activations by design (pagedserve hands them back after 2 s idle), so the
    # leak check compares memory at rest; the peak under load is reported beside it.
    settle: float = 5.0
    allow_429: bool = False  # count a 429 on a valid request as a refusal, not a failure
    progress_interval: float = 10.0  # seconds between progress lines on stderr (0: none)


@dataclass
class PlannedRequest:
    """One request, fully decided before it is sent (so a run is reproducible from its seed)."""

    index: int
    kind: str  # "valid" | "invalid" | "overlong"
    case: str  # e.g. "chat/stream", "invalid/negative_max_tokens"
    path: str
    body: dict[str, Any] | None
    stream: bool = False
    raw_body: bytes | None = None  # sent instead of `body` (non-JSON)
    headers: dict[str, str] = field(default_factory=dict)  # override the default ones (bad API key)
    max_tokens: int = 0  # per choice, for valid requests
    n: int = 1
    cancel_after_chunks: int | None = None  # streams: close after this many SSE events
    cancel_fraction: float | None = None  # non-streaming: cancel after this fraction of a typical latency


@dataclass
class Outcome:
    """What happened to one request."""

    index: int
    kind: str
    case: str
    result: str  # "completed" | "cancelled" | "refused" | "failed"
    status: int | None = None
    reason: str = ""  # refusal key or failure description
    completion_tokens: int = 0
    latency: float = 0.0
    cancel_raced: bool = False  # a cancel was planned but the answer arrived first (checked as complete)


@dataclass
class ServerGauges:
    """The Prometheus gauges (summed over model names) the drain condition reads."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    aborts: float = 0.0

    def idle(self) -> bool:
        return self.running == 0 and self.waiting == 0 and self.kv_usage is not None and self.kv_usage <= 1e-9


@dataclass
class PhaseStats:
    """Counts of one phase (warm-up or main)."""

    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    cancel_raced: int = 0
    refused: int = 0
    failed: int = 0
    server_5xx: int = 0
    completion_tokens: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    refused_by_reason: dict[str, int] = field(default_factory=dict)
    failures_by_kind: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)  # the first few, described
    elapsed_s: float = 0.0

    def add(self, o: Outcome, keep_failures: int = 50) -> None:
        self.sent += 1
        self.by_kind[o.kind] = self.by_kind.get(o.kind, 0) + 1
        if o.status is not None and o.status >= 500:
            self.server_5xx += 1
        if o.result == "completed":
            self.completed += 1
            self.completion_tokens += o.completion_tokens
            self.cancel_raced += o.cancel_raced
        elif o.result == "cancelled":
            self.cancelled += 1
        elif o.result == "refused":
            self.refused += 1
            self.refused_by_reason[o.reason] = self.refused_by_reason.get(o.reason, 0) + 1
        else:
            self.failed += 1
            self.failures_by_kind[o.kind] = self.failures_by_kind.get(o.kind, 0) + 1
            if len(self.failures) < keep_failures:
                self.failures.append(f"#{o.index} {o.case}: {o.reason}")


# --------------------------------------------------------------------------- the request mix
class RequestPlanner:
    """Draws request i from its own seeded RNG, so the mix does not depend on timing."""

    def __init__(self, cfg: SoakConfig, model: str, max_model_len: int, chat_overhead: int,
                 chat_ok: bool = True) -> None:
        self.cfg, self.model, self.max_model_len = cfg, model, max_model_len
        self.chat_overhead = chat_overhead
        self.chat_ok = chat_ok
        # Keep valid requests well inside the context whatever the tokenizer.
        self.max_tokens_hi = max(cfg.min_tokens, min(cfg.max_tokens, max_model_len // 4))

    def plan(self, index: int, phase: str) -> PlannedRequest:
        rng = random.Random(f"{self.cfg.seed}:{phase}:{index}")
        r = rng.random()
        if r < self.cfg.invalid_fraction:
            return self._invalid(index, rng)
        if r < self.cfg.invalid_fraction + self.cfg.overlong_fraction:
            return self._overlong(index, rng)
        return self._valid(index, rng)

    def _words(self, rng: random.Random, max_chars: int) -> str:
        target = rng.randint(1, max(1, max_chars))
        out: list[str] = []
        length = 0
        if rng.random() < 0.3:  # a shared prefix now and then exercises the prefix cache
            prefix = rng.choice(_SHARED_PREFIXES)
            if len(prefix) <= max_chars:
                out.append(prefix)
                length = len(prefix)
        while True:
            w = rng.choice(_WORDS)
            if length + len(w) + 1 > target:
                break
            out.append(w)
            length += len(w) + 1
        return " ".join(out) or rng.choice(_WORDS)[:max(1, max_chars)]

    def _valid(self, index: int, rng: random.Random) -> PlannedRequest:
        chat = self.chat_ok and rng.random() < 0.5
        stream = rng.random() < 0.5
        k = rng.randint(self.cfg.min_tokens, self.max_tokens_hi)
        n = 2 if rng.random() < 0.1 else 1
        overhead = self.chat_overhead if chat else 2  # BOS and a margin
        budget = max(1, min(400, self.max_model_len - k - overhead - 2))
        text = self._words(rng, budget)
        body: dict[str, Any] = {"model": self.model, "ignore_eos": True, "n": n, "stream": stream,
                                "temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}
        if rng.random() < 0.3:
            body["seed"] = rng.randint(0, 2**31)
        if stream:
            body["stream_options"] = {"include_usage": True}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            body["max_completion_tokens" if rng.random() < 0.5 else "max_tokens"] = k
            path = "/v1/chat/completions"
        else:
            body["prompt"] = text
            body["max_tokens"] = k
            path = "/v1/completions"
        plan = PlannedRequest(index, "valid", f"{'chat' if chat else 'completions'}/{'stream' if stream else 'full'}",
                              path, body, stream=stream, max_tokens=k, n=n)
        if rng.random() < self.cfg.cancel_fraction:
            if stream:
                plan.cancel_after_chunks = rng.randint(0, max(0, k - 1))
            else:
                plan.cancel_fraction = rng.random()
        return plan

    def _invalid(self, index: int, rng: random.Random) -> PlannedRequest:
        """A request the server must refuse with a 4xx (and an OpenAI error body)."""
        stream = rng.random() < 0.5
        base: dict[str, Any] = {"model": self.model, "prompt": "hello there", "max_tokens": 4, "stream": stream}
        chat_base: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 4, "stream": stream}
        cases: list[tuple[str, str, dict[str, Any] | None]] = [
            ("max_tokens_not_int", "/v1/completions", {**base, "max_tokens": "ten"}),
            ("negative_max_tokens", "/v1/completions", {**base, "max_tokens": -rng.randint(1, 100)}),
            ("unknown_model", "/v1/completions", {**base, "model": f"no-such-model-{rng.randint(0, 999)}"}),
            ("bad_temperature", "/v1/chat/completions", {**chat_base, "temperature": -rng.uniform(0.1, 5)}),
            ("bad_top_p", "/v1/completions", {**base, "top_p": 1.5}),
            ("empty_messages", "/v1/chat/completions", {**chat_base, "messages": []}),
            ("messages_not_list", "/v1/chat/completions", {**chat_base, "messages": "hello"}),
            ("prompt_wrong_type", "/v1/completions", {**base, "prompt": {"text": "hi"}}),
            ("missing_prompt", "/v1/completions", {k: v for k, v in base.items() if k != "prompt"}),
            ("token_out_of_vocab", "/v1/completions",
             {**base, "prompt": [1, 2, 10_000_000 + rng.randint(0, 10**6)]}),
            ("negative_token_id", "/v1/completions", {**base, "prompt": [1, -5, 2]}),
            ("n_zero", "/v1/chat/completions", {**chat_base, "n": 0}),
            ("stream_options_without_stream", "/v1/completions",
             {**base, "stream": False, "stream_options": {"include_usage": True}}),
            ("non_json_body", "/v1/completions", None),
        ]
        if self.cfg.api_key:
            cases.append(("bad_api_key", "/v1/completions", dict(base)))
        name, path, body = rng.choice(cases)
        plan = PlannedRequest(index, "invalid", f"invalid/{name}", path, body, stream=bool(body and body.get("stream")))
        if body is None:
            plan.raw_body = b'{"model": "x", "prompt": "truncated'
        if name == "bad_api_key":
            plan.headers = {"Authorization": "Bearer wrong-key"}
        return plan

    def _overlong(self, index: int, rng: random.Random) -> PlannedRequest:
        """A prompt (or prompt + max_tokens) longer than max_model_len: a 400 before any work."""
        stream = rng.random() < 0.5
        n_words = self.max_model_len + rng.randint(1, 64)  # every word is at least one token
        long_text = " ".join(rng.choice(_WORDS) for _ in range(n_words))
        case = rng.choice(["text_prompt", "token_prompt", "chat", "max_tokens"] if self.chat_ok
                          else ["text_prompt", "token_prompt", "max_tokens"])
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(1, 8), "stream": stream,
                                "ignore_eos": True}
        path = "/v1/completions"
        if case == "text_prompt":
            body["prompt"] = long_text
        elif case == "token_prompt":
            body["prompt"] = [rng.randint(1, 2)] * (self.max_model_len + rng.randint(1, 64))
        elif case == "chat":
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": long_text}]
        if case == "max_tokens":  # a short prompt, but max_tokens alone fills the context
            body["prompt"] = "hello"
            body["max_tokens"] = self.max_model_len + rng.randint(0, 64)
        elif rng.random() < 0.5:  # no max_tokens: the prompt alone is too long (the engine's check)
            body["max_tokens"] = None
        return PlannedRequest(index, "overlong", f"overlong/{case}", path, body, stream=stream)


# --------------------------------------------------------------------------- checking answers
def error_key(status: int, content: bytes) -> tuple[str, bool]:
    """(a short refusal key: status, OpenAI error type/code/param, whether the body is OpenAI-shaped)."""
    try:
        err = json.loads(content).get("error")
    except (ValueError, AttributeError):
        err = None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str) or not isinstance(err.get("type"), str):
        return f"HTTP {status} (no OpenAI error body: {content[:80]!r})", False
    parts = [f"HTTP {status}", f"type={err['type']}"]
    if err.get("code") is not None:
        parts.append(f"code={err['code']}")
    if err.get("param") is not None:
        parts.append(f"param={err['param']}")
    return " ".join(parts), True


def check_full(plan: PlannedRequest, data: Any) -> tuple[str | None, int]:
    """(None if a non-streamed answer is complete and of the right length, else why; tokens)."""
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        return f"no choices in the answer: {str(data)[:120]}", 0
    usage = data.get("usage") or {}
    tokens = usage.get("completion_tokens")
    choices = data["choices"]
    if sorted(c.get("index") for c in choices) != list(range(plan.n)):
        return f"choice indexes {[c.get('index') for c in choices]}, expected 0..{plan.n - 1}", 0
    for c in choices:
        if c.get("finish_reason") != "length":
            return f"choice {c.get('index')} finish_reason {c.get('finish_reason')!r}, expected 'length'", 0
        text = c.get("text") if "text" in c else (c.get("message") or {}).get("content")
        if not isinstance(text, str):
            return f"choice {c.get('index')} has no text: {str(c)[:120]}", 0
    if tokens != plan.n * plan.max_tokens:
        return f"usage.completion_tokens {tokens}, expected {plan.n * plan.max_tokens}", 0
    return None, tokens


class StreamCheck:
    """Follows one SSE stream: every event JSON, no in-band error, one finish per choice
    ("length"), then a usage chunk with the right count, then `data: [DONE]` last."""

    def __init__(self, plan: PlannedRequest) -> None:
        self.plan = plan
        self.events = 0
        self.done = False
        self.finish: dict[int, str] = {}
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None

    def feed(self, line: str) -> None:
        if self.error is not None or not line:
            return
        if not line.startswith("data: "):
            if not line.startswith(":"):  # SSE comments (keep-alives) are fine
                self.error = f"not an SSE data line: {line[:120]!r}"
            return
        payload = line[len("data: "):]
        if self.done:
            self.error = f"data after [DONE]: {payload[:120]!r}"
            return
        if payload == "[DONE]":
            self.done = True
            return
        self.events += 1
        try:
            obj = json.loads(payload)
        except ValueError:
            self.error = f"an event is not JSON: {payload[:120]!r}"
            return
        if not isinstance(obj, dict) or "error" in obj:
            self.error = f"in-band error: {payload[:200]}"
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        for c in obj.get("choices") or []:
            reason = c.get("finish_reason")
            if reason is not None:
                if c.get("index") in self.finish:
                    self.error = f"choice {c.get('index')} finished twice"
                self.finish[c.get("index")] = reason

    def verdict(self) -> tuple[str | None, int]:
        if self.error is not None:
            return self.error, 0
        if not self.done:
            return "the stream ended without data: [DONE]", 0
        want = {i: "length" for i in range(self.plan.n)}
        if self.finish != want:
            return f"finish reasons {self.finish}, expected {want}", 0
        if self.usage is None:
            return "no usage chunk (stream_options.include_usage)", 0
        tokens = self.usage.get("completion_tokens")
        if tokens != self.plan.n * self.plan.max_tokens:
            return f"usage.completion_tokens {tokens}, expected {self.plan.n * self.plan.max_tokens}", 0
        return None, tokens


# --------------------------------------------------------------------------- server facts
def gauges_from_metrics(text: str) -> ServerGauges:
    samples = metric_samples(text)

    def total(name: str) -> float | None:
        return sum(v for _, v in samples[name]) if name in samples else None

    aborts = sum(v for labels, v in samples.get(METRIC_SUCCESS, []) if labels.get("finished_reason") == "abort")
    return ServerGauges(total(METRIC_RUNNING), total(METRIC_WAITING), total(METRIC_KV_USAGE), aborts)


@dataclass
class LogErrors:
    """Tracebacks the server wrote to its log during the soak: a client that hangs up or
    sends garbage must never make the server raise, even where the client sees nothing."""

    tracebacks: int = 0
    by_exception: dict[str, int] = field(default_factory=dict)
    first: str = ""  # the first traceback, whole (cut at 6000 characters)


def scan_log(path: str, offset: int = 0) -> LogErrors:
    """Count the tracebacks in a log file from byte `offset` on, by their final exception line."""
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", "replace").splitlines()
    found = LogErrors()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("Traceback (most recent call last):"):
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and (not lines[i] or lines[i][0].isspace()):
            i += 1
        exc = lines[i][:200] if i < len(lines) else "(log ends inside a traceback)"
        found.tracebacks += 1
        found.by_exception[exc] = found.by_exception.get(exc, 0) + 1
        if not found.first:
            found.first = "\n".join(lines[max(0, start - 1):i + 1])[:6000]
        i += 1
    return found
