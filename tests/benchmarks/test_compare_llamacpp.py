"""compare_llamacpp keeps both servers loaded: a configuration whose KV caches and
weights would not leave room for the runtimes is refused before anything starts, with a
--ctx-per-slot that fits."""

from __future__ import annotations

import pytest

from pagedserve import platforms
from pagedserve.benchmarks import compare_llamacpp

GiB = 2**30


def test_a_run_that_would_not_fit_is_refused_with_a_ctx_that_does(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 1024)
    monkeypatch.setattr(platforms, "available_memory_bytes", lambda device: 22 * GiB)
    compare_llamacpp.check_memory(str(gguf), 640, [int(3.75 * GiB), int(7.5 * GiB)])  # 11.25 GiB: fits
    with pytest.raises(SystemExit, match=r"KV caches \(6\.0 \+ 12\.0 GiB\).*pass --ctx-per-slot 768") as e:
        compare_llamacpp.check_memory(str(gguf), 1024, [6 * GiB, 12 * GiB])
    # 768 fits the rule it names.
    compare_llamacpp.check_memory(str(gguf), 768, [int(4.5 * GiB), 9 * GiB])
    with pytest.raises(SystemExit, match="cannot hold both sides") as e:
        compare_llamacpp.check_memory(str(gguf), 1024, [40 * GiB, 40 * GiB])
    assert "m.gguf" in str(e.value)


def test_the_table_has_a_ratio_column_per_pagedserve_side(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 2**20)
    figs = [compare_llamacpp.Figures("llama-server", decode_tok_s=20.0),
            compare_llamacpp.Figures("pagedserve", decode_tok_s=25.0),
            compare_llamacpp.Figures("pagedserve, 8-bit activations", decode_tok_s=30.0)]
    table = compare_llamacpp.report("m", str(gguf), figs, 1e9, 640).splitlines()
    assert table[2] == ("| | llama-server | pagedserve | pagedserve, 8-bit activations | pagedserve / llama-server "
                        "| pagedserve, 8-bit activations / llama-server |")
    assert table[4] == "| single-stream decode, tok/s | 20.0 | 25.0 | 30.0 | 1.25x | 1.50x |"
    alone = compare_llamacpp.report("m", str(gguf), figs[1:], 1e9, 640).splitlines()
    assert alone[2] == "| | pagedserve | pagedserve, 8-bit activations |"


def test_speculation_counts_come_from_metrics_and_reach_the_report(tmp_path):
    text = ('# HELP vllm:spec_decode_num_draft_tokens_total x\n'
            'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 400.0\n'
            'vllm:spec_decode_num_draft_tokens_created{model_name="m"} 1.7e9\n'
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 100.0\n')
    assert compare_llamacpp.parse_spec_counts(text) == (400, 100)
    assert compare_llamacpp.parse_spec_counts("vllm:num_preemptions_total 3.0\n") is None
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * 2**20)
    figs = [compare_llamacpp.Figures("llama-server", decode_tok_s=20.0),
            compare_llamacpp.Figures("pagedserve", decode_tok_s=25.0, drafts=(400, 100))]
    last = compare_llamacpp.report("m", str(gguf), figs, 1e9, 640).splitlines()[-1]
    assert last.startswith("pagedserve drafted 400 tokens over the run and accepted 100 (25%)")


def test_flags_a_mode_ignores_or_out_of_range_are_refused_before_anything_starts(capsys):
    """--latency ignored --files and the rest, --max-step-ms did nothing without it, a
    --ctx-per-slot too small for the TTFT prompt failed after two phases had run, and
    --threads reached llama-server alone."""
    for argv, error in ((["--latency", "--files", "Q4_0"], "--files would be ignored"),
                        (["--max-step-ms", "50"], "add --latency"), (["--ctx-per-slot", "512"], "must be over 512"),
                        (["--threads", "0"], "--threads must be >= 1"),
                        # (sizes the comparison sets on both sides: the table would say equal)
                        (["--pagedserve-args", "--max-num-seqs=4"], "--pagedserve-args --max-num-seqs: the comparison "
                                                                    "sizes both sides itself")):
        with pytest.raises(SystemExit):
            compare_llamacpp.main(argv)
        assert error in capsys.readouterr().err
    assert compare_llamacpp.threads_env(3)["OMP_NUM_THREADS"] == "3" and "PATH" in compare_llamacpp.threads_env(3)


def test_a_completion_that_did_not_make_its_tokens_raises(monkeypatch):
    """The figures assume max_tokens tokens were made: a stream that ended early (an error
    event, finish_reason "stop") or in one chunk inflated tok/s or divided by zero."""
    import asyncio

    import httpx

    def streaming(events):
        body = "".join(f"data: {e}\n\n" for e in [*events, "[DONE]"])
        return httpx.MockTransport(lambda request: httpx.Response(200, text=body))

    async def run(events, phase="single"):
        async with httpx.AsyncClient(transport=streaming(events)) as http:
            return await compare_llamacpp.sample(http, "http://x", "m", phase, __import__("random").Random(0))

    text = '{"choices": [{"text": "a", "finish_reason": %s}]}'
    with pytest.raises(RuntimeError, match="finish_reason 'stop'"):
        asyncio.run(run([text % "null", text % '"stop"']))
    with pytest.raises(RuntimeError, match="the stream failed"):
        asyncio.run(run([text % "null", '{"error": {"message": "boom"}}']))
    with pytest.raises(RuntimeError, match="in one chunk"):
        asyncio.run(run([text % '"length"']))
    assert asyncio.run(run([text % "null", text % '"length"'], "batch-2")) > 0


def test_the_pagedserve_sides_kv_budget_follows_its_dtype():
    """--pagedserve-args --dtype float32 on a bf16 CPU got a budget at 2 bytes a value: half
    the slots' tokens, beside a table row that said both caches were equal."""
    bytes_of = compare_llamacpp.pagedserve_dtype_bytes
    assert bytes_of([], True) == 2 and bytes_of([], False) == 4
    assert bytes_of(["--speculative-config", "off", "--dtype", "float32"], True) == 4
    assert bytes_of(["--dtype=fp32"], True) == 4 and bytes_of(["--dtype", "bf16"], False) == 2
    assert bytes_of(["--dtype", "auto"], False) == 4
