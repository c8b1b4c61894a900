"""The real server under concurrent streaming load with disconnects, and /metrics
parsed with prometheus_client against exactly the requests sent."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
from conftest import API_KEY, MODEL_NAME

PROMPTS = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(32)]


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def wait_idle(server, timeout: float = 20) -> dict:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        idle = (m[("vllm:num_requests_running", ())] == 0 and m[("vllm:num_requests_waiting", ())] == 0
                and m[("vllm:kv_cache_usage_perc", ())] == 0)
        if idle or time.time() > deadline:
            return m
        time.sleep(0.1)


def test_metrics_match_requests_sent(server, tokenizer):
    before = wait_idle(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    prompts = PROMPTS[:3]
    max_tokens = [5, 7, 9]
    for p, m in zip(prompts, max_tokens, strict=True):
        r = client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=m, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == m
    after = wait_idle(server)
    n_prompt = sum(len(tokenizer.encode(p)) for p in prompts)
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 3
    assert delta(after, before, "vllm:prompt_tokens_total") == n_prompt
    assert delta(after, before, "vllm:generation_tokens_total") == sum(max_tokens)
    assert delta(after, before, "vllm:time_to_first_token_seconds_count") == 3
    assert delta(after, before, "vllm:e2e_request_latency_seconds_count") == 3
    # One inter-token gap per token after the first (one token per step here).
    assert delta(after, before, "vllm:inter_token_latency_seconds_count") == sum(m - 1 for m in max_tokens)
    for name in ("count", "sum"):  # (its older name, read by vLLM's example dashboard)
        assert delta(after, before, f"vllm:time_per_output_token_seconds_{name}") == delta(
            after, before, f"vllm:inter_token_latency_seconds_{name}")
    assert delta(after, before, "vllm:e2e_request_latency_seconds_sum") > 0
    assert delta(after, before, "vllm:prefix_cache_queries_total") >= n_prompt
    # vLLM's per-request histograms (absent before): exactly these three requests' figures.
    assert delta(after, before, "vllm:request_prompt_tokens_sum") == n_prompt
    assert delta(after, before, "vllm:request_generation_tokens_sum") == sum(max_tokens)
    assert delta(after, before, "vllm:request_max_num_generation_tokens_sum") == sum(max_tokens)
    assert delta(after, before, "vllm:request_params_max_tokens_sum") == sum(max_tokens)
    assert delta(after, before, "vllm:request_params_n_sum") == 3
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(after, before, f"vllm:request_{phase}_time_seconds_count") == 3
    assert delta(after, before, "vllm:request_decode_time_seconds_sum") > 0
    # vLLM's per-request mean time per output token: decode time over the tokens after the first
    assert delta(after, before, "vllm:request_time_per_output_token_seconds_count") == 3
    assert 0 < delta(after, before, "vllm:request_time_per_output_token_seconds_sum") <= delta(
        after, before, "vllm:request_decode_time_seconds_sum") / min(m - 1 for m in max_tokens) + 1e-9
    assert delta(after, before, "vllm:request_inference_time_seconds_sum") >= delta(
        after, before, "vllm:request_decode_time_seconds_sum")
    # Each step's tokens: the prompts' and the generated ones, step by step (one request at a time).
    assert delta(after, before, "vllm:iteration_tokens_total_sum") == n_prompt + sum(max_tokens)
    for name in ("vllm:prefix_cache_hits_total", "vllm:num_preemptions_total"):
        assert (name, ()) in after
    assert after[("vllm:num_requests_running", ())] == 0


def test_32_streams_8_disconnect(server):
    """32 concurrent streaming clients; 8 hang up after a few chunks.  The other 24 get
    exactly the text the non-streamed request for their prompt got, and afterwards nothing is
    running, waiting or holding KV blocks.

    The streams that hang up ask for 200 tokens, not 40: on two busy cores the client can
    read its third chunk after the server has generated 40 tokens, and a request that
    finished before its client left is rightly counted as finished by length."""
    kw = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 40, "extra_body": {"ignore_eos": True}}
    long_kw = {**kw, "max_tokens": 200}
    before = wait_idle(server)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as ac:
            refs = await asyncio.gather(*(ac.completions.create(prompt=p, **kw) for p in PROMPTS))

            async def one(i: int):
                hangs_up = i % 4 == 3
                stream = await ac.completions.create(prompt=PROMPTS[i], stream=True,
                                                     **(long_kw if hangs_up else kw))
                text, chunks = "", 0
                async for ch in stream:
                    text += ch.choices[0].text
                    chunks += 1
                    if hangs_up and chunks == 3:
                        await stream.close()  # hang up mid-stream
                        return None
                return text, ch.choices[0].finish_reason

            results = await asyncio.gather(*(one(i) for i in range(32)))
            return [r.choices[0].text for r in refs], results

    refs, results = asyncio.run(main())
    done = [r for r in results if r is not None]
    assert len(done) == 24
    for i, r in enumerate(results):
        if i % 4 == 3:
            assert r is None
        else:
            text, reason = r
            assert reason == "length"
            assert text == refs[i], i  # streamed == non-streamed for the same prompt
    after = wait_idle(server)
    assert after[("vllm:num_requests_running", ())] == 0
    assert after[("vllm:num_requests_waiting", ())] == 0
    assert after[("vllm:kv_cache_usage_perc", ())] == 0
    assert delta(after, before, "vllm:request_success_total", finished_reason="length") == 24 + 32
    assert delta(after, before, "vllm:request_success_total", finished_reason="abort") == 8
    (info,) = [dict(labels) for name, labels in after if name == "vllm:cache_config_info"]
    assert info["kv_cache_dtype"] == "float32" and info["block_size"] == "16"
    # --kv-cache-memory-bytes 16MiB, in blocks of 16 tokens of kv_bytes_per_token each
    assert int(info["num_blocks"]) == 16 * 2**20 // (16 * int(info["kv_bytes_per_token"]))
    # vLLM's label names too (its dashboards read them)
    assert (info["num_gpu_blocks"], info["cache_dtype"]) == (info["num_blocks"], "float32")
    assert info["enable_prefix_caching"] == "True"
    # Ollama's /api/ps counts the KV cache in the model's size (its pages mapped, not yet all touched)
    (ps,) = httpx.get(server.url + "/api/ps", headers={"Authorization": f"Bearer {API_KEY}"}).json()["models"]
    assert ps["size"] > int(info["num_blocks"]) * 16 * int(info["kv_bytes_per_token"])
    # The server is healthy and serving afterwards.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(prompt=PROMPTS[0], **kw).choices[0].text == refs[0]
