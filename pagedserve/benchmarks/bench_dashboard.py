"""What the dashboard costs: chat-burst throughput through a real server with no page
open, with the page open in headless Chromium, and with a bare reader of its event stream.

    python -m pagedserve.benchmarks.bench_dashboard --rounds 5
    python -m pagedserve.benchmarks.bench_dashboard --launch "smollm2-135m-instruct --max-num-seqs 32"

Each round runs the chat-burst workload (32 chat requests at once, greedy, 128 tokens
each, EOS ignored) once per mode, modes interleaved so that drift of the machine hits
them alike; it prints the median output tokens/s per mode and its ratio to "closed".
"page" needs Chromium (--chromium, default /usr/bin/chromium) and playwright; the
browser then shares the machine's cores with the server, as it would on a laptop.
"stream" reads /dashboard/events from a thread of this process: the server's own cost.

Throughput on a small shared machine drifts by several percent between runs, more than
the cost being measured, so it also prints the cost directly: the seconds the server
spent on the dashboard's data during the burst (snapshots on the engine thread, events
on the event loop; the server counts them and sends the total with every event) as a
share of the burst's wall time, and the CPU seconds Chromium's processes used (what
drawing the page takes from a machine that also runs the server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from pagedserve.benchmarks import workloads as wl
from pagedserve.benchmarks.harness import PagedServe

API_KEY = "bench-dashboard"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]


async def _burst(url: str, model: str) -> tuple[int, float]:
    """(completion tokens, seconds) of one chat-burst through the server."""
    work = wl.chat_burst()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        async def one(conv: list[dict[str, str]], max_tokens: int) -> int:
            r = await client.post("/v1/chat/completions", json={
                "model": model, "messages": conv, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": work.ignore_eos})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(c, m) for c, m in zip(work.conversations, work.max_tokens, strict=True)))
        return sum(tokens), time.perf_counter() - t0


def run_burst(url: str, model: str) -> tuple[int, float]:
    """(output tokens, seconds) of one burst, run on a thread of its own (the browser's
    driver keeps the main thread)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _burst(url, model)).result()


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads), from /proc."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone
        total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    return total


def pids_with(marker: str) -> list[int]:
    """Processes whose command line contains `marker` (a browser's profile directory)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        out.append(int(name))
            except OSError:
                pass
    return out


@dataclass
class Observer:
    """What a mode has open while a burst runs: the events it received, the server's
    dashboard seconds in the newest one, and its own processes."""

    events: Callable[[], int]
    cost: Callable[[], float]
    pids: Callable[[], list[int]]


@contextmanager
def nothing_open(url: str, chromium: str) -> Iterator[Observer]:
    yield Observer(lambda: 0, lambda: 0.0, list)


@contextmanager
def stream_reader(url: str, chromium: str) -> Iterator[Observer]:
    """A thread reading the event stream, as a page would, without drawing anything."""
    stop = threading.Event()
    events, cost = [0], [0.0]
    connected = threading.Event()

    def read() -> None:
        with httpx.stream("GET", url + "/dashboard/events", headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=None) as r:
            connected.set()
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events[0] += 1
                    cost[0] = json.loads(line[5:])["cost_seconds"]
                if stop.is_set():
                    return

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    connected.wait(30)
    try:
        yield Observer(lambda: events[0], lambda: cost[0], list)
    finally:
        stop.set()
        thread.join(timeout=5)


def open_dashboard(page: Any, url: str, api_key: str, timeout_ms: float = 30_000) -> None:
    """Open the dashboard in a Playwright page, answer its API-key prompt (the event
    stream's 401 shows it) and wait for the first full picture."""
    page.goto(url + "/")
    page.wait_for_selector("#key-form:not([hidden])", timeout=timeout_ms)
    page.fill("#api-key", api_key)
    page.click("#key-form button[type=submit]")
    page.wait_for_function("window.pagedserve.fullEvents > 0", timeout=timeout_ms)


@contextmanager
def browser_page(url: str, chromium: str) -> Iterator[Observer]:
    """The dashboard open in headless Chromium, key entered, live."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw, tempfile.TemporaryDirectory() as profile:
        context = pw.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True,
                                                        args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        page = context.pages[0] if context.pages else context.new_page()
        open_dashboard(page, url, API_KEY)
        try:
            yield Observer(lambda: page.evaluate("window.pagedserve.events"),
                           lambda: page.evaluate("window.pagedserve.costSeconds"), lambda: pids_with(profile))
        finally:
            context.close()


MODES: dict[str, Callable[[str, str], Any]] = {"closed": nothing_open, "page": browser_page,
                                               "stream": stream_reader}


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--launch", default="smollm2-135m-instruct --max-model-len 1024 --max-num-seqs 32",
                   help="arguments of `pagedserve serve` (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--chromium", default="/usr/bin/chromium")
    args = p.parse_args(argv)
    modes = list(args.modes)
    if "page" in modes and not shutil.which(args.chromium):
        print(f"no Chromium at {args.chromium}: the 'page' mode is left out")
        modes.remove("page")
    server = PagedServe([*shlex.split(args.launch), "--api-key", API_KEY, "--served-model-name", "bench"])
    try:
        run_burst(server.url, "bench")  # warm-up: kernels, allocator, caches
        results: dict[str, list[float]] = {m: [] for m in modes}
        cost_share: dict[str, list[float]] = {m: [] for m in modes}  # dashboard seconds / burst seconds
        observer_cpu: dict[str, list[float]] = {m: [] for m in modes}  # CPU s of the browser per burst
        for r in range(args.rounds):
            for mode in modes:
                with MODES[mode](server.url, args.chromium) as observer:
                    time.sleep(1.0)  # the page settles (its first full picture)
                    before, cost0, pids = observer.events(), observer.cost(), observer.pids()
                    obs0 = cpu_seconds(pids)
                    tokens, seconds = run_burst(server.url, "bench")
                    time.sleep(0.6)  # the events of the burst's last moments arrive
                    obs1, cost = cpu_seconds(pids), observer.cost() - cost0
                    seen = observer.events() - before
                results[mode].append(tokens / seconds)
                cost_share[mode].append(cost / seconds)
                observer_cpu[mode].append(obs1 - obs0)
                print(f"round {r + 1} {mode:>6}: {tokens / seconds:7.1f} output tok/s over {seconds:.2f} s; "
                      f"dashboard work in the server {1000 * cost:.1f} ms ({seen} events); "
                      f"browser CPU {obs1 - obs0:.2f} s", flush=True)
    finally:
        server.stop()
    base = statistics.median(results["closed"]) if "closed" in results else None
    print("\nchat-burst (32 at once, 128 tokens each), median of", args.rounds, "rounds:")
    for mode, values in results.items():
        med = statistics.median(values)
        ratio = f" = {med / base:.3f}x closed" if base else ""
        print(f"  {mode:>6}: {med:7.1f} tok/s{ratio}; dashboard work in the server "
              f"{100 * statistics.median(cost_share[mode]):.3f}% of the burst's time; browser "
              f"{statistics.median(observer_cpu[mode]):.2f} CPU s per burst   "
              f"[tok/s: {', '.join(f'{v:.1f}' for v in values)}]")
    return results


if __name__ == "__main__":
    main()
