"""bench_gpu's plumbing on CPU with a tiny model (the figures only mean something on a GPU)."""

from __future__ import annotations

import json

from pagedserve.benchmarks import bench_gpu


def test_dry_run(tiny_checkpoint, tmp_path, capsys):
    model_dir, _ = tiny_checkpoint("qwen3")
    out = tmp_path / "r.json"
    results = bench_gpu.main([
        "--device", "cpu", "--model", model_dir, "--load-format", "auto", "--dtype", "float32",
        "--num-prompts", "3", "--max-input-len", "20", "--max-output-len", "6", "--max-model-len", "64",
        "--configs", "eager", "graphs+overlap", "--output-json", str(out)])
    assert [r["config"] for r in results] == ["eager", "graphs+overlap"]
    eager, fast = results
    assert eager["async_scheduling"] is False and fast["async_scheduling"] is True
    assert not fast["cuda_graphs"]  # CPU: graphs cannot be captured, the config still runs
    for r in results:
        assert r["workloads"]["w1"]["output_tokens"] == 18 and r["workloads"]["w2"]["output_tokens"] == 18
    assert json.loads(out.read_text()) == results
    table = capsys.readouterr().out
    assert "w1 tok/s" in table and "graphs+overlap" in table and "24,600" in table
