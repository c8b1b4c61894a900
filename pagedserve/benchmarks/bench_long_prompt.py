"""How long a cold long prompt holds another client's stream, and what a default server
holds in memory: one `pagedserve serve MODEL` with the default flags (plus any given),
a stream of 200 tokens running, then a prompt of ~N tokens nobody has sent before.

Prints the stream's longest gap between tokens while the long prompt prefills, the long
prompt's time to first token, and the server's resident memory after both.  A script
that prints figures (run it alone: two engines on 2 cores stall each other):

    python -m pagedserve.benchmarks.bench_long_prompt --prompt-tokens 2800
    python -m pagedserve.benchmarks.bench_long_prompt --pagedserve-args --max-step-ms 0
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import httpx

from pagedserve.benchmarks.harness import PagedServe, process_rss
from pagedserve.cpu_info import describe_cpu


def _stream(url: str, model: str, times: list[float], started: threading.Event) -> None:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[len("data: "):])
                times.append(time.monotonic())
                started.set()


def _long_prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)  # a new text each run: nothing of it is in the prefix cache
    vocab = ["river", "stone", "lamp", "orbit", "velvet", "cinder", "maple", "harbor", "quartz", "meadow"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(words))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=2800, help="about this many tokens (words are ~2 each)")
    ap.add_argument("--pagedserve-args", nargs=argparse.REMAINDER, default=[])
    args = ap.parse_args(argv)
    server = PagedServe([args.model, *args.pagedserve_args])
    try:
        url, model = server.url, httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        times: list[float] = []
        started = threading.Event()
        streamer = threading.Thread(target=_stream, args=(url, model, times, started), daemon=True)
        streamer.start()
        started.wait(120)
        time.sleep(0.5)
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", timeout=600, json={
            "model": model, "prompt": _long_prompt(args.prompt_tokens // 2, int(t0)), "max_tokens": 1})
        ttft = time.monotonic() - t0
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        streamer.join(600)
        during = [t for t in times if t0 - 1 <= t <= t0 + ttft + 1]
        gap = max((b - a for a, b in zip(during, during[1:], strict=False)), default=0.0)
        rss = process_rss(server.proc.pid)
        print(f"CPU: {describe_cpu()}")
        print(f"server: pagedserve serve {args.model} {' '.join(args.pagedserve_args)}")
        print(f"long prompt: {prompt_tokens} tokens, first token after {ttft:.2f} s")
        print(f"other stream's longest gap while it prefilled: {gap * 1000:.0f} ms")
        print(f"resident after both: {(rss.total if rss else 0) / 2**20:.0f} MiB")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
