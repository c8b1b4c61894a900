"""The `pagedserve` CLI with a scripted engine: argument handling, output, chat loop."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pagedserve.cpu_info import cpu_flags
from pagedserve.entrypoints import cli
from tests.engine.fake_runner import make_engine
from tests.engine.helpers import make_tiny_llama, make_tokenizer

ANSWER = "Paris is the capital of France."


@pytest.fixture
def fake_engine(monkeypatch):
    tok = make_tokenizer()
    ids = tok.encode(ANSWER) + [tok.eos_token_id]
    engines = []

    def load(ns, num_seqs):
        assert ns.model in (None, "m")  # engine flags reach EngineArgs
        assert num_seqs == (len(ns.prompts) if ns.command == "generate" else 1)
        engines.append(make_engine(lambda i, p: ids[min(i, len(ids) - 1)], tokenizer=tok, vocab_size=len(tok),
                                   eos_token_id=tok.eos_token_id))
        return engines[-1]

    monkeypatch.setattr(cli, "_build_engine", load)
    return engines


def test_generate_prints_the_answer(fake_engine, capsys) -> None:
    cli.main(["generate", "What is the capital of France?", "--model", "m", "--max-tokens", "50"])
    assert capsys.readouterr().out == ANSWER + "\n"
    cli.main(["generate", "a", "b", "--no-chat", "--max-tokens", "3"])
    out = capsys.readouterr().out
    assert out.startswith("[0] a\n") and "\n[1] b\n" in out and out.count("Paris is") == 2


def test_generate_reads_a_prompt_of_dash_from_standard_input(fake_engine, monkeypatch) -> None:
    """`pagedserve generate -` reads the prompt from standard input, without the newline
    `echo` adds (it was sent to the model as the text "-")."""
    import io

    seen = []

    def run(self, prompts, params, use_tqdm, priority=None, lora_request=None):
        seen.extend(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(text="")]) for _ in prompts]

    monkeypatch.setattr("pagedserve.entrypoints.llm.LLM._run", run)
    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital\nof France?\n"))
    cli.main(["generate", "first", "-", "--no-chat"])
    assert seen == ["first", "What is the capital\nof France?"]
    with pytest.raises(SystemExit, match="give - once"):
        cli.main(["generate", "-", "-", "--no-chat"])


def test_generate_show_blocks_prints_the_pool_at_its_busiest_and_at_the_end(fake_engine, capsys) -> None:
    cli.main(["generate", "The same long prompt, " * 4, "The same long prompt, " * 4 + "twice.", "--no-chat",
              "--max-tokens", "20", "--show-blocks"])
    out = capsys.readouterr().out
    busiest = out.split("KV block pool at the busiest step")[1].split("KV block pool at the end")[0]
    end = out.split("KV block pool at the end")[1]
    # 64 blocks of 16 tokens: one line of cells, then the legend.
    busy_cells, end_cells = busiest.splitlines()[1], end.splitlines()[1]
    assert busy_cells[0] == end_cells[0] == "0" and len(busy_cells) == len(end_cells) == 64
    assert "S" in busy_cells and "#" in busy_cells  # the shared prompt prefix, each request's own tail
    assert set(end_cells[1:]) <= {"c", "."} and "c" in end_cells  # all freed, the prefix still cached
    assert "in use 0" in end and "shared 0" in end
    assert fake_engine[-1].busiest_usage > 0


def test_generate_applies_the_chat_template_by_default(fake_engine, monkeypatch) -> None:
    seen = []

    def run(self, prompts, params, use_tqdm, priority=None, lora_request=None):
        seen.extend(prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(text="")]) for _ in prompts]

    monkeypatch.setattr("pagedserve.entrypoints.llm.LLM._run", run)
    cli.main(["generate", "hi", "--system", "be brief"])
    assert seen[0]["prompt"].startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi")
    seen.clear()
    cli.main(["generate", "hi", "--system", ""])  # an empty system turn, not the template's default one
    assert seen[0]["prompt"].startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nhi"), seen
    seen.clear()
    cli.main(["generate", "hi", "--no-chat"])
    assert seen == ["hi"]


def test_generate_and_chat_size_the_engine_for_their_sequences(monkeypatch) -> None:
    """One prompt needs one sequence's KV cache, not 256 sequences' (5.6 GiB written at
    start-up); --max-num-seqs still decides where given."""
    from pagedserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(lambda cls, args: args))
    for argv, num_seqs, want in ((["generate", "a", "b"], 2, 2), (["chat"], 1, 1),
                                 (["generate", "a", "--max-num-seqs", "8"], 1, 8)):
        assert cli._build_engine(cli.build_parser().parse_args(argv), num_seqs).max_num_seqs == want


def test_generate_and_chat_help_says_their_own_defaults(capsys) -> None:
    """Their --help showed the engine's 256 sequences and "compile: on", which they override."""
    for command, seqs in (("generate", "the number of prompts"), ("chat", "1: one conversation")):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"most sequences in one step (default here: {seqs})" in text
        assert "most sequences in one step (default: 256)" not in text
        assert "with torch.compile (default here: off" in text


def test_sampling_flags_not_given_take_the_models_generation_config(monkeypatch, capsys) -> None:
    """A flag given wins; one not given takes the model's generation-config default (and
    --override-generation-config's: the engine's sampling_defaults), else the command's
    own.  The command's defaults overrode both, so --override-generation-config did
    nothing here; and --seed, the engine's, was also every request's (two prompts
    sampled alike answered alike)."""
    tok = make_tokenizer()
    ids = tok.encode(ANSWER) + [tok.eos_token_id]

    def load(ns, num_seqs):
        engine = make_engine(lambda i, p: ids[min(i, len(ids) - 1)], tokenizer=tok, vocab_size=len(tok),
                             eos_token_id=tok.eos_token_id)
        engine.sampling_defaults = lambda: {"max_tokens": 2, "temperature": 0.5}
        return engine

    monkeypatch.setattr(cli, "_build_engine", load)
    cli.main(["generate", "hi", "--no-chat"])
    assert capsys.readouterr().out == tok.decode(ids[:2]) + "\n"
    cli.main(["generate", "hi", "--no-chat", "--max-tokens", "50"])
    assert capsys.readouterr().out == ANSWER + "\n"
    ns = cli.build_parser().parse_args(["generate", "hi", "--seed", "5", "--top-k", "3"])
    given = cli._sampling_params(ns, {"max_tokens": 2, "top_k": 7, "temperature": 0.5})
    assert (given.seed, given.max_tokens, given.top_k, given.temperature) == (None, 2, 3, 0.5)
    assert (cli._sampling_params(ns).temperature, cli._sampling_params(ns).max_tokens) == (0.0, 256)


def test_bad_sampling_value_is_a_clean_error(fake_engine) -> None:
    """Named before the model loads (it loaded first), as another runner is."""
    with pytest.raises(SystemExit, match="max_tokens must be"):
        cli.main(["generate", "x", "--max-tokens", "0"])
    with pytest.raises(SystemExit, match="temperature must be"):
        cli.main(["chat", "--temperature", "-1"])
    with pytest.raises(SystemExit, match="generate generates text: --runner pooling serves embeddings"):
        cli.main(["generate", "x", "--runner", "pooling"])
    with pytest.raises(SystemExit, match="generate generates text: --runner pooling serves embeddings"):
        cli.main(["generate", "x", "--task", "embed"])  # (vLLM's spelling loaded the model first)
    assert fake_engine == []  # (no engine was built)


@pytest.mark.parametrize(("flags", "error"), [
    (["--one-at-a-time", "0"], "--one-at-a-time must be >= 1"), (["--temperature", "-1"], "temperature must be"),
    (["--workload", "chat-burst", "--num-prompts", "2"], "--num-prompts size the random workload"),
    (["--input-len", "5", "1"], "1 <= MIN <= MAX"),
])
def test_bench_throughput_flags_are_one_line_errors_before_the_model_loads(flags, error, monkeypatch) -> None:
    """They were tracebacks, some after the model had loaded; a preset's sizes were ignored."""
    from pagedserve.engine.llm_engine import LLMEngine

    monkeypatch.setattr(LLMEngine, "from_engine_args", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(SystemExit, match=f"pagedserve bench throughput: error: .*{error}"):
        cli.main(["bench", "throughput", *flags])


def test_chat_streams_and_keeps_history(fake_engine, monkeypatch, capsys) -> None:
    lines = iter(["hello", "", "again", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    cli.main(["chat", "--temperature", "0"])
    out = capsys.readouterr().out
    assert out == ANSWER + "\n" + ANSWER + "\n"
    engine = fake_engine[-1]
    assert not engine.has_unfinished_requests()


def test_a_chat_turn_is_the_line_as_typed(monkeypatch) -> None:
    """Its spaces kept, as `generate --chat`, the server and LLM.chat take the same text
    (they were stripped: other prompt ids, another answer); commands read either way."""
    lines = iter(["  What is 2+2?  ", "   ", " /clear ", " /exit "])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    turns: list[str] = []

    class Recording:
        def clear(self) -> None:
            turns.append("(cleared)")

        def turn(self, text: str, write) -> None:
            turns.append(text)

    assert cli.chat_loop(Recording(), "hi") == (1, 0)
    assert turns == ["  What is 2+2?  ", "(cleared)"]


def test_chat_ends_on_eof(fake_engine, monkeypatch, capsys) -> None:
    prompts = []

    def eof(prompt=""):
        prompts.append(prompt)
        raise EOFError

    monkeypatch.setattr("builtins.input", eof)
    cli.main(["chat"])  # returns (no SystemExit, no traceback) after one prompt
    # (standard output is not a terminal here: the prompt goes to standard error, so a
    # piped chat's output is its answers alone)
    captured = capsys.readouterr()
    assert prompts == [""] and captured.out == "" and captured.err.endswith(">>> \n")
    assert not fake_engine[-1].has_unfinished_requests()


def test_a_chat_with_a_refused_turn_exits_1(fake_engine, monkeypatch, capsys) -> None:
    """A turn the engine refused is said on standard error and the chat goes on; at the
    end the exit status says so (it was 0: a script piping turns in could not tell)."""
    lines = iter(["x" * 2_000_000, "hello", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    with pytest.raises(SystemExit, match="chat: error: 1 of 2 turns refused"):
        cli.main(["chat", "--temperature", "0"])
    captured = capsys.readouterr()
    assert captured.out == ANSWER + "\n" and "(try /clear)" in captured.err


def test_missing_delegated_command_says_so(monkeypatch) -> None:
    monkeypatch.setitem(cli._DELEGATED, ("serve",), ("pagedserve.no_such_server", "the server"))
    with pytest.raises(SystemExit, match="the server is not available"):
        cli.main(["serve", "--port", "1"])


def test_bench_commands_come_from_their_entry_point_group() -> None:
    """The benchmarks declare themselves (pyproject.toml); the CLI never names their modules."""
    found = cli._benchmarks()
    assert {"throughput", "serve"} <= set(found)
    assert all(ep.module.startswith("pagedserve.benchmarks.") for ep in found.values())
    for name in ("throughput", "serve"):  # listed in `pagedserve bench --help`
        assert cli.build_parser().parse_args(["bench", name]).bench_command == name


def test_missing_benchmark_says_so(monkeypatch) -> None:
    from importlib.metadata import EntryPoint

    ep = EntryPoint(name="nothing", value="pagedserve.no_such_bench:main", group=cli.BENCHMARK_GROUP)
    monkeypatch.setattr(cli, "_benchmarks", lambda: {"nothing": ep})
    with pytest.raises(SystemExit, match="the nothing benchmark is not available"):
        cli.main(["bench", "nothing", "--x"])


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="an x86 CPU with AVX2")
def test_generate_on_an_avx2_only_cpu_runs_float32_and_says_why(tmp_path) -> None:
    """What a user of a CPU without AVX-512 sees (emulated here the way the README's AVX2
    figures were taken): `auto` picks float32 and the log says why."""
    make_tiny_llama(str(tmp_path), vocab_size=400)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    run = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "generate", "hello", "--no-chat",
                          "--model", str(tmp_path), "--max-tokens", "3", "--attention-backend", "torch_paged"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "dtype auto -> float32: torch runs with AVX2 kernels" in run.stderr or \
        "dtype auto -> float32: this CPU has no bf16 instructions" in run.stderr, run.stderr
    assert "KV cache on cpu:" in run.stderr and "sized by" in run.stderr


def test_global_options_before_a_delegated_command_and_version(monkeypatch, capsys) -> None:
    """`pagedserve --log-level warning serve ...` ran nothing and exited 0 (the global option
    hid the command from its delegate); --version answers."""
    ran = []
    monkeypatch.setattr(cli, "_delegate", lambda argv: argv[:1] in (["serve"], ["bench"]) and (ran.append(argv) or True))
    cli.main(["--log-level", "warning", "serve", "--port", "8000"])
    cli.main(["--log-level=error", "bench", "throughput"])
    assert ran == [["serve", "--port", "8000"], ["bench", "throughput"]]
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("pagedserve ")
    with pytest.raises(SystemExit) as e:  # (it said "invalid choice: 'chat'", a word of ours)
        cli.main(["--log-level"])
    assert e.value.code == 2 and "--log-level: expected one argument" in capsys.readouterr().err


def test_python_dash_m_pagedserve_is_the_command() -> None:
    """`python -m pagedserve ...` (no console script on PATH) runs the command: it said
    "No module named pagedserve.__main__"."""
    run = subprocess.run([sys.executable, "-m", "pagedserve", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("pagedserve "), run.stderr[-2000:]


def test_generate_refuses_an_empty_chat_prompt_and_system_without_chat(fake_engine) -> None:
    with pytest.raises(SystemExit, match="a prompt is empty"):
        cli.main(["generate", ""])
    with pytest.raises(SystemExit, match="--system"):
        cli.main(["generate", "--no-chat", "--system", "Be brief.", "hi"])
    with pytest.raises(SystemExit, match="--chat-template renders chat prompts"):  # (it was dropped)
        cli.main(["generate", "--no-chat", "--chat-template", "{{ 'x' }}", "hi"])
    assert len(fake_engine) == 1  # (--no-chat's refusals come before the model loads)


def test_chat_with_the_pooling_runner_is_refused_before_loading(fake_engine) -> None:
    """It loaded the model, refused every turn and exited 0."""
    with pytest.raises(SystemExit, match="chat generates text: --runner pooling serves embeddings"):
        cli.main(["chat", "--runner", "pooling"])
    assert fake_engine == []  # (no engine was built)


def test_abbreviated_flags_are_unknown_flags(capsys, monkeypatch, fake_engine) -> None:
    """argparse's prefix matching took `serve --gpu-memory 0.5` as --gpu-memory-utilization,
    silently; now every command names it unknown (vLLM's parser does the same)."""
    from pagedserve.entrypoints.openai import api_server

    def started(args):
        raise AssertionError(f"the server started with {args}")

    monkeypatch.setattr(api_server, "run_server", started)
    for argv in (["serve", "--gpu-memory", "0.5"], ["generate", "hi", "--max-tok", "3"], ["chat", "--temp", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_ctrl_c_while_loading_or_generating_exits_130_without_a_traceback(command, monkeypatch, capsys) -> None:
    """Ctrl-C in generate, or in chat while the model loads, printed a KeyboardInterrupt
    traceback and died by the signal."""
    def interrupted(ns, num_seqs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_build_engine", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(command)
    assert e.value.code == 130 and "Traceback" not in capsys.readouterr().err


def test_the_command_exits_without_the_teardowns_leak_report() -> None:
    """The exit skips the collector's passes (gc.freeze), so Triton's bindings (imported by
    torch) found their objects alive at teardown and printed ~27 lines of "nanobind:
    leaked ..." after every command."""
    script = ("import sys\nimport torch\nimport triton._C.libtriton\nfrom pagedserve import LLM\n"
              "from pagedserve.entrypoints.cli import run\nsys.argv = ['pagedserve', '--version']\nrun()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip(), out
    assert "leaked" not in out.stderr, out.stderr[:300]


def test_the_collector_waits_for_the_engine_then_never_walks_the_start_up_heap_again(tmp_path) -> None:
    """`pagedserve generate`: no collection while it imports torch and builds the engine
    (each full one walked ~300k objects again, up to 0.14 s on Zen 4), one when the engine
    is built, then collections resume with the start-up heap frozen out of their sight."""
    make_tiny_llama(str(tmp_path), vocab_size=400)
    script = f"""
import gc, sys
from pagedserve.entrypoints import cli
seen = []
gc.callbacks.append(lambda phase, info: phase == "start" and seen.append(info["generation"]))
real = cli.settle_start_up_heap
def settle():
    print("before", len(seen), gc.isenabled(), gc.get_freeze_count())
    real()
    print("after", gc.isenabled(), gc.get_freeze_count() > 0, flush=True)
cli.settle_start_up_heap = settle
sys.argv = ["pagedserve", "generate", "hello", "--no-chat", "--model", {str(tmp_path)!r}, "--max-tokens", "2"]
cli.run()
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith(("before", "after"))]
    assert lines == [["before", "0", "False", "0"], ["after", "True", "True"]], run.stdout
