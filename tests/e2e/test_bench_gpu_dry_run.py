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
    # W2 is greedy: the second config's outputs are compared with the first's (same on CPU)
    assert fast["greedy_vs_first"] == {"w2": {"identical": 3, "of": 3, "first_divergence": None}}
    table = capsys.readouterr().out
    assert "w1 tok/s" in table and "graphs+overlap" in table and "24,600" in table
    assert "greedy w2: graphs+overlap vs eager: 3/3 sequences identical" in table


def test_compare_greedy_reports_divergence():
    tokens = {"a": {"w2": [[1, 2, 3], [4, 5, 6]]}, "b": {"w2": [[1, 2, 3], [4, 9, 6]]}, "c": {"w2": [[1, 2], [4, 5, 6]]}}
    assert bench_gpu.compare_greedy(tokens) == {"w2": {
        "b": {"identical": 1, "of": 2, "first_divergence": 1},
        "c": {"identical": 1, "of": 2, "first_divergence": 2}}}
