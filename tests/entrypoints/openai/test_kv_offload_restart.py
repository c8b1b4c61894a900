"""The KV tier outlives the server: a shared system prompt computed by one server is
loaded from --kv-offload-dir by the next one, every block of it, none invalid.  Through
the real server and the official `openai` client, on the real default model.  How much
sooner the restarted server answers is a figure, not an assertion: it prints here, and
`python -m pagedserve.benchmarks.bench_kv_tiers` measures it on the 2,000-token prompt."""

from __future__ import annotations

import time

import openai

from pagedserve.benchmarks.bench_kv_tiers import system_prompt
from tests.entrypoints.openai.conftest import API_KEY, ServerProcess

# About 600 tokens of a system prompt that names its facts, as agents' prompts do (the
# benchmark's prompt, shorter: the cold server's prefill is most of this test's time).
SYSTEM = system_prompt(20)


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


def test_restart_on_the_same_offload_dir_loads_the_prompt_from_disk(smollm2_path, tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    n = len(tok(SYSTEM)["input_ids"])
    assert 500 <= n <= 900, n
    offload = tmp_path / "kv"
    flags = [smollm2_path, "--served-model-name", "smollm2", "--api-key", API_KEY, "--max-model-len", "4096",
             "--max-num-seqs", "4", "--kv-offload-dir", str(offload)]

    cold = ServerProcess(flags, tmp_path / "cold.log")
    try:
        cold_s = first_token_seconds(cold, "When does the train from city 3 leave?")
        deadline = time.monotonic() + 30  # the writer thread stores them in the background
        while (stored := cold.metrics()[("pagedserve:kv_offload_stored_blocks_total", ())]) < n // 16:
            assert time.monotonic() < deadline, stored  # the system prompt's blocks of 16
            time.sleep(0.2)
    finally:
        cold.stop()  # graceful: queued writes finish

    warm = ServerProcess(flags, tmp_path / "warm.log")
    try:
        warm_s = first_token_seconds(warm, "Which platform does the train from city 7 use?")
        metrics = warm.metrics()
        assert metrics[("vllm:external_prefix_cache_hits_total", ())] >= n // 16 * 16
        assert metrics[("pagedserve:kv_offload_invalid_blocks_total", ())] == 0
    finally:
        warm.stop()
    print(f"first token: cold directory {cold_s * 1000:.0f} ms, after restart {warm_s * 1000:.0f} ms "
          f"({cold_s / warm_s:.1f}x sooner)")
