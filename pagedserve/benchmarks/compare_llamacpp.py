"""pagedserve against llama.cpp's `llama-server` on the same GGUF files, on this CPU.

    python -m pagedserve.benchmarks.compare_llamacpp            # 1.7B-shape Q4_0 and Q8_0, and the default model
    python -m pagedserve.benchmarks.compare_llamacpp --files Q4_0 default
    python -m pagedserve.benchmarks.compare_llamacpp --files gemma3     # the second shipped model
    python -m pagedserve.benchmarks.compare_llamacpp --latency --max-step-ms 100    # the latency load

For each file both servers are started one after the other with the same threads, the
same 32 slots of `--ctx-per-slot` tokens of KV cache, and are driven by the same HTTP
client through their OpenAI-compatible /v1/completions endpoint, taking turns sample by
sample (only one works at a time; the same prompts go to both):
  * single-stream decode: one request at a time, 128 new tokens (EOS ignored), tokens per
    second between the first and the last streamed token (median of 5 turns each);
  * batch throughput: 8 and 32 requests in flight, new tokens per second (median of 2);
  * TTFT of a 512-token prompt (max_tokens 1, fresh random tokens each time so no prefix
    cache helps; median of 3);
  * resident memory (the process tree's VmRSS) of a separate start with one slot of
    1024 tokens after one request, against the file's size, and after the run above.
The 1.7B-shape files have random weights in SmolLM2-1.7B's shape (random_gguf.py); the
text they produce is noise, the work per token is the real model's.  Set
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 machine to stand in for an
AVX2-only CPU: pagedserve then runs its AVX2 kernels in float32 and llama.cpp is built
for AVX2 as well.  A benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedserve.benchmarks.harness import LocalServer, PagedServe, process_rss
from pagedserve.benchmarks.llamacpp import LlamaServer, ensure_llama_server
from pagedserve.benchmarks.random_gguf import SMOLLM2_1_7B, ensure_random_gguf
from pagedserve.config import DTYPE_ALIASES, QUANT_ACTIVATION_BITS
from pagedserve.cpu_info import describe_cpu

NEW_TOKENS = 128
SLOTS = 32
TTFT_PROMPT = 512


@dataclass
class Figures:
    side: str
    load_s: float = 0.0
    decode_tok_s: float = 0.0
    batch_tok_s: dict[int, float] = field(default_factory=dict)
    ttft_s: float = 0.0
    rss_load: int = 0
    rss_end: int = 0
    kv_bytes: int = 0
    drafts: tuple[int, int] | None = None  # (drafted, accepted) tokens over the run: speculation


SPEC_COUNTERS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def spec_counts(url: str) -> tuple[int, int] | None:
    """(drafted, accepted) tokens from a pagedserve server's /metrics, or None where the
    server reports none (llama-server; pagedserve without speculation)."""
    try:
        return parse_spec_counts(httpx.get(url + "/metrics", timeout=30).text)
    except httpx.HTTPError:
        return None


def parse_spec_counts(text: str) -> tuple[int, int] | None:
    """SPEC_COUNTERS' values in Prometheus text (summed over labels), or None when no
    token was drafted."""
    values = dict.fromkeys(SPEC_COUNTERS, 0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        name = name.split("{")[0].removesuffix("_total")
        if name in values:
            values[name] += int(float(value.split()[0]))
    drafted, accepted = (values[c] for c in SPEC_COUNTERS)
    return (drafted, accepted) if drafted else None


def server_rss(server: LocalServer) -> int:
    """The server's resident bytes: its process and its workers (pagedserve's tensor-parallel
    ranks), not a passing compiler."""
    sample = process_rss(server.proc.pid)
    return sample.total if sample else 0


async def completion(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                     max_tokens: int) -> tuple[float, float, float]:
    """(start, first token, last token) times of one streamed completion of exactly
    `max_tokens` tokens: a stream that ends otherwise (an error event, a finish_reason
    other than "length", no text) raises, since the figures assume the tokens were made."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = last = 0.0
    finish = None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: the stream failed: {str(chunk['error'])[:300]}")
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
                if choice.get("text"):
                    last = time.perf_counter()
                    first = first or last
    if finish != "length" or not first:
        raise RuntimeError(f"{url}: a completion of {max_tokens} tokens (EOS ignored) ended with finish_reason "
                           f"{finish!r}{'' if first else ' and no text'}: its figures would be wrong")
    return start, first, last


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


ROUNDS = {"single": 5, "batch": 2, "ttft": 3}


async def sample(http: httpx.AsyncClient, url: str, model: str, phase: str, rng: random.Random) -> float:
    """One measurement of `phase` against one server: "single" (decode tok/s of one
    request), "batch-N" (tok/s of N requests in flight) or "ttft" (seconds)."""
    if phase == "single":
        _, first, last = await completion(http, url, model, random_prompt(rng, 16), NEW_TOKENS)
        if last <= first:  # (every token in one chunk: no decode time to divide by)
            raise RuntimeError(f"{url}: {NEW_TOKENS} tokens came in one chunk; single-stream decode is not measurable")
        return (NEW_TOKENS - 1) / (last - first)
    if phase.startswith("batch-"):
        n = int(phase.removeprefix("batch-"))
        t0 = time.perf_counter()
        await asyncio.gather(*(completion(http, url, model, random_prompt(rng, 16), NEW_TOKENS) for _ in range(n)))
        return n * NEW_TOKENS / (time.perf_counter() - t0)
    start, first, _ = await completion(http, url, model, random_prompt(rng, TTFT_PROMPT), 1)
    return first - start


async def run_phases(servers: list[tuple[Figures, LocalServer]], batches: list[int]) -> None:
    """Every phase, the servers taking turns sample by sample (the median of each side's
    samples is its figure).  Both are loaded and only one works at a time: this
    machine's memory bandwidth drifts by a third over minutes, and alternating puts
    both sides in the same moments instead of one side in a good one."""
    rngs = [random.Random(0) for _ in servers]  # the same prompts for every side
    async with new_client() as http:
        models = [(await http.get(s.url + "/v1/models")).json()["data"][0]["id"] for _, s in servers]
        for (_, s), model, rng in zip(servers, models, rngs, strict=True):
            await completion(http, s.url, model, random_prompt(rng, 16), 8)  # warm-up
        for phase in ["single", *(f"batch-{n}" for n in batches), "ttft"]:
            samples: list[list[float]] = [[] for _ in servers]
            for _ in range(ROUNDS[phase.split("-")[0]]):
                for i, ((_, s), model, rng) in enumerate(zip(servers, models, rngs, strict=True)):
                    samples[i].append(await sample(http, s.url, model, phase, rng))
            for (fig, _), values in zip(servers, samples, strict=True):
                value = statistics.median(values)
                if phase == "single":
                    fig.decode_tok_s = value
                elif phase == "ttft":
                    fig.ttft_s = value
                else:
                    fig.batch_tok_s[int(phase.removeprefix("batch-"))] = value


def measure(sides: list[tuple[Figures, Callable[[], LocalServer]]], batches: list[int]) -> None:
    """Start every side's server (one after the other, each timed alone), then run the
    phases with the servers taking turns."""
    servers: list[tuple[Figures, LocalServer]] = []
    try:
        for fig, start in sides:
            t0 = time.perf_counter()
            servers.append((fig, start()))
            fig.load_s = time.perf_counter() - t0
        asyncio.run(run_phases(servers, batches))
        for fig, server in servers:
            fig.rss_end = server_rss(server)
            fig.drafts = spec_counts(server.url)
    finally:
        for _, server in servers:
            server.stop()


def threads_env(threads: int) -> dict[str, str]:
    """pagedserve's environment (this one's) for `threads` threads (torch's and the kernels'
    OpenMP pools), the count llama-server gets as -t and -tb."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def new_client() -> httpx.AsyncClient:
    """A connection per request: llama-server closes a streamed response's connection
    after a while, and a pooled connection reused at that moment fails the next request."""
    return httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=httpx.Limits(max_keepalive_connections=0))


def kv_bytes_per_token(gguf_path: str, dtype_bytes: int, row_bytes: Callable[[int], int] | None = None) -> int:
    """K and V bytes of one token: `dtype_bytes` per value, or `row_bytes(head_dim)` per head's row."""
    from pagedserve.model_loader.gguf_utils import gguf_to_hf_config, open_gguf

    c = gguf_to_hf_config(open_gguf(gguf_path), gguf_path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    row = row_bytes(head_dim) if row_bytes is not None else head_dim * dtype_bytes
    return 2 * c.num_hidden_layers * c.num_key_value_heads * row


# --kv-cache-dtype int8 against llama.cpp's q8_0 KV (-ctk/-ctv q8_0): a row's bytes on each side
# (pagedserve: the values and a float16 scale; q8_0: 34 bytes per 32 values).
INT8_ROW_BYTES = {"pagedserve": lambda d: d + 2, "llama-server": lambda d: d // 32 * 34}


@contextmanager
def running(start: Callable[[], LocalServer]) -> Iterator[LocalServer]:
    server = start()
    try:
        yield server
    finally:
        server.stop()


def read_bandwidth(threads: int) -> float:
    """Bytes per second `threads` threads read from memory here: torch's sum over 1 GiB
    of float32 (8x this machine's caches), best of 5.  What a single stream's decode is
    measured against: each token reads every weight once."""
    import torch

    x = torch.ones(2**28)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x.sum()
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return x.numel() * 4 / best


def run_file(name: str, gguf_path: str, model_arg: str, args: argparse.Namespace, logdir: str) -> list[Figures]:
    from pagedserve.cpu_info import bf16_support

    ctx = args.ctx_per_slot
    batches = [b for b in (8, 32) if b <= SLOTS]
    # llama.cpp keeps its KV cache in f16; pagedserve in the model dtype (bf16, or fp32 without bf16);
    # with --kv-cache-dtype int8, pagedserve int8 rows and llama.cpp q8_0.
    ps_dtype_bytes = pagedserve_dtype_bytes(args.pagedserve_args, bf16_support().native)
    int8 = args.kv_cache_dtype == "int8"
    kv_tokens = SLOTS * ctx
    ps_row = INT8_ROW_BYTES["pagedserve"] if int8 else None
    ps_kv = kv_tokens * kv_bytes_per_token(gguf_path, ps_dtype_bytes, ps_row)
    small_kv = (ctx + 32) * kv_bytes_per_token(gguf_path, ps_dtype_bytes, ps_row)  # (+ the null block, rounding)
    llama_kv = ["-ctk", "q8_0", "-ctv", "q8_0"] if int8 else []
    sides = []  # (name, start for the run, start for the memory figure, KV bytes)
    binary = None if args.skip_llamacpp else ensure_llama_server()
    if binary is not None:
        sides.append(("llama-server",
                      lambda: LlamaServer(binary, gguf_path, threads=args.threads, parallel=SLOTS, ctx_per_slot=ctx,
                                          log_path=f"{logdir}/{name}-llama.log", extra_args=llama_kv),
                      lambda: LlamaServer(binary, gguf_path, threads=args.threads, parallel=1, ctx_per_slot=ctx,
                                          log_path=f"{logdir}/{name}-llama-mem.log", extra_args=llama_kv),
                      kv_tokens * kv_bytes_per_token(gguf_path, 2, INT8_ROW_BYTES["llama-server"] if int8 else None)))
    for bits in args.quant_activation_bits:  # one pagedserve side per activation width
        side = "pagedserve" if bits == QUANT_ACTIVATION_BITS[0] else f"pagedserve, {bits}-bit activations"
        extra = ["--quant-activation-bits", str(bits), "--kv-cache-dtype", args.kv_cache_dtype, *args.pagedserve_args]
        sides.append((side,
                      lambda extra=extra, tag=bits: PagedServe(
                          [model_arg, "--max-num-seqs", str(SLOTS), "--max-model-len", str(ctx),
                           "--kv-cache-memory-bytes", str(ps_kv), *extra],
                          f"{logdir}/{name}-pagedserve-{tag}.log", env=threads_env(args.threads)),
                      # memory on its own start: one slot of --ctx-per-slot tokens (KV at most ~0.2 GB at the
                      # 1.7B shape), after one short request, so the figure is weights + runtime, not KV
                      lambda extra=extra, tag=bits: PagedServe(
                          [model_arg, "--max-num-seqs", "1", "--max-model-len", str(ctx),
                           "--kv-cache-memory-bytes", str(small_kv), *extra],
                          f"{logdir}/{name}-pagedserve-{tag}-mem.log", env=threads_env(args.threads)),
                      ps_kv))
    check_memory(gguf_path, ctx, [kv for *_, kv in sides])
    out = [Figures(side, kv_bytes=kv) for side, *_, kv in sides]
    measure([(fig, start) for fig, (_, start, _, _) in zip(out, sides, strict=True)], batches)
    for fig, (_, _, start_small, _) in zip(out, sides, strict=True):
        with running(start_small) as server:
            asyncio.run(one_request(server.url))
            fig.rss_load = server_rss(server)
        print(f"  {fig.side}: {fig}", flush=True)
    return out


# Both servers stay loaded while they take turns, and a long run touches every KV block
# of each.  Their KV caches and weights may take this share of available memory; the rest
# is for the runtimes (llama-server's compute buffers at 32 slots measured 3.4 GB at the
# 1.7B shape, pagedserve's torch ~1.3 GB).  Past it the kernel's OOM killer ends one side
# mid-run (it did: 12 + 6 GiB of float32 and f16 KV cache on a 24 GB Zen 3 machine).
MEMORY_SHARE = 0.7


def check_memory(gguf_path: str, ctx: int, kv_bytes: list[int]) -> None:
    """Refuse, naming the --ctx-per-slot that would fit, before starting anything."""
    import torch

    from pagedserve.platforms import available_memory_bytes

    avail = available_memory_bytes(torch.device("cpu"))
    weights = len(kv_bytes) * os.path.getsize(gguf_path)
    need = sum(kv_bytes) + weights
    if need <= MEMORY_SHARE * avail:
        return
    per_token = sum(kv_bytes) / ctx
    fits = int((MEMORY_SHARE * avail - weights) / per_token) // 128 * 128
    hint = (f"pass --ctx-per-slot {fits} (at least {TTFT_PROMPT + 1} for the TTFT prompt)" if fits > TTFT_PROMPT
            else "this machine cannot hold both sides for this file")
    raise SystemExit(f"compare_llamacpp: {os.path.basename(gguf_path)} at --ctx-per-slot {ctx}: the two servers' KV "
                     f"caches ({' + '.join(f'{b / 2**30:.1f}' for b in kv_bytes)} GiB) and weights "
                     f"({weights / 2**30:.1f} GiB) exceed {MEMORY_SHARE:.0%} of the {avail / 2**30:.1f} GiB available "
                     f"(the rest is for their runtimes); {hint}")


async def one_request(url: str) -> None:
    async with new_client() as http:
        model = (await http.get(url + "/v1/models")).json()["data"][0]["id"]
        await completion(http, url, model, random_prompt(random.Random(1), 16), 8)


def report(name: str, gguf_path: str, figs: list[Figures], bandwidth: float, ctx: int) -> str:
    """The file's table, and the single-stream ceiling: the weights (the file's bytes, as
    both sides keep them) read once per token at the bandwidth measured just before."""
    size = os.path.getsize(gguf_path)
    # a ratio column for every side against llama-server, when it ran
    ratios = [f.side for f in figs[1:]] if figs[0].side == "llama-server" else []
    lines = [f"### {name}: {os.path.basename(gguf_path)} ({size / 2**20:.0f} MiB)", "",
             "| | " + " | ".join([f.side for f in figs] + [f"{r} / llama-server" for r in ratios]) + " |",
             "|---" * (len(figs) + 1 + len(ratios)) + "|"]

    def row(label: str, values: list[float], fmt: str) -> None:
        cells = [format(v, fmt) for v in values]
        cells += [f"{v / values[0]:.2f}x" if values[0] > 0 else "-" for v in values[1:len(ratios) + 1]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("single-stream decode, tok/s", [f.decode_tok_s for f in figs], ".1f")
    for n in figs[0].batch_tok_s:
        row(f"{n} in flight, tok/s", [f.batch_tok_s.get(n, 0.0) for f in figs], ".1f")
    row(f"TTFT, {TTFT_PROMPT}-token prompt, s", [f.ttft_s for f in figs], ".3f")
    row("start-up to ready, s", [f.load_s for f in figs], ".1f")
    row(f"RSS, 1 slot of {ctx} tokens, after a request, MiB", [f.rss_load / 2**20 for f in figs], ".0f")
    row("  the same / file size", [f.rss_load / size for f in figs], ".2f")
    row(f"RSS after the run above ({SLOTS} slots), MiB", [f.rss_end / 2**20 for f in figs], ".0f")
    row(f"  KV cache given for {SLOTS} slots, MiB", [f.kv_bytes / 2**20 for f in figs], ".0f")
    lines += ["", f"Memory read bandwidth just before ({2**30 // 2**20} MiB summed): {bandwidth / 1e9:.1f} GB/s, so one "
              f"stream, reading the file's {size / 1e6:.0f} MB of weights per token, is bound at "
              f"{bandwidth / size:.1f} tok/s; single-stream decode reached "
              + ", ".join(f"{f.decode_tok_s * size / bandwidth:.0%} of that ({f.side})" for f in figs) + "."]
    lines += [f"{f.side} drafted {f.drafts[0]} tokens over the run and accepted {f.drafts[1]} "
              f"({f.drafts[1] / f.drafts[0]:.0%}): n-gram speculation, on by default on CPU (`--pagedserve-args "
              "--speculative-config off` measures without it)." for f in figs if f.drafts]
    return "\n".join(lines)


# (the shipped models' own files, by `--files` name: the default one and the second one)
SHIPPED = {"default": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
FILES = ("Q4_0", "Q8_0", *SHIPPED)
LATENCY_LOAD = ["--num-prompts", "64", "--max-concurrency", "16", "--random-input-len", "128",
                "--random-output-len", "64"]


def run_latency(args: argparse.Namespace, logdir: str) -> str:
    """The guidellm-shaped load (16 in flight, 128 tokens in, 64 out, 64 requests: the
    `pagedserve bench serve` client) against llama-server and pagedserve on the default
    model, back to back; pagedserve once with its defaults and once per --max-step-ms
    value.  Each side also runs the same load with 4-token prompts first: its ITL there
    is its decode-only step, what the ITL under prompts is compared with."""
    from pagedserve.benchmarks import serve as bench_serve
    from pagedserve.model_loader.sources import resolve_gguf_path, resolve_source

    path = resolve_gguf_path("smollm2-135m-instruct")
    tokenizer = resolve_source("smollm2-135m-instruct").path  # the converted directory's tokenizer
    sides: list[tuple[str, Any]] = []
    if not args.skip_llamacpp:
        binary = ensure_llama_server()
        sides.append(("llama-server (16 slots)", lambda: LlamaServer(
            binary, path, threads=args.threads, parallel=16, ctx_per_slot=512, log_path=f"{logdir}/latency-llama.log")))
    for ms in [None, *args.max_step_ms]:
        extra = [] if ms is None else ["--max-step-ms", str(ms)]
        name = "pagedserve" + ("" if ms is None else f" --max-step-ms {ms:g}")
        sides.append((name, lambda extra=extra: PagedServe(
            ["smollm2-135m-instruct", "--max-model-len", "512", *extra, *args.pagedserve_args],
            f"{logdir}/latency-pagedserve{'-'.join(extra)}.log", env=threads_env(args.threads))))
    lines = ["### guidellm-shaped load, default model: 16 in flight, 128 in / 64 out, 64 requests", "",
             "| | TTFT median, ms | ITL median, ms | decode-only ITL median, ms | ITL / decode-only | output tok/s |",
             "|---|---|---|---|---|---|"]
    for name, start in sides:
        with running(start) as server:
            common = ["--base-url", server.url, "--tokenizer", tokenizer, "--seed", "1"]
            decode_only = bench_serve.main([*common, *LATENCY_LOAD[:4], "--random-input-len", "4",
                                            "--random-output-len", "64"])
            loaded = bench_serve.main([*common, *LATENCY_LOAD])
        if decode_only["failed"] or loaded["failed"]:  # (a ratio of what did not all run would mislead)
            raise RuntimeError(f"{name}: requests failed: {(decode_only['errors'] + loaded['errors'])[:2]}")
        base = decode_only["median_itl_ms"]
        lines.append(f"| {name} | {loaded['median_ttft_ms']:.0f} | {loaded['median_itl_ms']:.1f} | {base:.1f} | "
                     f"{loaded['median_itl_ms'] / base:.2f}x | {loaded['output_throughput']:.1f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


# What the comparison sets on each side itself (slots, context, KV bytes): given again in
# --pagedserve-args they would make the two sides unequal behind a table that says equal.
SIZED_HERE = ("--max-num-seqs", "--max-model-len", "--kv-cache-memory-bytes", "--kv-cache-dtype")


def pagedserve_dtype_bytes(pagedserve_args: list[str], native_bf16: bool) -> int:
    """Bytes per KV value of the pagedserve side: its --dtype in --pagedserve-args (the
    KV cache is in the model's dtype), else the CPU's default (bf16 where native).  The KV
    budget was always the default's: float32 got half the slots' tokens."""
    given = None
    for i, arg in enumerate(pagedserve_args):
        if arg == "--dtype" and i + 1 < len(pagedserve_args):
            given = pagedserve_args[i + 1]
        elif arg.startswith("--dtype="):
            given = arg.partition("=")[2]
    if given in (None, "auto"):
        return 2 if native_bf16 else 4
    return 4 if DTYPE_ALIASES.get(given, given) == "float32" else 2


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each flag's range, and the flags one mode ignores, before anything starts."""
    import torch

    sized = [a for a in args.pagedserve_args if a.split("=")[0] in SIZED_HERE]
    if sized:
        p.error(f"--pagedserve-args {sized[0].split('=')[0]}: the comparison sizes both sides itself "
                "(its own --ctx-per-slot and --kv-cache-dtype set these)")

    args.threads = torch.get_num_threads() if args.threads is None else args.threads
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.latency:
        ignored = [f"--{k.replace('_', '-')}" for k in ("files", "ctx_per_slot", "quant_activation_bits",
                                                         "kv_cache_dtype") if getattr(args, k) != p.get_default(k)]
        if ignored:
            p.error(f"--latency runs its own load on the default model: {', '.join(ignored)} would be ignored")
    elif args.max_step_ms:
        p.error("--max-step-ms sets the --latency load's pagedserve sides: add --latency")
    if args.ctx_per_slot <= TTFT_PROMPT:
        p.error(f"--ctx-per-slot must be over {TTFT_PROMPT} (the TTFT prompt's tokens and one more)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", nargs="+", choices=FILES, default=list(FILES),
                   help="Q4_0 / Q8_0: random weights in SmolLM2-1.7B's shape; default: the default model's Q4_1 "
                        "file; gemma3: Gemma 3 270M's Q4_K_M file")
    p.add_argument("--threads", type=int, default=None,
                   help="threads of both servers (llama-server's -t and -tb, pagedserve's OMP_NUM_THREADS; "
                        "default: torch's, one per physical core)")
    p.add_argument("--ctx-per-slot", type=int, default=1024, help="KV-cache tokens per slot (32 slots)")
    p.add_argument("--skip-llamacpp", action="store_true", help="measure pagedserve only")
    p.add_argument("--latency", action="store_true",
                   help="run the guidellm-shaped latency load on the default model instead of the file table")
    p.add_argument("--max-step-ms", type=float, nargs="*", default=[],
                   help="with --latency: also run pagedserve with each of these step-time targets")
    p.add_argument("--quant-activation-bits", type=int, nargs="+", choices=QUANT_ACTIVATION_BITS,
                   default=[QUANT_ACTIVATION_BITS[0]],
                   help="a pagedserve side for each (e.g. 16 8: the default and llama.cpp's 8-bit scheme)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                   help="int8: pagedserve --kv-cache-dtype int8 against llama-server -ctk q8_0 -ctv q8_0 "
                        "(auto: pagedserve's model dtype against llama.cpp's f16)")
    p.add_argument("--pagedserve-args", nargs=argparse.REMAINDER, default=[],
                   help="extra `pagedserve serve` flags (last on the command line)")
    args = p.parse_args(argv)
    check_args(p, args)
    print(f"CPU: {describe_cpu()}; ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')}",
          flush=True)
    if not args.skip_llamacpp:
        try:
            ensure_llama_server()
        except RuntimeError as e:
            print(f"llama-server cannot be built here ({e}); measuring pagedserve only", flush=True)
            args.skip_llamacpp = True
    from pagedserve.model_loader.sources import resolve_gguf_path

    reports = []
    logdir = tempfile.mkdtemp(prefix="compare-llamacpp-")
    print(f"server logs: {logdir}", flush=True)
    if args.latency:
        print()
        print(run_latency(args, logdir))
        return
    for name in args.files:
        if name in SHIPPED:
            path, model_arg = resolve_gguf_path(SHIPPED[name]), SHIPPED[name]
        else:
            path = model_arg = ensure_random_gguf(name, SMOLLM2_1_7B)
        print(f"{name}: {path}", flush=True)
        bandwidth = read_bandwidth(args.threads)
        print(f"  memory read bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
        reports.append(report(name if name in SHIPPED else f"{SMOLLM2_1_7B.name} {name}", path,
                              run_file(name, path, model_arg, args, logdir), bandwidth, args.ctx_per_slot))
    print()
    print("\n\n".join(reports))


if __name__ == "__main__":
    main()
