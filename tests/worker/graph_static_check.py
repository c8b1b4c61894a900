"""Run by test_cuda_graph.py in a fresh process with TRITON_INTERPRET=1 (Triton picks
interpreted or compiled mode at its first import): the decode-graph path, run
eagerly on its static padded buffers, against plain eager steps, on CPU."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from worker_helpers import Driver, ToyModel, toy_config  # noqa: E402

from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.worker.model_runner import ModelRunner  # noqa: E402

PROMPTS = [list(range(3 + i, 8 + 10 * i)) for i in range(5)]


def make_runner(backend: str, static_graphs: bool, window: int | None = None) -> ModelRunner:
    # max_model_len 1024: the pinned split count is > 1 for the small sizes.
    config = toy_config(block_size=16, max_num_batched_tokens=512, kv_cache_memory_bytes=1 << 20,
                        max_num_seqs=8, max_model_len=1024)
    config.device_config.attention_backend = backend
    runner = ModelRunner(config, ToyModel(window=window).eval())
    runner.initialize_kv_cache()
    assert runner.graph_runner is None  # CPU: no graphs unless asked for
    if static_graphs:
        runner.capture_decode_graphs(use_graphs=False)
        assert runner.graph_runner.sizes == [1, 2, 4, 8]
        assert [md.num_splits for _, md in sorted(runner.graph_runner.metadata.items())] == [4, 2, 1, 1]
    return runner


def driver_outputs(runner: ModelRunner) -> dict:
    drv = Driver(runner, runner.config.cache_config.num_blocks, 512)
    for i, p in enumerate(PROMPTS):
        drv.add(f"r{i}", p, SamplingParams(temperature=0, logprobs=2), max_tokens=2 + i)
    drv.run()
    lps = [o.logprobs for _, o in drv.outputs]
    return {k: v["out"] for k, v in drv.done.items()}, lps


def engine_outputs(runner: ModelRunner, overlap: bool) -> dict:
    runner.config.scheduler_config.async_scheduling = overlap
    engine = LLMEngine(runner.config, runner)
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[5, 40])
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"e{i}", p, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
    assert engine.get_stats().kv_cache_usage == 0
    return final


def main() -> None:
    torch.set_num_threads(1)
    eager_runner, graph_runner = make_runner("triton", False), make_runner("triton", True)
    (full, eager_lps), (graphed, graphed_lps) = driver_outputs(eager_runner), driver_outputs(graph_runner)
    assert graphed == full, (graphed, full)
    for a, b in zip(eager_lps, graphed_lps, strict=True):
        for rid in a:
            assert a[rid].topk_token_ids == b[rid].topk_token_ids
            torch.testing.assert_close(torch.tensor(a[rid].topk_logprobs), torch.tensor(b[rid].topk_logprobs))
    replays = graph_runner.graph_runner.num_replays
    assert replays > 0
    # Overlap scheduling on top: pending tokens gathered into the static input buffer.
    ref = engine_outputs(make_runner("torch_paged", False), overlap=False)
    got = engine_outputs(graph_runner, overlap=True)
    assert got == ref, (got, ref)
    assert graph_runner.graph_runner.num_replays > replays
    # Every layer sliding (Mistral's shape: one KV-cache group, so graphs apply): the
    # window must reach the captured steps' metadata (the first GPU run found it did not).
    eager_w, graph_w = make_runner("triton", False, window=6), make_runner("triton", True, window=6)
    assert graph_w.graph_runner.sliding_window == 6
    (eager, _), (graphed, _) = driver_outputs(eager_w), driver_outputs(graph_w)
    assert graphed == eager, (graphed, eager)
    assert full != eager, "the window changed nothing: the check lost its point"
    print("ok", replays)


if __name__ == "__main__":
    main()
