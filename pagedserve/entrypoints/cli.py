"""The `pagedserve` command: generate, chat, serve, bench.

    pagedserve generate "What is the capital of France?"
    pagedserve chat --temperature 0.7
    pagedserve bench throughput --workload chat-burst
    pagedserve serve [MODEL] --port 8000       (the OpenAI-compatible server)

Every command takes the engine flags of EngineArgs (--model, --dtype,
--max-model-len, --enable-prefix-caching/--no-enable-prefix-caching, ...).
`serve` and `bench NAME` hand their arguments to their own modules, imported
only when used, so the offline commands never import the web stack.  Benchmarks are
found through the `pagedserve.benchmarks` entry-point group (pyproject.toml).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import gc
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve import envs
from pagedserve.engine.arg_spellings import vllm_flags_given
from pagedserve.engine.arg_utils import EngineArgs
from pagedserve.utils import pause_collector, settle_start_up_heap

if TYPE_CHECKING:
    from pagedserve.sampling_params import SamplingParams

# Subcommands implemented elsewhere in the serving layers: argv prefix -> (module, what it is).
_DELEGATED = {
    ("serve",): ("pagedserve.entrypoints.openai.api_server", "the OpenAI-compatible server"),
}
# `pagedserve bench NAME` runs the entry point NAME of this group (declared in
# pyproject.toml).  A benchmark is a client of the engine, never a part of it: the CLI
# finds benchmarks by the group they declare themselves in, never by their module names.
BENCHMARK_GROUP = "pagedserve.benchmarks"


class ServerModule(Protocol):
    """What `serve` needs of the server's module (entrypoints/openai/api_server.py)."""

    __doc__: str | None

    def make_arg_parser(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser: ...

    def parse_args(self, parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace: ...

    def run_server(self, args: argparse.Namespace) -> None: ...


class BenchmarkMain(Protocol):
    """A benchmark's entry point: its `main`, run with the arguments after its name."""

    def __call__(self, argv: list[str]) -> object: ...


def _benchmarks() -> dict[str, EntryPoint]:
    """The installed benchmarks, by subcommand name (not imported: that is when one runs)."""
    return {ep.name: ep for ep in entry_points(group=BENCHMARK_GROUP)}


# The sampling flags of `generate` and `chat`; one not given takes the model's
# generation-config default (and --override-generation-config's), else the command's own.
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "stop", "ignore_eos")


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float, max_tokens: int) -> None:
    p.set_defaults(own_sampling={"temperature": temperature, "max_tokens": max_tokens})
    model = "default: the model's generation config (or --override-generation-config), else"
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None, help=f"tokens to generate ({model} {max_tokens})")
    g.add_argument("--temperature", type=float, default=None, help=f"0 = greedy ({model} {temperature})")
    g.add_argument("--top-p", type=float, default=None, help=f"({model} 1.0)")
    g.add_argument("--top-k", type=int, default=None, help=f"0 = off ({model} 0)")
    g.add_argument("--min-p", type=float, default=None, help=f"({model} 0.0)")
    g.add_argument("--repetition-penalty", type=float, default=None, help=f"({model} 1.0)")
    g.add_argument("--presence-penalty", type=float, default=None, help="(default: 0.0)")
    g.add_argument("--frequency-penalty", type=float, default=None, help="(default: 0.0)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--system", default=None, help="system message for chat prompts")


def _given_sampling(ns: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given on the command line."""
    return {name: getattr(ns, name) for name in SAMPLING_FLAGS if getattr(ns, name) is not None}


def _sampling_params(ns: argparse.Namespace, model_defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The flags given, else `model_defaults` (the model's generation config and
    --override-generation-config: the engine's sampling_defaults()), else the command's
    own (greedy `generate`, `chat` at 0.7).  --seed is the engine's, not each request's
    (two prompts sampled alike would answer alike)."""
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(**{**ns.own_sampling, **(model_defaults or {}), **_given_sampling(ns)})


def build_parser() -> argparse.ArgumentParser:
    # (no abbreviated flags: `--gpu-memory 0.5` was taken as --gpu-memory-utilization, silently)
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--version", action="version", version=f"pagedserve {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts and print the results", allow_abbrev=False)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT",
                     help="a prompt; - reads one from standard input (without its last newline)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="apply the chat template (default: when the model has one)")
    _add_sampling_args(gen, temperature=0.0, max_tokens=256)
    gen.add_argument("--show-blocks", action="store_true",
                     help="at the end, print the KV block pool as text: in use, shared, cached (prefix cache) "
                          "and free blocks, and the busiest moment of the run")
    _interactive_engine_args(gen, "the number of prompts")

    chat = sub.add_parser("chat", help="interactive chat, streaming the answer (/exit or Ctrl-D quits)",
                          allow_abbrev=False)
    _add_sampling_args(chat, temperature=0.7, max_tokens=512)
    _interactive_engine_args(chat, "1: one conversation")
    remote = chat.add_argument_group("a running server instead of a model here (vLLM's `vllm chat --url`)")
    remote.add_argument("--url", default=None,
                        help="its OpenAI base URL, e.g. http://localhost:8000/v1 (the engine flags do not apply; "
                             "sampling flags not given: temperature 0.7 and 512 tokens are sent; --seed is each "
                             "request's)")
    remote.add_argument("--model-name", default=None, help="the served model to ask (default: its first)")
    remote.add_argument("--api-key", default=None,
                        help="its key (default: $PAGEDSERVE_API_KEY, else $VLLM_API_KEY, else $OPENAI_API_KEY)")
    remote.add_argument("--quick", default=None, metavar="MESSAGE",  # (vLLM's -q is --quantization's here)
                        help="send this one message, print the answer, and exit")

    sub.add_parser("serve", help="OpenAI-compatible HTTP server (see `pagedserve serve --help`)", add_help=False)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)
    # (their modules are imported only when they run: see _delegate)
    for name, ep in sorted(_benchmarks().items()):
        bench_sub.add_parser(name, help=f"the {name} benchmark ({ep.module}; `pagedserve bench {name} --help`)",
                             add_help=False)
    return parser


def _interactive_engine_args(p: argparse.ArgumentParser, num_seqs: str) -> None:
    """The engine's flags for `generate` and `chat`, which size and start the engine their
    own way (_build_engine): two of them say so, instead of the engine's defaults for
    `serve` and `LLM(...)`."""
    EngineArgs.add_cli_args(p, skip=("max_num_seqs", "torch_compile"))
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"most sequences in one step (default here: {num_seqs})")
    p.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the model with torch.compile (default here: off, an interactive command "
                        "does not earn back its 10-25 s; PAGEDSERVE_TORCH_COMPILE=1 turns it on)")


def _delegate(argv: list[str]) -> bool:
    """Run `serve` or `bench NAME` (their own modules parse their arguments); False for
    the commands this module runs itself."""
    for prefix, (module_name, what) in _DELEGATED.items():
        if tuple(argv[: len(prefix)]) == prefix:
            module: ServerModule = _import_or_exit(prefix, what, module_name,
                                                   functools.partial(importlib.import_module, module_name))
            parser = module.make_arg_parser(argparse.ArgumentParser(prog="pagedserve " + " ".join(prefix),
                                                                    description=module.__doc__, allow_abbrev=False))
            module.run_server(module.parse_args(parser, argv[len(prefix):]))
            return True
    ep = _benchmarks().get(argv[1]) if argv[:1] == ["bench"] and len(argv) > 1 else None
    if ep is not None:
        main: BenchmarkMain = _import_or_exit(("bench", ep.name), f"the {ep.name} benchmark", ep.module, ep.load)
        settle_start_up_heap()  # (a benchmark's engines are its own business)
        try:
            main(argv[2:])
        except (ValueError, OSError) as e:  # (bad flags, an unwritable results file: one line, as generate's)
            _exit_with(f"pagedserve bench {ep.name}", e)
        return True
    return False


def _import_or_exit(prefix: tuple[str, ...], what: str, module_name: str, load: Callable[[], Any]) -> Any:
    """`load()`, or a one-line exit naming the command when its module is not installed
    (a ModuleNotFoundError from inside it, a missing dependency, still raises)."""
    try:
        return load()
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            sys.exit(f"pagedserve {' '.join(prefix)}: {what} is not available in this installation "
                     f"(module {module_name} is missing)")
        raise


def _build_engine(ns: argparse.Namespace, num_seqs: int):
    """The engine for `generate` and `chat`, which run at most `num_seqs` sequences at once
    (the prompts; one conversation).  These interactive commands do not compile the model
    unless asked (--torch-compile): torch.compile takes 10-25 s at start-up and gains
    20-40% of decode speed (SmolLM2 Q4_1, Zen 4: 90 against 64-73 tok/s one request at a
    time), which one answer or a chat turn never earns back; `serve` and the offline `LLM`
    API keep compiling by default.  Without --max-num-seqs the engine is sized for
    `num_seqs`: the KV cache for 256 sequences took 5.6 GiB and 1.4 s to write at start-up
    on a 24 GB machine for one prompt; the answers are the same (every prompt still runs
    at once)."""
    from pagedserve.engine.llm_engine import LLMEngine

    args = EngineArgs.from_cli_args(ns)
    log = logging.getLogger("pagedserve")
    if args.torch_compile is None and envs.torch_compile() is None and not args.enforce_eager:
        log.info("torch.compile skipped for this interactive command (--torch-compile compiles; it pays off "
                 "for long runs)")
        args = args.replace(torch_compile=False)
    if ns.max_num_seqs is None:
        log.info("max_num_seqs %d: this command's sequences (--max-num-seqs sets it)", num_seqs)
        args = args.replace(max_num_seqs=num_seqs)
    engine = LLMEngine.from_engine_args(args)
    settle_start_up_heap()
    return engine


def _check_no_chat_flags(ns: argparse.Namespace) -> None:
    """A run that completes its prompts as they are takes no chat flag (each was dropped)."""
    for given, what in ((ns.system, "--system is a chat prompt's system message"),
                        (ns.chat_template, "--chat-template renders chat prompts")):
        if given is not None:
            raise ValueError(f"{what}, and this run completes its prompts as they are (--no-chat, or a model "
                             "without a chat template)")


def cmd_generate(ns: argparse.Namespace) -> None:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.request_limits import MAX_PROMPT_CHARS

    if ns.prompts.count("-") > 1:
        raise ValueError("standard input holds one prompt: give - once")
    if "-" in ns.prompts:  # (to one character past the bound, which refuses it; its last newline dropped, as $(...))
        ns.prompts = [sys.stdin.read(MAX_PROMPT_CHARS + 1).removesuffix("\n") if p == "-" else p for p in ns.prompts]

    _check_runner(ns)
    _sampling_params(ns)  # (a bad flag is named before the model loads)
    if ns.chat is False:  # (--no-chat: known before the model loads)
        _check_no_chat_flags(ns)
    llm = LLM.from_engine(_build_engine(ns, len(ns.prompts)))
    engine = llm.llm_engine
    params = _sampling_params(ns, engine.sampling_defaults())
    use_chat = ns.chat
    if use_chat is None:
        use_chat = engine.chat_template is not None
    if use_chat:
        if any(not p for p in ns.prompts):
            raise ValueError("a prompt is empty")
        prompts: list[Any] = [engine.encode_chat(_conversation(ns.system, p)) for p in ns.prompts]
    else:
        _check_no_chat_flags(ns)
        prompts = list(ns.prompts)
    if ns.show_blocks:
        engine.keep_busiest_snapshot()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(ns.prompts, outputs, strict=True)):
        if len(outputs) > 1:
            print(("\n" if i else "") + f"[{i}] {prompt}\n" + "-" * 40)
        print(out.outputs[0].text)
    if ns.show_blocks:
        from pagedserve.core.snapshot import render_block_pool

        assert engine.busiest_snapshot is not None
        print(f"\nKV block pool at the busiest step (KV usage {100 * engine.busiest_usage:.0f}%):")
        print(render_block_pool(engine.busiest_snapshot))
        print("\nKV block pool at the end (finished requests' blocks stay cached for reuse):")
        print(render_block_pool(engine.snapshot(full=True)))


def _conversation(system: str | None, user: str) -> list[dict[str, str]]:
    conv = [{"role": "system", "content": system}] if system is not None else []  # ('': an empty one)
    return conv + [{"role": "user", "content": user}]


def _check_runner(ns: argparse.Namespace) -> None:
    """generate and chat make text: another runner (--runner, or vLLM's --task) is refused
    before the model loads (it loaded, each prompt was refused, and chat's exit status was 0)."""
    runner = EngineArgs.from_cli_args(ns).runner
    if runner not in (None, "generate"):
        raise ValueError(f"{ns.command} generates text: --runner {runner} serves embeddings or scores "
                         f"(pagedserve serve --runner {runner})")


def _read_turn() -> str:
    """The next line of the conversation; the `>>> ` prompt goes to the terminal, or to
    standard error when standard output is not one (a piped chat's output is its answers)."""
    if sys.stdout.isatty():
        return input(">>> ")
    print(">>> ", end="", file=sys.stderr, flush=True)
    return input()


class ChatSession(Protocol):
    """One conversation of `chat`, here or with a server (entrypoints/remote_chat.py)."""

    def clear(self) -> None:
        """Start over (the system message stays)."""

    def turn(self, text: str, write: Callable[[str], object]) -> None:
        """Answer `text`, writing the answer's pieces as they come; a ValueError when it
        is refused (the turn is then forgotten)."""


def _write(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def chat_loop(session: ChatSession, banner: str) -> tuple[int, int]:
    """The terminal loop of both chats: /clear starts over, /exit (or Ctrl-D) quits, a
    refused turn is said on standard error.  Returns (turns, turns refused)."""
    print(banner, file=sys.stderr)
    turns = refused = 0
    while True:
        try:
            text = _read_turn()  # (the line as typed, its spaces kept: as the server or LLM.chat would get it)
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return turns, refused
        if text.strip() in ("/exit", "/quit"):
            return turns, refused
        if text.strip() == "/clear":
            session.clear()
            continue
        if not text.strip():
            continue
        turns += 1
        try:
            session.turn(text, _write)
        except ValueError as e:
            refused += 1
            print(f"error: {e} (try /clear)", file=sys.stderr)
            continue
        print()


class LocalChat:
    """`chat`'s conversation with the engine in this process (ChatSession)."""

    def __init__(self, engine: Any, params: Any, system: str | None) -> None:
        self.engine, self.params = engine, params
        self.base = [{"role": "system", "content": system}] if system is not None else []
        self.history = list(self.base)
        self.count = 0

    def clear(self) -> None:
        self.history = list(self.base)

    def turn(self, text: str, write: Callable[[str], object]) -> None:
        from pagedserve.sampling_params import RequestOutputKind

        messages = [*self.history, {"role": "user", "content": text}]
        rid = f"chat-{self.count}"
        self.count += 1
        self.engine.add_request(rid, self.engine.encode_chat(messages), self.params, output_kind=RequestOutputKind.DELTA)
        reply = []
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    reply.append(out.outputs[0].text)
                    write(reply[-1])
        except KeyboardInterrupt:  # (the answer so far stays in the conversation)
            self.engine.abort_request(rid)
        self.history = [*messages, {"role": "assistant", "content": "".join(reply)}]


def cmd_chat_remote(ns: argparse.Namespace) -> None:
    """`chat --url`: the conversation with a running server (entrypoints/remote_chat.py)."""
    from dataclasses import fields

    from pagedserve.entrypoints.remote_chat import NEUTRAL_SAMPLING, RemoteChat, api_key, request_sampling

    local = [f.name for f in fields(EngineArgs) if f.name != "seed" and getattr(ns, f.name, None) is not None]
    local += list(vllm_flags_given(ns))  # (vLLM's spellings: -pp, --task, --hf-overrides... were dropped)
    if local or ns.max_num_seqs is not None or ns.torch_compile is not None:
        raise ValueError(f"--{(local or ['max_num_seqs'])[0].replace('_', '-')} sets up a model here; with --url "
                         "the server's model answers")
    flags = {**NEUTRAL_SAMPLING, **ns.own_sampling, **_given_sampling(ns), "seed": ns.seed}
    settle_start_up_heap()
    chat = RemoteChat(ns.url, ns.model_name, api_key(ns.api_key), request_sampling(flags), ns.system)
    if ns.quick is not None:  # (one answer, and done; a refusal is the command's error)
        chat.turn(ns.quick, _write)
        print()
        return
    _check_turns(*chat_loop(chat, f"pagedserve chat with {chat.model} at {chat.url}: /clear starts over, /exit or "
                                  "Ctrl-D quits."))


def _check_turns(turns: int, refused: int) -> None:
    """A chat's end: an error where turns were refused, so a script piping turns in learns
    that some were not answered (the server's chat exited 0 where the local one did not)."""
    if refused:
        raise ValueError(f"{refused} of {turns} turns refused")


def cmd_chat(ns: argparse.Namespace) -> None:
    if ns.url is not None:
        return cmd_chat_remote(ns)
    if ns.model_name is not None or ns.api_key is not None or ns.quick is not None:
        raise ValueError("--model-name, --api-key and --quick talk to a server: give its --url")
    _check_runner(ns)
    _sampling_params(ns)  # (a bad flag is named before the model loads)
    engine = _build_engine(ns, 1)
    chat = LocalChat(engine, _sampling_params(ns, engine.sampling_defaults()), ns.system)
    _check_turns(*chat_loop(chat, "pagedserve chat: type a message; /clear starts over, /exit or Ctrl-D quits."))


def _version() -> str:
    from pagedserve import __version__

    return __version__


def _split_global_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the global options before the command, the command and its arguments): `serve`
    and `bench NAME` parse their own arguments, so they are handed what follows the
    global options (with `--log-level` before them, they were taken for empty commands)."""
    i = 0
    while i < len(argv) and argv[i].startswith("--log-level"):
        i += 1 if "=" in argv[i] else 2
    return argv[:i], argv[i:]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    options, command = _split_global_options(argv)
    parser = build_parser()
    if options:  # (checked, and the level set, before a delegated command runs; alone, argparse's own errors)
        _configure_logging(parser.parse_args([*options, "chat"] if command else options).log_level)
    if _delegate(command):
        return
    ns = parser.parse_args(argv)
    _configure_logging(ns.log_level)
    try:
        if ns.command == "generate":
            cmd_generate(ns)
        elif ns.command == "chat":
            cmd_chat(ns)
        else:  # (serve and bench NAME ran above: here only without a benchmark's name)
            parser.error(f"{ns.command}: nothing to run")
    except (ValueError, FileNotFoundError) as e:
        _exit_with(f"pagedserve {ns.command}", e)
    except KeyboardInterrupt:  # Ctrl-C while loading or generating: stop as a shell command does, no traceback
        print(file=sys.stderr)
        sys.exit(128 + signal.SIGINT)


def _configure_logging(level: str) -> None:
    """The log on standard error at `level`; httpx's line per HTTP request only at debug
    (`chat --url` printed one between every question and its answer)."""
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.DEBUG if level.upper() == "DEBUG" else logging.WARNING)


def _exit_with(command: str, e: Exception) -> None:
    """Bad flags or input: one line naming the problem (a traceback would only hide it);
    --log-level debug shows where it was raised, for the error that is a bug."""
    logging.getLogger("pagedserve").debug("%s failed", command, exc_info=e)
    sys.exit(f"{command}: error: {e}")


def run() -> None:
    """The `pagedserve` command: `main`, then an exit that skips the garbage collector's
    passes over every object torch and the model made.  Python's shutdown clears modules
    in phases with a full collection after each, ~0.65 s of every command with torch
    imported (Zen 4, AVX-512 with native bf16), more than generating an answer takes.
    Frozen objects are still freed as their modules are cleared; only cycles wait for
    the process to end.  (Not in `main`: tests call that within one long process.)"""
    atexit.register(_quiet_finalization)  # (first registered: runs after every other exit handler)
    pause_collector()  # until the command has started (settle_start_up_heap: utils.py says why)
    try:
        main()
    finally:
        gc.freeze()


def _quiet_finalization() -> None:
    """Run last at exit (registered before the command runs): later output is the
    interpreter's teardown alone, where Triton's bindings (nanobind; torch imports triton)
    count the objects still alive and print each kind, ~27 lines of "nanobind: leaked ..."
    after every command, because the frozen objects are never collected."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)


if __name__ == "__main__":
    run()
