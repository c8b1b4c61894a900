"""Soak test: thousands of mixed requests against a running OpenAI-compatible server.

    python -m pagedserve.benchmarks.soak --base-url http://127.0.0.1:8000 --pid 1234 --duration 600
    python -m pagedserve.benchmarks.soak --launch "MODEL --max-model-len 256" --num-requests 3000

Why: the bugs a server shows only under long, messy traffic -- KV blocks never freed
after a client hangs up mid-stream, a request stuck in the waiting queue, memory that
grows a little with every refused request, a 500 from an input nobody tried -- do not
show in unit tests.  This sends a seeded mix of requests (completions and chat,
streaming and not; a quarter of the valid ones cancelled at a random point; invalid
bodies; prompts longer than the context) and at the end checks that

- every valid request that was not cancelled got a complete answer of exactly the
  length asked for (`ignore_eos` with `max_tokens` k: usage.completion_tokens == n*k,
  finish_reason "length"; streams also end with `data: [DONE]` after a usage chunk);
- every invalid request got a 4xx with an OpenAI-shaped error body, every over-long
  one a 400, and no response at all was a 5xx;
- once the traffic stops the server drains: requests running = waiting = 0 and KV-cache
  usage 0 (read from its Prometheus /metrics);
- the server's RSS at rest (after `--settle` s of quiet) at the end is within 10% of its
  RSS at rest after warm-up (with `--pid` or `--launch`: the server's process and its
  children running the same executable; a compiler a kernel build runs is shown apart);
- the server's log (with `--server-log` or `--launch`) has no traceback: a client that
  hangs up or sends garbage must not make the server raise, even where no client sees it.

It prints what it saw (requests sent, completed, cancelled, refused by reason, 5xx,
RSS, the final gauges) and exits 1 if any condition fails, naming it.  `main(argv)`
returns the same summary as a dict (also written with `--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx

from pagedserve.benchmarks.harness import PagedServe, RssSample, process_rss
from pagedserve.benchmarks.soak_traffic import (
    METRIC_KV_USAGE,
    METRIC_RUNNING,
    METRIC_WAITING,
    LogErrors,
    Outcome,
    PhaseStats,
    PlannedRequest,
    RequestPlanner,
    ServerGauges,
    SoakConfig,
    StreamCheck,
    check_full,
    error_key,
    gauges_from_metrics,
    scan_log,
)

_OK_STATUSES = range(200, 300)


def _log_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


# --------------------------------------------------------------------------- the run
class Soak:
    """Runs the warm-up and main phases, then drains and checks.  One httpx client, no
    keep-alive: each request has its own connection, so closing it (a cancel) is
    unambiguous to the server."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.base = cfg.base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.full_latency = 0.5  # running mean of non-streamed latencies: the scale of non-stream cancels
        self.notes: list[str] = []

    def rss(self) -> RssSample | None:
        return process_rss(self.cfg.pid) if self.cfg.pid is not None else None

    async def gauges(self, client: httpx.AsyncClient) -> ServerGauges:
        r = await client.get(self.base + "/metrics", headers=self.headers, timeout=10)  # may need the key
        r.raise_for_status()
        return gauges_from_metrics(r.text)

    async def discover(self, client: httpx.AsyncClient) -> tuple[str, int, int, bool]:
        """(model, max_model_len, chat-template overhead in tokens, whether chat works)."""
        r = await client.get(self.base + "/v1/models", headers=self.headers, timeout=30)
        r.raise_for_status()
        cards = r.json().get("data") or []
        if not cards:
            raise RuntimeError("GET /v1/models lists no model")
        model = self.cfg.model or cards[0]["id"]
        card = next((c for c in cards if c.get("id") == model), cards[0])
        max_len = self.cfg.max_model_len or card.get("max_model_len")
        if not max_len:
            raise RuntimeError("GET /v1/models gives no max_model_len: pass --max-model-len")
        overhead, chat_ok = 64, True
        try:  # pagedserve's (and vLLM's) /tokenize: how many tokens the chat template adds
            t = await client.post(self.base + "/tokenize", headers=self.headers, timeout=30,
                                  json={"model": model, "messages": [{"role": "user", "content": ""}]})
            if t.status_code == 200:
                overhead = int(t.json()["count"]) + 4
            elif t.status_code == 400 and "template" in t.text:
                chat_ok = False
                self.notes.append("the model has no chat template: chat requests left out")
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        return model, int(max_len), overhead, chat_ok

    async def send(self, client: httpx.AsyncClient, plan: PlannedRequest) -> Outcome:
        """Send one request and judge what came back; never raises (but for cancellation)."""
        start = time.monotonic()
        try:
            outcome = await asyncio.wait_for(self._send(client, plan), self.cfg.request_timeout)
        except asyncio.TimeoutError:
            outcome = Outcome(plan.index, plan.kind, plan.case, "failed",
                              reason=f"no complete answer after {self.cfg.request_timeout:.0f} s (hang?)")
        except httpx.TimeoutException as e:
            outcome = Outcome(plan.index, plan.kind, plan.case, "failed", reason=f"timeout: {e!r}")
        except httpx.TransportError as e:
            outcome = Outcome(plan.index, plan.kind, plan.case, "failed", reason=f"transport error: {e!r}")
        outcome.latency = time.monotonic() - start
        return outcome

    async def _send(self, client: httpx.AsyncClient, plan: PlannedRequest) -> Outcome:
        headers = {**self.headers, **plan.headers}
        kwargs: dict[str, Any] = {"headers": headers}
        if plan.raw_body is not None:
            kwargs["content"] = plan.raw_body
            kwargs["headers"] = {**headers, "Content-Type": "application/json"}
        else:
            kwargs["json"] = plan.body
        url = self.base + plan.path
        if plan.stream:
            return await self._send_stream(client, plan, url, kwargs)
        if plan.cancel_fraction is None:
            r = await client.post(url, **kwargs)
            return self._judge_full(plan, r)
        delay = plan.cancel_fraction * self.full_latency
        task = asyncio.ensure_future(client.post(url, **kwargs))
        done, _ = await asyncio.wait({task}, timeout=delay)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if not task.done() or task.cancelled():
                return Outcome(plan.index, plan.kind, plan.case, "cancelled")
        outcome = self._judge_full(plan, task.result())  # it finished before the cancel: check it
        outcome.cancel_raced = outcome.result == "completed"
        return outcome

    def _refusal(self, plan: PlannedRequest, status: int, content: bytes) -> Outcome:
        key, shaped = error_key(status, content)
        reason = f"{plan.case}: {key}"
        fail = None
        if status >= 500:
            fail = f"server error {key}: {content[:300]!r}"
        elif not shaped:
            fail = f"refusal without an OpenAI error body: {key}"
        elif plan.kind == "valid" and not (status == 429 and self.cfg.allow_429):
            fail = f"valid request refused: {key}: {content[:300]!r}"
        elif plan.kind == "overlong" and status != 400:
            fail = f"over-long request answered {key}, expected HTTP 400"
        elif plan.kind == "invalid" and not 400 <= status < 500:
            fail = f"invalid request answered {key}, expected a 4xx"
        if fail is not None:
            return Outcome(plan.index, plan.kind, plan.case, "failed", status, fail)
        return Outcome(plan.index, plan.kind, plan.case, "refused", status, reason)

    def _judge_full(self, plan: PlannedRequest, r: httpx.Response) -> Outcome:
        if r.status_code not in _OK_STATUSES:
            return self._refusal(plan, r.status_code, r.content)
        if plan.kind != "valid":
            return Outcome(plan.index, plan.kind, plan.case, "failed", r.status_code,
                           f"accepted ({r.status_code}); it should have been refused: {r.content[:200]!r}")
        try:
            data = r.json()
        except ValueError:
            return Outcome(plan.index, plan.kind, plan.case, "failed", r.status_code,
                           f"the answer is not JSON: {r.content[:120]!r}")
        why, tokens = check_full(plan, data)
        if why is not None:
            return Outcome(plan.index, plan.kind, plan.case, "failed", r.status_code, why)
        self.full_latency = 0.9 * self.full_latency + 0.1 * r.elapsed.total_seconds()
        return Outcome(plan.index, plan.kind, plan.case, "completed", r.status_code, completion_tokens=tokens)

    async def _send_stream(self, client: httpx.AsyncClient, plan: PlannedRequest, url: str,
                           kwargs: dict[str, Any]) -> Outcome:
        async with client.stream("POST", url, **kwargs) as r:
            if r.status_code not in _OK_STATUSES:
                return self._refusal(plan, r.status_code, await r.aread())
            if plan.kind != "valid":
                return Outcome(plan.index, plan.kind, plan.case, "failed", r.status_code,
                               f"accepted ({r.status_code}, a stream); it should have been refused")
            check = StreamCheck(plan)
            if plan.cancel_after_chunks == 0:
                return Outcome(plan.index, plan.kind, plan.case, "cancelled", r.status_code)
            async for line in r.aiter_lines():
                check.feed(line)
                if plan.cancel_after_chunks is not None and check.events >= plan.cancel_after_chunks \
                        and not check.done:
                    return Outcome(plan.index, plan.kind, plan.case, "cancelled", r.status_code)  # closes it
            why, tokens = check.verdict()
            if why is not None:
                status = 500 if why.startswith("in-band error") and '"server_error"' in why else r.status_code
                return Outcome(plan.index, plan.kind, plan.case, "failed", status, why)
            return Outcome(plan.index, plan.kind, plan.case, "completed", r.status_code, completion_tokens=tokens,
                           cancel_raced=plan.cancel_after_chunks is not None)

    async def run_phase(self, client: httpx.AsyncClient, planner: RequestPlanner, phase: str,
                        num_requests: int | None, duration: float | None, stats: PhaseStats,
                        live: Any = None) -> None:
        """`concurrency` workers take request numbers in turn until the count or the time is used up."""
        next_index = 0
        deadline = time.monotonic() + duration if duration is not None else None
        start = time.monotonic()

        async def worker() -> None:
            nonlocal next_index
            while True:
                if num_requests is not None and next_index >= num_requests:
                    return
                if deadline is not None and time.monotonic() >= deadline:
                    return
                i = next_index
                next_index += 1
                stats.add(await self.send(client, planner.plan(i, phase)))

        tasks = [asyncio.ensure_future(worker()) for _ in range(self.cfg.concurrency)]
        reporter = asyncio.ensure_future(live()) if live is not None else None
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            if reporter is not None:
                reporter.cancel()
                await asyncio.gather(reporter, return_exceptions=True)
        stats.elapsed_s = time.monotonic() - start

    async def drain(self, client: httpx.AsyncClient) -> tuple[ServerGauges, float, str | None]:
        """Poll /metrics until running = waiting = 0 and KV usage = 0, or the drain timeout.
        (last gauges, seconds waited, an error reading /metrics if any)."""
        start = time.monotonic()
        g, err = ServerGauges(), None
        while True:
            try:
                g, err = await self.gauges(client), None
            except (httpx.HTTPError, ValueError) as e:
                err = f"GET /metrics failed: {e!r}"
            if err is None and g.idle():
                break
            if time.monotonic() - start >= self.cfg.drain_timeout:
                break
            await asyncio.sleep(0.5)
        return g, time.monotonic() - start, err

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
        log_offset = _log_size(cfg.server_log)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            model, max_len, overhead, chat_ok = await self.discover(client)
            planner = RequestPlanner(cfg, model, max_len, overhead, chat_ok)
            rss: dict[str, RssSample | None] = {"start": self.rss()}
            start_gauges = await self.gauges(client)
            log(f"soak: {model} at {self.base} (max_model_len {max_len}), concurrency {cfg.concurrency}, "
                f"{cfg.num_requests or '-'} requests / {cfg.duration or '-'} s, seed {cfg.seed}")

            warm = PhaseStats()
            if cfg.warmup_requests > 0:
                await self.run_phase(client, planner, "warmup", cfg.warmup_requests, None, warm)
            warm_gauges, _, _ = await self.drain(client)
            await asyncio.sleep(cfg.settle)
            rss["after_warmup"] = rss["peak"] = self.rss()
            log(f"soak: warm-up done: {warm.sent} requests in {warm.elapsed_s:.1f} s, RSS {_rss(rss['peak'])}")

            main = PhaseStats()

            async def live() -> None:
                last = time.monotonic()
                while True:
                    await asyncio.sleep(1.0)
                    now = self.rss()
                    if now is not None and (rss["peak"] is None or now.total > rss["peak"].total):
                        rss["peak"] = now
                    if cfg.progress_interval and time.monotonic() - last >= cfg.progress_interval:
                        last = time.monotonic()
                        log(f"soak: {main.sent} sent, {main.completed} completed, {main.cancelled} cancelled, "
                            f"{main.refused} refused, {main.failed} failed, RSS {_rss(now)}")

            num, dur = cfg.num_requests, cfg.duration
            if num is None and dur is None:
                num = 2000
            await self.run_phase(client, planner, "main", num, dur, main, live)
            end_gauges, drain_s, metrics_err = await self.drain(client)
            await asyncio.sleep(cfg.settle)
            rss["end"] = end = self.rss()
            if end is not None and (rss["peak"] is None or end.total > rss["peak"].total):
                rss["peak"] = end
            try:
                r = await client.get(self.base + "/health", headers=self.headers, timeout=10)
                healthy = r.status_code == 200
            except httpx.HTTPError:
                healthy = False
        log_errors = scan_log(cfg.server_log, log_offset) if cfg.server_log else None
        return self._summary(model, max_len, warm, main, start_gauges, warm_gauges, end_gauges, drain_s,
                             metrics_err, rss, healthy, log_errors)

    def _summary(self, model: str, max_len: int, warm: PhaseStats, main: PhaseStats, start_g: ServerGauges,
                 warm_g: ServerGauges, end_g: ServerGauges, drain_s: float, metrics_err: str | None,
                 rss: dict[str, RssSample | None], healthy: bool, log_errors: LogErrors | None) -> dict[str, Any]:
        cfg = self.cfg
        both = [warm, main]
        fails = {kind: sum(p.failures_by_kind.get(kind, 0) for p in both) for kind in ("valid", "invalid", "overlong")}
        warm_rss, end_rss = rss.get("after_warmup"), rss.get("end")
        rss_growth = end_rss.total / warm_rss.total - 1.0 if end_rss and warm_rss and warm_rss.total else None
        missing = [name for name, v in ((METRIC_RUNNING, end_g.running), (METRIC_WAITING, end_g.waiting),
                                        (METRIC_KV_USAGE, end_g.kv_usage)) if v is None]
        conditions: dict[str, bool | None] = {
            "no 5xx responses": sum(p.server_5xx for p in both) == 0,
            "every valid request not cancelled got a complete, correct-length answer": fails["valid"] == 0,
            "every invalid request was refused with an OpenAI-shaped 4xx": fails["invalid"] == 0,
            "every over-long request was refused with a 400": fails["overlong"] == 0,
            "requests running = waiting = 0 at the end": metrics_err is None and not missing
            and end_g.running == 0 and end_g.waiting == 0,
            "KV-cache usage 0 at the end": metrics_err is None and end_g.kv_usage is not None
            and end_g.kv_usage <= 1e-9,
            f"RSS at rest at the end within {cfg.rss_tolerance:.0%} of at rest after warm-up":
                None if rss_growth is None else rss_growth <= cfg.rss_tolerance,
            "server healthy (GET /health 200) at the end": healthy,
            "no tracebacks in the server log": None if log_errors is None else log_errors.tracebacks == 0,
        }
        notes = list(self.notes)
        if metrics_err:
            notes.append(metrics_err)
        if missing:
            notes.append(f"missing from /metrics: {', '.join(missing)}")
        if rss_growth is None:
            notes.append("RSS not checked (no --pid)" if cfg.pid is None else "RSS could not be read")
        if log_errors is None:
            notes.append("server log not scanned (no --server-log)")
        failed = [name for name, ok in conditions.items() if ok is False]
        return {
            "ok": not failed,
            "failed_conditions": failed,
            "conditions": conditions,
            "model": model,
            "base_url": self.base,
            "max_model_len": max_len,
            "config": {**asdict(cfg), "api_key": "***" if cfg.api_key else None},  # not the secret in a file
            "sent": main.sent,
            "completed": main.completed,
            "cancelled": main.cancelled,
            "cancel_raced": main.cancel_raced,
            "refused": main.refused,
            "refused_by_reason": dict(sorted(main.refused_by_reason.items())),
            "failed": main.failed,
            "server_5xx": main.server_5xx,
            "completion_tokens": main.completion_tokens,
            "by_kind": main.by_kind,
            "elapsed_s": round(main.elapsed_s, 2),
            "requests_per_s": round(main.sent / main.elapsed_s, 2) if main.elapsed_s else None,
            "failures": warm.failures[:10] + main.failures,
            "warmup": asdict(warm),
            "server_aborts": end_g.aborts - start_g.aborts,
            "end_gauges": {"running": end_g.running, "waiting": end_g.waiting, "kv_cache_usage": end_g.kv_usage,
                           "drain_s": round(drain_s, 2)},
            "after_warmup_gauges": {"running": warm_g.running, "waiting": warm_g.waiting,
                                    "kv_cache_usage": warm_g.kv_usage},
            "rss_bytes": {**{k: v.total if v else None for k, v in rss.items()},
                          "growth_vs_warmup": None if rss_growth is None else round(rss_growth, 4)},
            "rss_detail": {k: asdict(v) if v else None for k, v in rss.items()},
            "server_log": asdict(log_errors) if log_errors else None,
            "notes": notes,
        }


# --------------------------------------------------------------------------- CLI
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def _rss(r: RssSample | None) -> str:
    if r is None:
        return "n/a"
    parts = [f"{r.num_workers} workers: {_mib(r.workers)}"] if r.num_workers else []
    if r.num_transient:
        parts.append(f"not counted: {r.num_transient} other processes, e.g. a kernel build's compiler: {_mib(r.transient)}")
    return _mib(r.total) + (f" ({'; '.join(parts)})" if parts else "")


def format_report(s: dict[str, Any]) -> str:
    """The summary as a human-readable block."""
    rss = s["rss_bytes"]
    g = s["end_gauges"]
    lines = [
        f"soak of {s['model']} at {s['base_url']}: {s['sent']} requests in {s['elapsed_s']} s "
        f"({s['requests_per_s']} req/s), after {s['warmup']['sent']} warm-up requests",
        f"  by kind:      {s['by_kind']}",
        f"  completed:    {s['completed']} ({s['cancel_raced']} of them had a cancel planned that came too late), "
        f"{s['completion_tokens']} tokens",
        f"  cancelled:    {s['cancelled']} (server counted {s['server_aborts']:.0f} aborts, warm-up included)",
        f"  refused:      {s['refused']}",
    ]
    lines += [f"    {n:5d}  {reason}" for reason, n in s["refused_by_reason"].items()]
    lines += [
        f"  failed:       {s['failed']} (warm-up: {s['warmup']['failed']})",
        f"  5xx:          {s['server_5xx']} (warm-up: {s['warmup']['server_5xx']})",
        f"  RSS:          start {_mib(rss['start'])}, after warm-up {_mib(rss['after_warmup'])}, "
        f"end {_mib(rss['end'])}, peak {_mib(rss['peak'])}"
        + (f" ({rss['growth_vs_warmup']:+.1%} vs after warm-up)" if rss["growth_vs_warmup"] is not None else ""),
        "                " + ", ".join(f"{k}: {_rss(RssSample(**v))}" for k, v in s["rss_detail"].items() if v)
        + " (server process + workers)",
        f"  at the end:   running {g['running']}, waiting {g['waiting']}, KV usage {g['kv_cache_usage']} "
        f"(drained in {g['drain_s']} s)",
    ]
    errors = s["server_log"]
    if errors is not None:
        lines.append(f"  server log:   {errors['tracebacks']} tracebacks")
        lines += [f"    {n:5d}  {exc}" for exc, n in errors["by_exception"].items()]
    if s["failures"]:
        lines.append("  failures (first ones):")
        lines += [f"    {f}" for f in s["failures"][:20]]
    lines += [f"  note: {n}" for n in s["notes"]]
    lines.append("  conditions:")
    for name, ok in s["conditions"].items():
        lines.append(f"    [{'PASS' if ok else 'skip' if ok is None else 'FAIL'}] {name}")
    lines.append("SOAK PASSED" if s["ok"] else "SOAK FAILED: " + "; ".join(s["failed_conditions"]))
    return "\n".join(lines)


def _token_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.replace("-", ":").partition(":")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if not 1 <= a <= b:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return a, b


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedserve.benchmarks.soak",
                                description="Soak an OpenAI-compatible server with mixed traffic, then check "
                                            "that it recovers.")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="an already running server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", metavar='"ARGS..."',
                        help="start `python -m pagedserve.entrypoints.cli serve ARGS --port P` and soak it")
    p.add_argument("--pid", type=int, help="with --base-url: the server's PID, for RSS (without it RSS is not checked)")
    p.add_argument("--server-log", help="the server's log, scanned for tracebacks at the end; with --launch: where "
                                        "the server's output goes (default: a temp file)")
    p.add_argument("--duration", type=float, help="seconds of traffic after warm-up")
    p.add_argument("--num-requests", type=int, help="requests after warm-up (default 2000 when no --duration)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", help="bearer key (with --launch, default: the --api-key in ARGS)")
    p.add_argument("--model", help="model name (default: the first id of GET /v1/models)")
    p.add_argument("--max-model-len", type=int, help="override the max_model_len of GET /v1/models")
    p.add_argument("--warmup-requests", type=int, default=64, help="mixed requests before the RSS baseline (64)")
    p.add_argument("--max-tokens", type=_token_range, default=(1, 32), metavar="MIN:MAX",
                   help="max_tokens of valid requests, drawn uniformly (default 1:32; capped at max_model_len/4)")
    p.add_argument("--cancel-fraction", type=float, default=0.25, help="of valid requests (default 0.25)")
    p.add_argument("--invalid-fraction", type=float, default=0.10, help="of all requests (default 0.10)")
    p.add_argument("--overlong-fraction", type=float, default=0.05, help="of all requests (default 0.05)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request counts as hung")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds to wait at the end for running = waiting = 0 and KV usage = 0 (default 30)")
    p.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS growth after warm-up (0.10)")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds of quiet before the compared RSS samples (after warm-up, at the end; default 5)")
    p.add_argument("--allow-429", action="store_true", help="a 429 on a valid request is a refusal, not a failure")
    p.add_argument("--progress-interval", type=float, default=10.0, help="seconds between progress lines (0: none)")
    p.add_argument("--json", metavar="OUT", help="write the summary as JSON here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run a soak as the CLI flags say; print the report and return the summary."""
    args = make_parser().parse_args(argv)
    server: PagedServe | None = None
    api_key, pid, base_url, server_log = args.api_key, args.pid, args.base_url, args.server_log
    if args.launch is not None:
        launch_args = shlex.split(args.launch)
        if api_key is None and "--api-key" in launch_args[:-1]:
            api_key = launch_args[launch_args.index("--api-key") + 1]
        server = PagedServe(launch_args, args.server_log)
        base_url, pid, server_log = server.url, server.proc.pid, server.log_path
        log(f"soak: launched the server (pid {pid}, log {server.log_path})")
    cfg = SoakConfig(
        base_url=base_url, api_key=api_key, model=args.model, pid=pid, server_log=server_log,
        num_requests=args.num_requests,
        duration=args.duration, concurrency=args.concurrency, seed=args.seed, warmup_requests=args.warmup_requests,
        min_tokens=args.max_tokens[0], max_tokens=args.max_tokens[1], cancel_fraction=args.cancel_fraction,
        invalid_fraction=args.invalid_fraction, overlong_fraction=args.overlong_fraction,
        max_model_len=args.max_model_len, request_timeout=args.request_timeout, drain_timeout=args.drain_timeout,
        rss_tolerance=args.rss_tolerance, settle=args.settle, allow_429=args.allow_429,
        progress_interval=args.progress_interval)
    try:
        summary = asyncio.run(Soak(cfg).run())
        if server is not None:
            alive = server.proc.poll() is None
            summary["conditions"]["launched server still running at the end"] = alive
            if not alive:
                summary["ok"] = False
                summary["failed_conditions"].append("launched server still running at the end")
            summary["server_log_path"] = server.log_path
    finally:
        if server is not None:
            server.stop()
    print(format_report(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
