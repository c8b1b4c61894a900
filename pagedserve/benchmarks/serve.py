"""`pagedserve bench serve`: online load against any OpenAI-compatible server.

Requests arrive as a Poisson process (`--request-rate`, inf = all at once) and/or under a
concurrency cap (`--max-concurrency`); every request streams, so time to first token
(TTFT), inter-token latency (ITL: gap between streamed chunks), time per output token
after the first (TPOT) and end-to-end latency (E2EL) are measured at the client, as a
user sees them.  Token counts come from the server's usage chunk (stream_options
.include_usage); for servers that send none, from the tokenizer (the prompt's length, the
answer's text re-encoded, as vLLM counts them), and without one output chunks are counted.
Warm-up requests (`--num-warmups`) have prompts of their own: sent the measured
prompts, the server's prefix cache would have answered them before they were timed.
A run in which every request failed prints no latencies and exits with an error.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.benchmarks.harness import check_output_file

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
    text: str = ""  # what was streamed (vLLM's generated_texts)


def special_ids(tokenizer: Any) -> set[int]:
    """A tokenizer's added and special tokens' ids (HF's and the engine's saved snapshot alike)."""
    named = [t for v in tokenizer.special_tokens_map.values() for t in (v if isinstance(v, list) else [v])]
    ids = {tokenizer.convert_tokens_to_ids(t) for t in named if isinstance(t, str)}
    return (ids | set(tokenizer.get_added_vocab().values())) - {None}


def endpoint_of(args: argparse.Namespace) -> str:
    """The route requests go to: --endpoint, else --backend's, else /v1/completions."""
    return args.endpoint or BACKENDS.get(args.backend or "") or "/v1/completions"


def is_chat(args: argparse.Namespace) -> bool:
    return endpoint_of(args).endswith("/chat/completions")


def make_prompts(args: argparse.Namespace, rng: random.Random, count: int | None = None,
                 shared_prefix: bool = True, tokenizer: Any = None) -> list[tuple[Any, int]]:
    """`count` (default --num-prompts) (prompt, output_len) pairs.  With a `tokenizer`
    (--tokenizer), completions prompts are exact token-id lists, and chat prompts their
    text (a message is text).  `shared_prefix`: the shared-prefix dataset's common
    prefix leads each prompt, and sharegpt's conversations are the prompts (warm-ups have
    neither, so they cache nothing the measured requests use)."""
    special = special_ids(tokenizer) if tokenizer is not None else set()
    # (no special token: decoded into a chat message, "<|im_end|>" came back as the real one)
    vocab = [i for i in range(len(tokenizer)) if i not in special] if tokenizer is not None else None

    def seq(n: int) -> Any:
        if vocab is not None:
            return [rng.choice(vocab) for _ in range(n)]
        return [rng.choice(_WORDS) for _ in range(n)]

    def vary(n: int) -> int:
        lo = max(1, int(n * (1 - args.random_range_ratio)))
        return rng.randint(lo, max(lo, int(n * (1 + args.random_range_ratio))))

    if args.dataset_name == "sharegpt" and shared_prefix:  # (warm-ups: random prompts, none of the dataset's)
        return sharegpt_prompts(args, rng, args.num_prompts if count is None else count, tokenizer)
    prefix = seq(args.shared_prefix_len) if shared_prefix and args.dataset_name == "shared-prefix" else []
    prefix = seq(args.random_prefix_len) + prefix  # (vLLM's: one fixed random prefix for every prompt)
    chat = is_chat(args)
    prompts = []
    for _ in range(args.num_prompts if count is None else count):
        body = prefix + seq(vary(args.random_input_len))
        if vocab is None:
            prompt: Any = " ".join(body)
        else:
            prompt = tokenizer.decode(body) if chat else body
        prompts.append((prompt, vary(args.random_output_len)))
    return prompts


def sharegpt_prompts(args: argparse.Namespace, rng: random.Random, count: int,
                     tokenizer: Any = None) -> list[tuple[Any, int]]:
    """vLLM's sharegpt dataset: each conversation's first human turn as the prompt, and its
    first answer's length (tokens with a tokenizer, else words; or --sharegpt-output-len)
    as max_tokens; turns shorter than 4 or longer than vLLM's bounds are skipped."""
    try:
        with open(args.dataset_path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise BenchmarkError(f"--dataset-path {args.dataset_path!r}: {e}") from None

    def length(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else len(text.split())

    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if isinstance(c, dict) and isinstance(c.get("conversations"), list) and len(c["conversations"]) >= 2
             and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in c["conversations"][:2])]
    rng.shuffle(pairs)
    prompts: list[tuple[Any, int]] = []
    for prompt, answer in pairs:
        if len(prompts) == count:
            return prompts
        n_in, n_out = length(prompt), args.sharegpt_output_len or length(answer)
        if n_in >= 4 and n_out >= 4 and n_in <= 1024 and n_in + n_out <= 2048:
            prompts.append((prompt, n_out))
    if len(prompts) == count:
        return prompts
    raise BenchmarkError(f"--dataset-path {args.dataset_path!r} holds {len(prompts)} usable ShareGPT conversations "
                         f"(a human turn then an answer, 4..1024 tokens), fewer than the {count} asked for")


async def send_one(client: Any, args: argparse.Namespace, prompt: Any, max_tokens: int,
                   tokenizer: Any = None) -> RequestResult:
    chat = is_chat(args)
    body: dict[str, Any] = {
        "model": args.served_model_name or args.model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
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
                    res.text += (choice.get("text") if not chat else (choice.get("delta") or {}).get("content")) or ""
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
        res.latency = last - start  # at the last output chunk (the usage chunk and [DONE] are not output)
        if not chunks and res.output_tokens:  # tokens with no visible text: seen at the end
            res.ttft = res.latency = time.perf_counter() - start
        if not res.output_tokens:  # (no usage chunk: a chunk may carry several tokens)
            res.output_tokens, res.prompt_tokens = _counted(tokenizer, prompt, res.text, chunks)
        _judge(res, ended)
    except Exception as e:  # noqa: BLE001 - one failed request must not stop the run
        res.error = f"{type(e).__name__}: {e}"
    return res


def _judge(res: RequestResult, ended: bool) -> None:
    """ok: the stream ended ([DONE] or a finish_reason) with output; else why not."""
    res.ok = ended and res.output_tokens > 0
    if not ended:
        res.error = "the stream ended before [DONE] or a finish_reason"
    elif not res.ok:
        res.error = "no output streamed"


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
                listed = await client.get(args.base_url + "/v1/models")
                if listed.status_code != 200:
                    raise BenchmarkError(f"HTTP {listed.status_code} from {args.base_url}/v1/models (--base-url is "
                                         "the server's root, without /v1); name the model with --model")
                args.model = listed.json()["data"][0]["id"]
            except BenchmarkError:
                raise
            except Exception as e:  # noqa: BLE001 - unreachable, or not an OpenAI server: one line
                raise BenchmarkError(f"cannot read the model's name from {args.base_url}/v1/models "
                                     f"({type(e).__name__}: {e}); name it with --model") from None
        tokenizer = load_tokenizer(args)
        prompts = make_prompts(args, rng, tokenizer=tokenizer)
        warmups = make_prompts(args, random.Random(f"warm-up {args.seed}"), args.num_warmups, False, tokenizer)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def limited(prompt: Any, out_len: int) -> RequestResult:
            if sem is None:
                return await send_one(client, args, prompt, out_len, tokenizer)
            async with sem:
                return await send_one(client, args, prompt, out_len, tokenizer)

        if warmups:
            failed = [r.error for r in await asyncio.gather(*(limited(p, 4) for p, _ in warmups)) if not r.ok]
            if len(failed) == len(warmups):
                raise BenchmarkError(f"every warm-up request failed: {failed[0]}")
        tasks = []
        start = time.perf_counter()
        for prompt, out_len in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt, out_len)))
            if args.request_rate != float("inf"):  # (burstiness 1: Poisson; lower: burstier, same mean rate)
                await asyncio.sleep(rng.gammavariate(args.burstiness, 1 / (args.request_rate * args.burstiness)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, results, duration)


class BenchmarkError(Exception):
    """A run that measured nothing (the server unreachable, every request failed)."""


def load_tokenizer(args: argparse.Namespace) -> Any:
    """The tokenizer prompts are counted with: --tokenizer (a registered name, a directory or
    a GGUF file, as the server reads them: a failure is an error), else --model's where this
    machine has it (nothing is downloaded for it), else none (prompts of random words; a
    note says so)."""
    from pagedserve.config import ModelConfig
    from pagedserve.model_loader import load_tokenizer as load
    from pagedserve.model_loader.sources import local_model

    name = args.tokenizer or (local_model(str(args.model)) if args.model else None)
    tokenizer = None
    try:
        tokenizer = load(ModelConfig(model=name, trust_remote_code=args.trust_remote_code)) if name else None
    except Exception as e:  # noqa: BLE001 - a bad name or file: one line
        if args.tokenizer:
            raise BenchmarkError(f"--tokenizer {args.tokenizer!r}: {type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}") from None
    if tokenizer is None:
        print(f"note: no tokenizer of {args.model!r} on this machine (--tokenizer names one): "
              + ("lengths are counted in words" if args.dataset_name == "sharegpt" else "prompts are random words"))
    return tokenizer


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


def _counted(tokenizer: Any, prompt: Any, text: str, chunks: int) -> tuple[int, int]:
    """(output tokens, prompt tokens) of an answer the server sent no usage for: from the
    tokenizer where there is one (a prompt of ids by its length), else the chunks and 0."""
    encode = None if tokenizer is None else functools.partial(tokenizer.encode, add_special_tokens=False)
    output = len(encode(text)) if encode is not None and text else chunks
    return output, len(prompt) if isinstance(prompt, list) else len(encode(prompt)) if encode is not None else 0


def _tpot(r: RequestResult) -> float | None:
    """Time per output token after the first (vLLM's TPOT); None for a one-token answer."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def summarize(args: argparse.Namespace, results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The run's figures, with vLLM's keys (its saved JSON's): totals, rates, each metric's
    mean, median and percentiles in ms, and the per-request lists."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    pcts = args.metric_percentiles
    summary: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model_id": args.model,
        "tokenizer_id": args.tokenizer or args.model, "num_prompts": len(results),
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "max_concurrency": args.max_concurrency, "burstiness": args.burstiness,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",  # (JSON has no inf)
    }
    if args.goodput:
        good = [r for r in ok if all((_tpot(r) or 0.0) * 1000 <= ms if key == "tpot" else
                                     (r.ttft if key == "ttft" else r.latency) * 1000 <= ms
                                     for key, ms in args.goodput.items())]
        summary["request_goodput"] = len(good) / duration
    summary.update(_stats("ttft", [r.ttft for r in ok], pcts))
    summary.update(_stats("tpot", [t for r in ok if (t := _tpot(r)) is not None], pcts))
    summary.update(_stats("itl", [x for r in ok for x in r.itl], pcts))
    summary.update(_stats("e2el", [r.latency for r in ok], pcts))
    summary.update({"input_lens": [r.prompt_tokens for r in results], "output_lens": [r.output_tokens for r in results],
                    "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
                    "generated_texts": [r.text for r in results], "errors": [r.error for r in results]})
    return summary


def format_summary(s: dict[str, Any], pcts: list[float],
                   metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")) -> str:
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Maximum request concurrency:", s["max_concurrency"] or "unlimited"),
            ("Request rate (req/s):", s["request_rate"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]), ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    if "request_goodput" in s:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10}" for k, v in rows]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        if key not in metrics:
            continue
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        name = key.upper()
        for label, field_name in ((f"Mean {name} (ms):", f"mean_{key}_ms"), (f"Median {name} (ms):", f"median_{key}_ms"),
                                  *((f"P{p:g} {name} (ms):", f"p{p:g}_{key}_ms") for p in pcts)):
            value = s[field_name]
            lines.append(f"{label:<40}{'n/a' if value is None else f'{value:.2f}':<10}")
    lines.append("=" * 50)
    if errors := sorted({e for e in s["errors"] if e})[:5]:
        lines.append("errors: " + "; ".join(errors))
    return "\n".join(lines)


# vLLM's --backend values this benchmark speaks, and the endpoint each implies.
BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}
METRICS = ("ttft", "tpot", "itl", "e2el")


def parse_goodput(text: str) -> dict[str, float]:
    """--goodput's KEY:MS pairs (vLLM's: ttft, tpot, e2el service-level objectives)."""
    try:
        pairs = dict((k, float(v)) for k, v in (item.split(":") for item in text.split()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not KEY:MS pairs (e.g. ttft:500 tpot:50): {text!r}") from None
    if not pairs or set(pairs) - {"ttft", "tpot", "e2el"} or not all(v > 0 for v in pairs.values()):
        raise argparse.ArgumentTypeError(f"goodput takes ttft, tpot and e2el with ms > 0, got {text!r}")
    return pairs


def add_cli_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default=None, help="server root (default: http://HOST:PORT)")
    p.add_argument("--host", default=None, help="without --base-url (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="without --base-url (default: 8000)")
    p.add_argument("--backend", default=None, choices=sorted(BACKENDS),
                   help="vLLM's: openai and vllm send /v1/completions, openai-chat /v1/chat/completions")
    p.add_argument("--endpoint", default=None, choices=sorted(set(BACKENDS.values())),
                   help="default: the backend's, else /v1/completions")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--served-model-name", default=None, help="the name requests carry, when not --model's")
    p.add_argument("--trust-remote-code", action="store_true", help="for loading --tokenizer")
    p.add_argument("--disable-tqdm", action="store_true", help="vLLM's (there is no progress bar here)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in req/s (default: inf = send all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="with a request rate: arrival gaps are Gamma-distributed with this shape (1: Poisson, "
                        "lower: burstier), the mean rate kept")
    p.add_argument("--dataset-name", default="random", choices=["random", "shared-prefix", "sharegpt"])
    p.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT JSON file")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: max_tokens of every request (default: each answer's own length)")
    p.add_argument("--random-prefix-len", type=int, default=0, help="one random prefix of this many tokens "
                                                                    "leads every prompt (vLLM's)")
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
    p.add_argument("--percentile-metrics", default=",".join(METRICS),
                   help=f"the metrics printed, comma-separated of {', '.join(METRICS)} (default: all)")
    p.add_argument("--goodput", type=parse_goodput, nargs="+", default=None, metavar="KEY:MS",
                   help="request goodput: completed requests within every objective, e.g. ttft:500 tpot:50")
    p.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE",
                   help="write the summary as JSON: to FILE, or alone as vLLM's flag (--result-dir, "
                        "--result-filename)")
    p.add_argument("--result-dir", default=None, help="with --save-result: the directory (default: .)")
    p.add_argument("--result-filename", default=None,
                   help="with --save-result: the name (default: BACKEND-RATEqps-MODEL-DATE.json)")
    return p


def result_path(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    """Where --save-result writes: its FILE, or vLLM's name in --result-dir."""
    if isinstance(args.save_result, str):
        return args.save_result
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    name = args.result_filename or (f"{args.backend or 'openai'}-{summary['request_rate']}qps{concurrency}-"
                                    f"{os.path.basename(str(args.model))}-{summary['date']}.json")
    return os.path.join(args.result_dir or ".", name)


def main(args: argparse.Namespace | list[str] | None = None) -> dict[str, Any]:
    """Run from parsed args, or parse an argv list (how `pagedserve bench serve` calls it)."""
    if not isinstance(args, argparse.Namespace):
        args = add_cli_args(argparse.ArgumentParser(prog="pagedserve bench serve", description=__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter,
                                                    allow_abbrev=False)).parse_args(args)
    check_args(args)
    try:
        summary = asyncio.run(run_benchmark(args))
    except BenchmarkError as e:
        raise SystemExit(f"error: {e}") from None
    if not summary["completed"]:  # (a table of n/a says nothing the error does not)
        raise SystemExit(f"error: every request failed: {next((e for e in summary['errors'] if e), 'no output')}")
    print(format_summary(summary, args.metric_percentiles, tuple(args.percentile_metrics.split(","))))
    if args.save_result:
        with open(result_path(args, summary), "w") as f:
            json.dump({**summary, "args": {k: v if v != float("inf") else "inf" for k, v in vars(args).items()
                                           if not callable(v)}}, f, indent=2)
    return summary


def _check_result_flags(args: argparse.Namespace) -> None:
    """Where --save-result writes, checked before any request (found only after the run,
    the figures were lost; a directory was a traceback)."""
    if (args.result_dir or args.result_filename) and args.save_result is not True:
        raise SystemExit("error: --result-dir and --result-filename name where --save-result (alone) writes")
    if args.result_dir and not os.path.isdir(args.result_dir):
        raise SystemExit(f"error: --result-dir {args.result_dir!r} is not a directory")
    named = None
    if isinstance(args.save_result, str):
        named = (args.save_result, "--save-result")
    elif args.result_filename:
        named = (os.path.join(args.result_dir or ".", args.result_filename), "--result-filename")
    if named is not None:
        try:
            check_output_file(*named)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None


def check_args(args: argparse.Namespace) -> None:
    """Each flag's range, before any request: SystemExit naming the flag."""
    if isinstance(args.goodput, list):  # (vLLM's spelling: one KEY:MS per word)
        args.goodput = {key: ms for pairs in args.goodput for key, ms in pairs.items()}
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
    if not args.burstiness > 0:
        raise SystemExit("error: --burstiness must be > 0")
    if args.random_prefix_len < 0:
        raise SystemExit("error: --random-prefix-len must be >= 0")
    _check_result_flags(args)
    if (args.dataset_name == "sharegpt") != (args.dataset_path is not None):
        raise SystemExit("error: --dataset-name sharegpt and --dataset-path go together")
    if unknown := set(args.percentile_metrics.split(",")) - set(METRICS):
        raise SystemExit(f"error: --percentile-metrics takes {', '.join(METRICS)}, got {', '.join(sorted(unknown))}")
    if args.base_url is not None and (args.host is not None or args.port is not None):
        raise SystemExit("error: --base-url, or --host and --port: not both")
    implied = BACKENDS.get(args.backend or "")
    if implied and args.endpoint and args.endpoint != implied:
        raise SystemExit(f"error: --backend {args.backend} sends {implied}, not --endpoint {args.endpoint}")
    args.endpoint = endpoint_of(args)
    args.base_url = (args.base_url or f"http://{args.host or '127.0.0.1'}:{args.port or 8000}").rstrip("/")


def add_bench_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` under the CLI's `bench` subcommands."""
    p = subparsers.add_parser("serve", help="online load test of an OpenAI-compatible server",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    p.set_defaults(func=main)
    return p


if __name__ == "__main__":
    main()

