"""`pagedserve bench latency` (vLLM's latency benchmark) and `bench throughput`'s vLLM flags."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedserve.benchmarks import latency, throughput


def test_latency_times_whole_batches_and_writes_vllms_figures(tmp_path, capsys) -> None:
    result = latency.main(["--model", "smollm2-135m-instruct", "--input-len", "4", "--output-len", "3",
                           "--batch-size", "2", "--n", "2", "--num-iters-warmup", "1", "--num-iters", "3",
                           "--max-model-len", "32", "--output-json", str(tmp_path / "l.json")])
    out = capsys.readouterr().out
    assert len(result["latencies"]) == 3 and result["latencies"] == sorted(result["latencies"])
    assert result["percentiles"]["50"] == result["latencies"][1] and "Avg latency:" in out
    assert "99% percentile latency:" in out and json.loads((tmp_path / "l.json").read_text())["avg_latency"] > 0
    with pytest.raises(ValueError, match="--num-iters must be >= 1"):
        latency.main(["--num-iters", "0"])


def test_throughput_takes_vllms_length_and_ratio() -> None:
    parser = throughput.add_cli_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--input-len", "100", "--output-len", "10", "--random-range-ratio", "0.5",
                              "--dataset-name", "random", "--backend", "vllm", "--n", "2"])
    throughput.check_args(args)
    assert (args.input_len, args.output_len, args.n) == ((50, 150), (5, 15), 2)
    args = parser.parse_args(["--input-len", "20", "30", "--output-len", "8"])
    throughput.check_args(args)
    assert (args.input_len, args.output_len) == ((20, 30), (8, 8))
    for flags, match in ((["--input-len", "20", "30", "--random-range-ratio", "0.1"], "takes LEN"),
                         (["--workload", "chat-burst", "--n", "2"], "--n size the random workload"),
                         (["--random-range-ratio", "1"], "within"),
                         (["--input-len", "0"], "--input-len takes 1 <= MIN <= MAX, got 0"),  # (both ran as 1)
                         (["--output-len", "-4"], "--output-len takes 1 <= MIN <= MAX, got -4"),
                         (["--input-len", "30", "20"], "--input-len takes 1 <= MIN <= MAX, got 30 20"),
                         (["--n", "0"], "--num-prompts and --n must be >= 1")):
        with pytest.raises(ValueError, match=match):
            throughput.check_args(parser.parse_args(flags))


@pytest.mark.parametrize("bench", [latency, throughput])
def test_an_output_json_that_cannot_be_written_is_refused_before_the_run(bench, tmp_path) -> None:
    """A directory was a traceback, and a missing folder lost the figures, after the whole run."""
    parser = bench.add_cli_args(argparse.ArgumentParser(allow_abbrev=False))
    for path in (tmp_path, tmp_path / "nowhere" / "x.json"):
        with pytest.raises(ValueError, match=f"--output-json '{path}': not a file that can be written"):
            bench.check_args(parser.parse_args(["--output-json", str(path)]))
    bench.check_args(parser.parse_args(["--output-json", str(tmp_path / "x.json")]))
