"""Data-parallel replicas on Ray behind one OpenAI endpoint (engine/data_parallel.py).

One local Ray, started here with 2 CPUs, serves every test in turn: 2 replicas of the
tiny Llama, one thread each.  Outputs are compared with one engine in this process."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import time

import httpx
import openai
import pytest
from conftest import API_KEY, MODEL_NAME, ServerProcess

from pagedserve.benchmarks.bench_router import run_workload, shared_prefix_workload
from pagedserve.benchmarks.harness import metric_samples
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams
from tests.lazy_module import LazyModule

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
ray = LazyModule("ray")

ENGINE_KW = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True, "seed": 0}
SERVER_FLAGS = ["--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--dtype", "float32", "--max-model-len",
                "256", "--enforce-eager", "--seed", "0", "--log-stats-interval", "2",
                "--data-parallel-size", "2", "--cpus-per-replica", "1"]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [f"{w} number {i}: the quick brown fox" for i in range(32) for w in ("hello",)][:32]


@pytest.fixture(scope="module")
def ray_address():
    ray.init(num_cpus=2, include_dashboard=False, namespace="pagedserve", object_store_memory=128 << 20)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    """The reference: one engine in this process, greedy."""
    llm = LLM(str(tiny_model_dir), kv_cache_memory_bytes="16MiB", **ENGINE_KW)
    yield llm
    llm.shutdown()


def dp_server(model_dir, ray_address: str, log_dir, *flags: str) -> ServerProcess:
    return ServerProcess([str(model_dir), *SERVER_FLAGS, "--ray-address", ray_address, *flags],
                         log_dir / f"dp-server-{time.monotonic_ns()}.log", timeout=240)


# Each replica's KV cache: 28 blocks of 16 tokens, small enough for the routing test's
# shared prefixes to compete for it (the other tests only need room for their requests,
# the killed-replica test's 64 a few at a time).
CACHE_FLAGS = ("--num-gpu-blocks-override", "28", "--max-num-seqs", "64")


@pytest.fixture(scope="module")
def server(tiny_model_dir, ray_address, tmp_path_factory):
    """The default policy (cache_aware)."""
    proc = dp_server(tiny_model_dir, ray_address, tmp_path_factory.mktemp("dp"), *CACHE_FLAGS)
    yield proc
    proc.stop()


def test_offline_llm_splits_a_batch_over_replicas(tiny_model_dir, ray_address, single):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(str(tiny_model_dir), data_parallel_size=2, cpus_per_replica=1, router_policy="round_robin",
              kv_cache_memory_bytes="16MiB", **ENGINE_KW)
    try:
        assert llm.llm_engine is None and llm.client.num_replicas == 2
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        # one engine's request ids, in input order across batches (each replica numbered its
        # own share: ids repeated), and the prefix cache reset in every replica (a no-op, False)
        again = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert [o.request_id for o in outs + again] == [str(i) for i in range(len(PROMPTS) + 3)]
        assert llm.reset_prefix_cache() is True
        chat = [{"role": "user", "content": "hello world"}]
        assert (llm.chat(chat, params, use_tqdm=False)[0].outputs[0].text
                == single.chat(chat, params, use_tqdm=False)[0].outputs[0].text)
    finally:
        llm.shutdown()


def test_a_replica_refusing_its_flags_is_a_clean_error(tiny_model_dir, ray_address, tmp_path):
    """A replica's constructor refusing a flag (a KV tier too small for one block) ended the
    server with "AttributeError: 'ActorDiedError' object has no attribute 'cause'" (Ray
    2.60 keeps only the text): the reason, named."""
    with pytest.raises(ValueError, match=r"an engine replica failed to start: the KV tier's size \(1000 bytes\)"):
        LLM(str(tiny_model_dir), data_parallel_size=2, cpus_per_replica=1, kv_cache_memory_bytes="16MiB",
            kv_offload_dir=str(tmp_path), kv_offload_bytes=1000, **ENGINE_KW)


def test_cache_aware_routing_keeps_shared_prefixes_cached(server) -> None:
    """4 system prompts of 160 tokens interleaved at random; each replica's KV cache holds
    28 blocks of 16, room for two of them: sent where its prefix is, a request finds it.
    All but the first few requests of each prefix follow it (affinity), and the prompts'
    cached share comes close to the prefixes' share.  (That this beats round robin, which
    thrashes each replica's cache with all four prefixes, is
    `python -m pagedserve.benchmarks.bench_router`'s figure: a second two-replica server
    here cost the suite a minute.)"""
    prompts = shared_prefix_workload(4, 160, 16, 32, vocab=(10, 200), seed=0)
    ca = run_workload(server.url, MODEL_NAME, prompts, max_tokens=4, headers=HEADERS)
    print(f"cache_aware: hit rate {ca.hit_rate:.2f}, affinity hits {ca.affinity_hits}/{len(prompts)}")
    assert sum(ca.requests.values()) == len(prompts)
    # vLLM's cache configuration series, as one engine's server has it (it was missing)
    metrics = httpx.get(f"{server.url}/metrics", headers=HEADERS).text
    assert 'vllm:cache_config_info{block_size="16"' in metrics and 'num_gpu_blocks="28"' in metrics
    assert ca.affinity_hits >= len(prompts) - 8
    assert ca.hit_rate >= 0.6, ca.hit_rate


def test_greedy_outputs_equal_one_engine_streamed_or_not(server, single):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].text for o in single.generate(PROMPTS[:16], params, use_tqdm=False)]

    async def run() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)

        async def full(p: str) -> str:
            r = await client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=16, temperature=0.0,
                                                extra_body={"ignore_eos": True})
            return r.choices[0].text

        async def streamed(p: str) -> str:
            stream = await client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=16, temperature=0.0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        return (list(await asyncio.gather(*(full(p) for p in PROMPTS[:16]))),
                list(await asyncio.gather(*(streamed(p) for p in PROMPTS[:16]))))

    full_texts, streamed_texts = asyncio.run(run())
    assert full_texts == want and streamed_texts == want
    served = {labels: v for (name, labels), v in _by_engine(server).items() if name == "pagedserve:router_requests_total"}
    assert len(served) == 2 and all(v > 0 for v in served.values())  # both replicas served
    # A bad request is refused by its replica before anything is sent, and names the field.
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS,
                   json={"model": MODEL_NAME, "prompt": [10**6], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def _by_engine(server: ServerProcess) -> dict[tuple[str, str], float]:
    samples = metric_samples(httpx.get(server.url + "/metrics", headers=HEADERS, timeout=10).text)
    return {(name, labels.get("engine", "")): value for name, rows in samples.items() for labels, value in rows}


def _replica_pid(server: ServerProcess, index: int) -> int:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if f"-{server.proc.pid}-" in a["name"] and a["name"].endswith(f"-replica-{index}")]
    assert len(names) == 1, names
    return ray.get(ray.get_actor(names[0], namespace="pagedserve").pid.remote())


def test_a_replica_killed_mid_load_loses_no_request_and_comes_back(server, single):
    prompts = [f"request {i}: count the letters a b c" for i in range(64)]
    # Long enough that replica 1 still holds requests when the kill lands: with 24 tokens it
    # had sometimes finished them all by then (its stats reach /metrics 0.1 s late), so
    # nothing needed a retry and the retry counter stayed put (1 run in 3 failed).
    max_tokens = 96
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    want = [o.outputs[0].text for o in single.generate(prompts, params, use_tqdm=False)]
    victim = _replica_pid(server, 1)
    before = _by_engine(server)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(p: str) -> str:
            r = await client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=max_tokens, temperature=0.0,
                                                extra_body={"ignore_eos": True})
            return r.choices[0].text

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        # Kill replica 1 once it holds requests (its stats reach /metrics every 0.1 s).
        deadline = time.monotonic() + 30
        while _by_engine(server).get(("vllm:num_requests_running", "1"), 0) < 1:
            assert time.monotonic() < deadline, "replica 1 never ran a request"
            await asyncio.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        assert (await asyncio.to_thread(httpx.get, server.url + "/health")).status_code == 200
        return list(await asyncio.gather(*tasks))

    texts = asyncio.run(run())
    assert texts == want  # every request completed, each with its one engine's output
    after = _by_engine(server)
    assert after[("pagedserve:router_retries_total", "")] > before.get(("pagedserve:router_retries_total", ""), 0)
    deadline = time.monotonic() + 120
    while True:  # Ray restarts the replica, which loads the model again and rejoins
        m = _by_engine(server)
        if m[("pagedserve:router_replica_up", "1")] == 0 and (m := _by_engine(server))[
                ("pagedserve:router_replica_up", "1")] == 0:  # (a second scrape: after the marking)
            # down: its gauges read 0, not the requests it held when it died
            assert m.get(("vllm:num_requests_running", "1"), 0) == 0
        if m[("pagedserve:router_replica_up", "1")] == 1 and m[("pagedserve:router_replica_restarts_total", "1")] >= 1:
            break
        assert time.monotonic() < deadline, "replica 1 did not come back"
        time.sleep(0.5)
    assert _replica_pid(server, 1) != victim
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS,
                   json={"model": MODEL_NAME, "prompt": prompts[0], "max_tokens": max_tokens, "temperature": 0.0,
                         "ignore_eos": True}, timeout=60)
    assert r.json()["choices"][0]["text"] == want[0]
