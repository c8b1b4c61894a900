"""`pagedserve bench serve`: online load against any OpenAI-compatible server.

Requests arrive as a Poisson process (`--request-rate`, inf = all at once) and/or under a
concurrency cap (`--max-concurrency`); every request streams, so time to first token
(TTFT), inter-token latency (ITL: gap between streamed chunks), time per output token
after the first (TPOT) and end-to-end latency (E2EL) are measured at the client, as a
user sees them.  Token counts come from the server's usage chunk (stream_options
.include_usage), falling back to counting chunks for servers that do not send one.
Warm-up requests (`--num-warmups`) have prompts of their own: sent the measured
prompts, the server's prefix cache would have answered them before they were timed.
A run in which every request failed prints no latencies and exits with an error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

# Common one-token words: prompts of N of them are close to N tokens for BPE vocabularies.
_WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from or "
          "had by word but what some we can out other were all there when up use your how said an each "
          "she which do their time if will way about many then them write would like so these her long "
          "make thing see him two has look more day could go come did number sound no most people my over "
          "know water than call first who may down side been now find any new work part take get place made "
          "live where after back little only round man year came show every good me give our under name").split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_prompts(args: argparse.Namespace, rng: random.Random, count: int | None = None,
                 shared_prefix: bool = True, tokenizer: Any = None) -> list[tuple[Any, int]]:
    """`count` (default --num-prompts) (prompt, output_len) pairs.  With a `tokenizer`
    (--tokenizer), completions prompts are exact token-id lists, and chat prompts their
    text (a message is text).  `shared_prefix`: the shared-prefix dataset's common
    prefix leads each prompt (warm-ups have none, so they cache nothing the measured
    requests use)."""
    special = set(tokenizer.all_special_ids) if tokenizer is not None else set()
    # (no special token: decoded into a chat message, "<|im_end|>" came back as the real one)
    vocab = [i for i in range(len(tokenizer)) if i not in special] if tokenizer is not None else None

    def seq(n: int) -> Any:
        if vocab is not None:
            return [rng.choice(vocab) for _ in range(n)]
        return [rng.choice(_WORDS) for _ in range(n)]

    def vary(n: int) -> int:
        lo = max(1, int(n * (1 - args.random_range_ratio)))
        return rng.randint(lo, max(lo, int(n * (1 + args.random_range_ratio))))

    prefix = seq(args.shared_prefix_len) if shared_prefix and args.dataset_name == "shared-prefix" else []
    chat = args.endpoint.endswith("/chat/completions")
    prompts = []
    for _ in range(args.num_prompts if count is None else count):
        body = prefix + seq(vary(args.random_input_len))
        if vocab is None:
            prompt: Any = " ".join(body)
        else:
            prompt = tokenizer.decode(body) if chat else body
        prompts.append((prompt, vary(args.random_output_len)))
    return prompts


async def send_one(client: Any, args: argparse.Namespace, prompt: Any, max_tokens: int) -> RequestResult:
    chat = args.endpoint.endswith("/chat/completions")
    body: dict[str, Any] = {
        "model": args.model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    res = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    ended = False  # [DONE] or a finish_reason: a stream cut short is a failure, not a short answer
    try:
        async with client.stream("POST", args.base_url + args.endpoint, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    ended = True
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"].get("message", msg["error"]))
                    return res
                if msg.get("usage"):
                    res.prompt_tokens = msg["usage"]["prompt_tokens"]
                    res.output_tokens = msg["usage"]["completion_tokens"]
                for choice in msg.get("choices", []):
                    ended = ended or choice.get("finish_reason") is not None
                    if not has_output(choice, chat):
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.latency = last - start  # at the last output chunk (the usage chunk and [DONE] are not output)
        if not chunks and res.output_tokens:  # tokens with no visible text: seen at the end
            res.ttft = res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = ended and res.output_tokens > 0
        if not ended:
            res.error = "the stream ended before [DONE] or a finish_reason"
        elif not res.ok:
            res.error = "no output streamed"
    except Exception as e:  # noqa: BLE001 - one failed request must not stop the run
        res.error = f"{type(e).__name__}: {e}"
    return res


def has_output(choice: dict[str, Any], chat: bool) -> bool:
    """A chunk's choice carries generated output: text, or on chat a reasoning or tool-call
    delta (an answer that is only a tool call has output; its first chunk is its TTFT)."""
    if not chat:
        return bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or delta.get("tool_calls"))


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    n_conn = args.max_concurrency or args.num_prompts
    # No keep-alive: a server may close a finished stream's connection just as the pool
    # hands it to the next request (llama-server does), which would fail that request.
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=0)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None, connect=30), limits=limits) as client:
        if args.model is None:
            try:
                args.model = (await client.get(args.base_url + "/v1/models")).json()["data"][0]["id"]
            except Exception as e:  # noqa: BLE001 - unreachable, or not an OpenAI server: one line
                raise BenchmarkError(f"cannot read the model's name from {args.base_url}/v1/models "
                                     f"({type(e).__name__}: {e}); name it with --model") from None
        tokenizer = None
        if args.tokenizer:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        prompts = make_prompts(args, rng, tokenizer=tokenizer)
        warmups = make_prompts(args, random.Random(f"warm-up {args.seed}"), args.num_warmups, False, tokenizer)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt: Any, out_len: int) -> RequestResult:
            if sem is None:
                return await send_one(client, args, prompt, out_len)
            async with sem:
                return await send_one(client, args, prompt, out_len)

        if warmups:
            failed = [r.error for r in await asyncio.gather(*(limited(p, 4) for p, _ in warmups)) if not r.ok]
            if len(failed) == len(warmups):
                raise BenchmarkError(f"every warm-up request failed: {failed[0]}")
        tasks = []
        start = time.perf_counter()
        for prompt, out_len in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt, out_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, results, duration)


class BenchmarkError(Exception):
    """A run that measured nothing (the server unreachable, every request failed)."""


def percentile(ordered: list[float], p: float) -> float:
    """The p-th percentile of sorted values, linearly interpolated between the two nearest
    ranks (numpy's default, as vLLM's benchmark reports it): P50 is the median."""
    rank = p / 100 * (len(ordered) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def _stats(name: str, values: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """Mean, median and percentiles in ms; None for each when nothing was measured."""
    ms = sorted(v * 1000 for v in values)
    keys = [f"mean_{name}_ms", f"median_{name}_ms", *(f"p{p:g}_{name}_ms" for p in percentiles)]
    if not ms:
        return dict.fromkeys(keys)
    return dict(zip(keys, [statistics.fmean(ms), statistics.median(ms), *(percentile(ms, p) for p in percentiles)],
                    strict=True))


def parse_percentiles(text: str) -> list[float]:
    """--metric-percentiles: comma-separated numbers in [0, 100] (checked before the run)."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or not all(0 <= p <= 100 for p in values):
        raise argparse.ArgumentTypeError(f"percentiles must be within 0..100, got {text!r}")
    return values


def summarize(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    pcts = args.metric_percentiles
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
    }
    summary.update(_stats("ttft", [r.ttft for r in ok], pcts))
    summary.update(_stats("tpot", tpot, pcts))
    summary.update(_stats("itl", [x for r in ok for x in r.itl], pcts))
    summary.update(_stats("e2el", [r.latency for r in ok], pcts))
    summary["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return summary


def format_summary(s: dict[str, Any], pcts: list[float]) -> str:
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Maximum request concurrency:", s["max_concurrency"] or "unlimited"),
            ("Request rate (req/s):", s["request_rate"]),
            ("Benchmark duration (s):", f"{s['duration_s']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        name = key.upper()
        for label, field_name in ((f"Mean {name} (ms):", f"mean_{key}_ms"), (f"Median {name} (ms):", f"median_{key}_ms"),
                                  *((f"P{p:g} {name} (ms):", f"p{p:g}_{key}_ms") for p in pcts)):
            value = s[field_name]
            lines.append(f"{label:<40}{'n/a' if value is None else f'{value:.2f}':<10}")
    lines.append("=" * 50)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)


def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in req/s (default: inf = send all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--dataset-name", default="random", choices=["random", "shared-prefix"])
    p.add_argument("--random-input-len", type=int, default=128, help="prompt tokens (words without --tokenizer)")
    p.add_argument("--random-output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths vary uniformly by +- this ratio, in [0, 1)")
    p.add_argument("--shared-prefix-len", type=int, default=256, help="common prefix length for shared-prefix")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer: send exact-length random token-id prompts")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max_tokens (default: on)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent first, untimed, with prompts of their own (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", type=parse_percentiles, default=[99.0],
                   help="comma-separated, within 0..100, e.g. 50,90,99 (default: 99)")
    p.add_argument("--save-result", default=None, metavar="FILE", help="write the summary as JSON")
    return p


def main(args: argparse.Namespace | list[str] | None = None) -> dict[str, Any]:
    """Run from parsed args, or parse an argv list (how `pagedserve bench serve` calls it)."""
    if not isinstance(args, argparse.Namespace):
        args = add_cli_args(argparse.ArgumentParser(prog="pagedserve bench serve", description=__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter)
                            ).parse_args(args)
    check_args(args)
    args.base_url = args.base_url.rstrip("/")
    try:
        summary = asyncio.run(run_benchmark(args))
    except BenchmarkError as e:
        raise SystemExit(f"error: {e}") from None
    print(format_summary(summary, args.metric_percentiles))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({**summary, "args": {k: v for k, v in vars(args).items() if not callable(v)}}, f, indent=2)
    if not summary["completed"]:
        raise SystemExit(f"error: every request failed: {summary['errors'][0]}")
    return summary


def check_args(args: argparse.Namespace) -> None:
    """Each flag's range, before any request: SystemExit naming the flag."""
    for name, least in (("num_prompts", 1), ("random_input_len", 1), ("random_output_len", 1),
                        ("num_warmups", 0), ("shared_prefix_len", 0)):
        if getattr(args, name) < least:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= {least}")
    if not args.request_rate > 0:  # (NaN too)
        raise SystemExit("error: --request-rate must be > 0 (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("error: --max-concurrency must be >= 1")
    if not 0 <= args.random_range_ratio < 1:
        raise SystemExit("error: --random-range-ratio must be within [0, 1)")


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` under the CLI's `bench` subcommands."""
    p = subparsers.add_parser("serve", help="online load test of an OpenAI-compatible server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    p.set_defaults(func=main)
    return p


if __name__ == "__main__":
    main()

