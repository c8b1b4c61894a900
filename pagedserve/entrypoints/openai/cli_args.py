"""The command line of `pagedserve serve` (vLLM's cli_args.py): the server's flags, vLLM's
server flags (honoured, or taken at the value that asks for what this server does
anyway, or refused with the reason), every EngineArgs flag, and vLLM's `--config FILE`
(a YAML file of flags, the command line's own winning)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pagedserve.engine.arg_spellings import json_argument
from pagedserve.entrypoints.openai.model_sources import add_model_pool_args
from pagedserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedserve.entrypoints.openai.server_state import DEFAULT_HTTP_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of `pagedserve serve`: the server's own, then every EngineArgs flag."""
    from pagedserve.engine.arg_utils import DEFAULT_MODEL, EngineArgs

    parser.add_argument("model_tag", nargs="*", default=None, metavar="MODEL",
                        help="model(s) to serve: registered names, HF directories, Hub ids in the local cache, "
                             f"GGUF files; the first is the default (same as --model; default: {DEFAULT_MODEL})")
    group = parser.add_argument_group("server arguments")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (or x-api-key) on every route but /health, /ping "
                            "and the dashboard page, /metrics too unless --metrics-without-auth (vLLM guards /v1/* only; "
                            "default: $PAGEDSERVE_API_KEY, else vLLM's $VLLM_API_KEY, else none)")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients use in the 'model' field (default: the MODEL argument)")
    group.add_argument("--log-stats-interval", type=float, default=10.0,
                       help="seconds between throughput log lines (default: 10)")
    group.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    group.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                       help="the format the model writes tool calls in, for tool_choice 'auto' (vLLM's names: "
                            "hermes for Qwen2.5/3, llama3_json for Llama 3.x, pythonic for Llama 3.2 and 4's [f(x=1)])")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="vLLM's switch for tool_choice 'auto', which is on here whenever a tool-call format is "
                            "known (--tool-call-parser, else llama3_json or hermes by the vocabulary)")
    group.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                       help="split a thinking model's <think>...</think> into reasoning_content (vLLM's names: "
                            "qwen3 for Qwen3, deepseek_r1 for DeepSeek-R1 and its distills)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served by name, as name=path or a JSON object "
                            "with name, path and base_model_name (needs --enable-lora)")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key; "
                            "vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)")
    group.add_argument("--enable-responses-store", action="store_true",
                       help="keep /v1/responses answers (at most 1,000 and 64 MiB, oldest out first) for "
                            "GET /v1/responses/{id} and previous_response_id (vLLM: VLLM_ENABLE_RESPONSES_API_STORE)")
    group.add_argument("--metrics-without-auth", action="store_true",
                       help="serve /metrics without the API key (for a Prometheus scraper)")
    group.add_argument("--allowed-origins", type=json_argument, default=None, metavar="JSON",
                       help='CORS: origins a browser page may call from, e.g. \'["https://app.example"]\' '
                            "(vLLM's flag; default: none, where vLLM's is every origin)")
    group.add_argument("--allowed-methods", type=json_argument, default=["*"], metavar="JSON",
                       help="CORS: methods allowed (default: all)")
    group.add_argument("--allowed-headers", type=json_argument, default=["*"], metavar="JSON",
                       help="CORS: request headers allowed (default: all)")
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="refuse new requests with 503 and Retry-After while this many wait for a slot "
                            "(default: no limit)")
    group.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may run; a longer one is aborted, its blocks freed, and its "
                            "client gets a 408 or an error event (default: none)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds running requests get to finish before they are aborted "
                            "(default: 30)")
    group.add_argument("--max-request-bytes", default=str(DEFAULT_MAX_REQUEST_BYTES),
                       help="largest request body accepted; larger ones get 413 before they are parsed "
                            "(bytes, or with a unit: 16MiB; default: 16MiB)")
    group.add_argument("--http-read-timeout", type=float, default=DEFAULT_HTTP_READ_TIMEOUT,
                       help="seconds a client has to send a request's headers (the connection is closed after) "
                            f"and then its body (408) (default: {DEFAULT_HTTP_READ_TIMEOUT:g})")
    group.add_argument("--allowed-hosts", default=None,
                       help="comma-separated names and addresses the Host header may carry, '*' for any "
                            "(default: the --host address and localhost names; any when bound to 0.0.0.0 or ::), "
                            "so that a web page cannot reach the server by DNS rebinding")
    group.add_argument("--disable-dashboard", action="store_true",
                       help="do not serve the live dashboard and chat playground at / and /dashboard")
    add_model_pool_args(group)
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="answers carry an X-Request-Id header: the request's, else a new one (vLLM's flag; a "
                            "request's X-Request-Id names its answer's id either way)")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each generation request as it is accepted: its id, route and body, cut to "
                            "--max-log-len characters (vLLM's flag; prompts are not logged without it)")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="vLLM's older flag: requests are not logged unless --enable-log-requests")
    group.add_argument("--max-log-len", type=int, default=2000,
                       help="characters of a logged request body (--enable-log-requests; default: 2000)")
    group.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's own log level; info logs every request (default: warning)")
    _add_vllm_server_args(parser)
    EngineArgs.add_cli_args(parser)
    return parser


# vLLM's server flags for what this server does one way: the values that ask for that
# way (taken), and why any other cannot be (refused at start).  None as a kind: a
# switch without a value.
_FIXED_FLAGS: dict[str, tuple[Any, tuple[Any, ...], str]] = {
    "api_server_count": (int, (1,), "one API process serves every request here (--data-parallel-size adds "
                                    "engines)"),
    "response_role": (str, ("assistant",), "answers' role is assistant here"),
    "chat_template_content_format": (str, ("auto",), "content parts reach each template the way it reads them "
                                                     "(vLLM's auto)"),
    "return_tokens_as_token_ids": (None, (False,), "logprobs name tokens by their text here (chat's bytes are "
                                                   "each token's exact bytes)"),
    "enable_prompt_tokens_details": (None, (False, True), ""),  # (usage.prompt_tokens_details is always there)
}


def _add_vllm_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM's server arguments")
    group.add_argument("--config", default=None, metavar="FILE",
                       help="a YAML file of flags (key: value, as --key value; flags on the command line win)")
    group.add_argument("--root-path", default=None,
                       help="the path prefix a proxy serves this server under (ASGI root_path)")
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    group.add_argument("--ssl-certfile", default=None, help="...and this certificate (PEM)")
    group.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates must chain to")
    group.add_argument("--ssl-cert-reqs", type=int, default=0,
                       help="client certificates: 0 none, 1 optional, 2 required (Python's ssl.CERT_*)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="do not serve /docs, /redoc and /openapi.json")
    group.add_argument("--default-chat-template-kwargs", type=json_argument, default=None, metavar="JSON",
                       help="chat_template_kwargs every chat request gets, its own keys winning, e.g. "
                            "'{\"enable_thinking\": false}'")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load answers {\"server_load\": N}, the requests at work (generation and pooling "
                            "routes, from arrival to the answer's last byte)")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with a usage chunk, asked for or not")
    for name, (kind, _, _) in _FIXED_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        if kind is None:
            group.add_argument(flag, action="store_true", default=None)
        else:
            group.add_argument(flag, type=kind, default=None)


def check_vllm_server_args(args: argparse.Namespace) -> None:
    """vLLM's server flags the command line set, each checked (a ValueError naming it)."""
    if args.config is not None:  # (a second --config, or a namespace of parser.parse_args alone)
        raise ValueError("--config: give one config file (a second one, or one not read by cli_args.parse_args)")
    for name, (_, taken, why) in _FIXED_FLAGS.items():
        value = getattr(args, name)
        if value is not None and value not in taken:
            raise ValueError(f"--{name.replace('_', '-')} {value!r:.60} is not supported here: {why}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together (HTTPS needs both)")
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, name)
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--{name.replace('_', '-')}: no file {path!r:.200}")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    _check_tls(args)
    if args.default_chat_template_kwargs is not None and not isinstance(args.default_chat_template_kwargs, dict):
        raise ValueError("--default-chat-template-kwargs must be a JSON object")
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r:.100}")


def _check_tls(args: argparse.Namespace) -> None:
    """The TLS files loaded as uvicorn will load them (a file that is not PEM ended the
    start in uvicorn's traceback); client-certificate flags need HTTPS (they were ignored)."""
    import ssl

    if not args.ssl_keyfile:
        if args.ssl_ca_certs or args.ssl_cert_reqs:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS: give --ssl-keyfile and --ssl-certfile")
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:  # (an encrypted key is refused: there is no flag for its password, and it was asked on the terminal)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile, password=lambda: b"")
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile / --ssl-keyfile: not a PEM certificate and its unencrypted key ({e})") \
            from None
    try:
        if args.ssl_ca_certs:
            context.load_verify_locations(args.ssl_ca_certs)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-ca-certs: not PEM certificates ({e})") from None


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """`argv` parsed over a `--config FILE`'s flags: the command line's win (argparse
    gives a namespace's values defaults only where it has none)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv) or arg.startswith("--config="):
            path = argv[i + 1] if arg == "--config" else arg.split("=", 1)[1]
            rest = argv[:i] + argv[i + (2 if arg == "--config" else 1):]
            from_file = parser.parse_args(config_flags(parser, path))
            return parser.parse_args(rest, namespace=from_file)
    return parser.parse_args(argv)


# The flags of `serve` that take several values (nargs="+"): a YAML list gives each.
MULTI_VALUE_FLAGS = frozenset({"--served-model-name", "--lora-modules"})


def config_flags(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags a YAML file of `key: value` lines stands for: true is the switch (false:
    its --no- form where it has one, else nothing), a list gives each item, an object
    its JSON; `model` is the model argument."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: {e}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: the file must hold key: value lines")
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).replace("_", "-")
        if key == "config":
            parser.error(f"--config {path}: a config file cannot name another")
        if value is True:
            flags.append(flag)
        elif value is False:
            negated = "--no-" + flag[2:]
            if negated not in parser.parse_known_args([negated])[1]:  # (a switch without one: false is its default)
                flags.append(negated)
        elif isinstance(value, list) and flag in MULTI_VALUE_FLAGS:
            flags += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif value is not None:  # (a list or an object for any other flag: its JSON, --allowed-origins' say)
            flags += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return flags
