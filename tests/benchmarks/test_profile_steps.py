"""profile_steps' plumbing on CPU with a tiny model (its figures only mean something on a GPU)."""

from __future__ import annotations

from pagedserve.benchmarks import profile_steps


def test_profile_steps_dry_run(tmp_path, capsys):
    from tests.e2e.conftest import make_tiny_checkpoint

    model_dir = str(tmp_path)
    make_tiny_checkpoint("qwen3", model_dir)
    result = profile_steps.main(["--model", model_dir, "--load-format", "auto", "--dtype", "float32",
                                 "--device", "cpu", "--max-model-len", "128", "--batch", "3", "--context", "20",
                                 "--steps", "2", "--top", "5"])
    assert result["batch"] == 3 and result["wall_ms_per_step"] > 0 and result["cprofile_ms_per_step"] > 0
    assert "device_ms_per_step" not in result  # no CUDA: no kernel table
    out = capsys.readouterr().out
    assert "llm_engine.py" in out and "batch 3 x context 20: wall" in out
