"""The KV tier outlives the server: a long shared system prompt computed by one server
is loaded from --kv-offload-dir by the next one, which answers far sooner.  Through
the real server and the official `openai` client, on the real default model."""

from __future__ import annotations

import time

import openai

from pagedserve.benchmarks.bench_kv_tiers import system_prompt
from tests.entrypoints.openai.conftest import API_KEY, ServerProcess

# About 2,000 tokens of a system prompt that names its facts, as agents' prompts do
# (the benchmark's, so the README's figures and this test measure the same prompt).
SYSTEM = system_prompt(70)


def first_token_seconds(server: ServerProcess, question: str) -> float:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model="smollm2", stream=True, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    assert first is not None, "no content came back"
    return first


def test_restart_on_the_same_offload_dir_answers_5x_sooner(smollm2_path, tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert 1900 <= len(tok(SYSTEM)["input_ids"]) <= 2600
    offload = tmp_path / "kv"
    flags = [smollm2_path, "--served-model-name", "smollm2", "--api-key", API_KEY, "--max-model-len", "4096",
             "--max-num-seqs", "4", "--kv-offload-dir", str(offload)]

    cold = ServerProcess(flags, tmp_path / "cold.log")
    try:
        cold_s = first_token_seconds(cold, "When does the train from city 3 leave?")
        deadline = time.monotonic() + 30  # the writer thread stores them in the background
        while (stored := cold.metrics()[("pagedserve:kv_offload_stored_blocks_total", ())]) < 120:
            assert time.monotonic() < deadline, stored  # the system prompt's 2,000+ tokens, in blocks of 16
            time.sleep(0.2)
    finally:
        cold.stop()  # graceful: queued writes finish

    warm = ServerProcess(flags, tmp_path / "warm.log")
    try:
        warm_s = first_token_seconds(warm, "Which platform does the train from city 7 use?")
        metrics = warm.metrics()
        assert metrics[("vllm:external_prefix_cache_hits_total", ())] >= 1900
        assert metrics[("pagedserve:kv_offload_invalid_blocks_total", ())] == 0
    finally:
        warm.stop()
    print(f"first token: cold directory {cold_s * 1000:.0f} ms, after restart {warm_s * 1000:.0f} ms "
          f"({cold_s / warm_s:.1f}x sooner)")
    assert cold_s >= 5 * warm_s, (cold_s, warm_s)
