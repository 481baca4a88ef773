"""`kvflow serve [MODEL]`: the OpenAI-compatible HTTP server (kvflow/entrypoints/openai/).

The port is bound before the model loads, so a port in use fails at once; the server is ready when
`GET /health` answers 200. SIGINT or SIGTERM stop it with status 0 once requests in flight have ended
(finish_reason "abort") and the engine has shut down.

`--api-server-count N` (N > 1) runs N API server processes on the one port in front of shared engine cores
(`kvflow.entrypoints.openai.api_servers`); this process then supervises them.

On CPU the API server and the engine's OpenMP team share the cores, so the server has OpenMP threads sleep while
they wait (`OMP_WAIT_POLICY=PASSIVE`, `kvflow.utils.openmp_threads_sleep_while_waiting`) unless the environment
sets `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket

from kvflow.entrypoints.cli.args import LOGGING_EPILOG, HelpFormatter
from kvflow.entrypoints.cli.config_file import CONFIG_FILE_DESTS, add_config_file_argument
from kvflow.entrypoints.cli.engine import CommandError, make_async_llm
from kvflow.entrypoints.openai.server_chat_template import load_server_chat_template
from kvflow.entrypoints.openai.server_config import (
    REQUEST_TEMPLATE_TIMEOUT_S,
    RUNTIME_LORA_UPDATING_ENVS,
    CORSConfig,
    ServerConfig,
    ServingLimits,
    parse_json_string_list,
    parse_lora_module,
    runtime_lora_updating_from_env,
)
from kvflow.entrypoints.openai.tool_parsers import TOOL_PARSERS
from kvflow.utils import openmp_threads_sleep_while_waiting

logger = logging.getLogger(__name__)

API_KEY_ENV = "KVFLOW_API_KEY"
LISTEN_BACKLOG = 2048  # uvicorn's default
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

DESCRIPTION = """\
Serve MODEL over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions,
/v1/models), as vLLM's server does, plus /health, /version, /metrics (Prometheus),
/tokenize, /detokenize and /is_paused. Point any OpenAI or vLLM client at
http://HOST:PORT/v1.

MODEL is a Hugging Face checkpoint folder; without it, the built-in default model
(a small English model kvflow ships); 'hash' is the deterministic test model (token-id
prompts only)."""

EPILOG = f"""\
admin endpoints (--enable-admin-endpoints), for RL trainers:
  POST /pause, /resume, /reset_prefix_cache, /abort_requests, /update_weights,
  /collective_rpc, GET /weight_version

LoRA adapters (--enable-lora): --lora-modules NAME=PATH ... serves each PEFT adapter
folder as model NAME; with --enable-runtime-lora-updating (or
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}

{LOGGING_EPILOG}"""


def add_parser(subcommands: argparse._SubParsersAction) -> None:
    from kvflow.engine.arg_utils import EngineArgs

    parser = subcommands.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint folder or 'hash' (same as --model); default: the built-in default model",
    )
    add_config_file_argument(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    server.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every path except /health, /metrics and "
        f"/version; default: ${API_KEY_ENV} if set",
    )
    server.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send; default: MODEL as given ('default' for the built-in model)",
    )
    server.add_argument(
        "--enable-admin-endpoints",
        action="store_true",
        help="also serve the admin endpoints listed below (pause and resume among them)",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render chat templates sent in requests ('chat_template'), in a sandbox process with a "
        f"{REQUEST_TEMPLATE_TIMEOUT_S:g} s time limit; without it they are refused (400)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the server's chat template: a Jinja file, the template itself, or the name of one of the "
        "checkpoint's templates (a value that is none of these is an error at startup); default: the "
        "checkpoint's. A request's own 'chat_template' still wins (see --trust-request-chat-template)",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="take tool_choice 'auto' (the default for requests with tools): the model writes freely and "
        "--tool-call-parser extracts its calls ('required' and named functions work without either)",
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_PARSERS.names(),
        help="how tool calls are written in this model's replies: hermes (Qwen2.5, Hermes, the built-in "
        "model's template), llama3_json, mistral or pythonic",
    )
    server.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters to serve (needs --enable-lora): each a PEFT adapter folder served as model NAME, "
        'given as NAME=PATH or as JSON \'{"name": NAME, "path": PATH, "base_model_name": BASE}\' (BASE: the '
        "card's parent in /v1/models; default: the served model name). Each is loaded before the server serves",
    )
    server.add_argument(
        "--enable-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora; 404 "
        f"without); also turned on by {' or '.join(RUNTIME_LORA_UPDATING_ENVS)}=1, as in vLLM",
    )
    server.add_argument(
        "--max-stored-responses",
        type=_positive_int,
        default=ServerConfig.max_stored_responses,
        metavar="N",
        help="responses of /v1/responses kept in memory (GET /v1/responses/{id}, previous_response_id); "
        "past N the least recently used is forgotten",
    )
    server.add_argument(
        "--timeout-keep-alive",
        type=_positive_float,
        default=ServerConfig.timeout_keep_alive_s,
        metavar="SECONDS",
        help="close a kept-alive connection idle this long (longer than clients' own idle expiry, so a "
        "client never reuses a connection as the server closes it)",
    )
    _add_cors_arguments(parser)
    limits = parser.add_argument_group(
        "request limits", "each exceeded is a 400 naming the field (413 for the body)"
    )
    defaults = ServingLimits()
    for flag, name, what in _LIMIT_FLAGS:
        limits.add_argument(
            flag,
            type=_positive_int,
            default=getattr(defaults, name),
            metavar="N",
            dest=name,
            help=what,
        )
    server.add_argument(
        "--api-server-count",
        type=_positive_int,
        default=1,
        metavar="N",
        help="API server processes sharing the port and the engine core(s): each runs the HTTP server, "
        "tokenizer and output processing for the connections it accepts. Raise it when one process's CPU "
        "limits throughput (many concurrent streams); needs the engine core in its own process",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default="warning",
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's log level; 'info' adds its access log",
    )
    EngineArgs.add_cli_args(parser, exclude=("engine_process",))
    parser.add_argument(  # the server runs the engine core in its own process by default
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in its own process",
    )
    parser.set_defaults(handler=run_serve)


_LIMIT_FLAGS = (
    ("--max-n", "max_n", "most samples per request (n, best_of)"),
    ("--max-prompts-per-request", "max_prompts", "most prompts in one /v1/completions request"),
    ("--max-stop-strings", "max_stop_strings", "most stop strings per request"),
    ("--max-stop-string-chars", "max_stop_string_chars", "longest stop string (characters)"),
    ("--max-logit-bias", "max_logit_bias", "most logit_bias entries (OpenAI's limit)"),
    ("--max-request-body-bytes", "max_request_body_bytes", "largest request body"),
    (
        "--max-stream-buffer-bytes",
        "max_stream_buffer_bytes",
        "bytes of a stream that may wait for a client that does not read; past them the request is "
        "aborted and its KV cache and slot are freed",
    ),
)


def _add_cors_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags, except that CORS is off until --allowed-origins names who may call."""
    cors = parser.add_argument_group(
        "CORS",
        "which browser pages may call the server; without --allowed-origins, none (no CORS headers)",
    )
    cors.add_argument(
        "--allowed-origins",
        type=_json_string_list,
        default=None,
        metavar="JSON",
        help="origins whose pages may call the server, as a JSON list: '[\"https://app.example\"]', or "
        "'[\"*\"]' for any",
    )
    cors.add_argument(
        "--allowed-methods",
        type=_json_string_list,
        default=None,
        metavar="JSON",
        help="HTTP methods those pages may use (JSON list); default with --allowed-origins: '[\"*\"]'",
    )
    cors.add_argument(
        "--allowed-headers",
        type=_json_string_list,
        default=None,
        metavar="JSON",
        help="request headers those pages may send (JSON list); default with --allowed-origins: "
        "'[\"*\"]'",
    )
    cors.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let those pages send cookies and HTTP authentication; with '*' origins the answer names "
        "the page's own origin (browsers refuse '*' with credentials), so any site may",
    )


def _json_string_list(text: str) -> tuple[str, ...]:
    try:
        return parse_json_string_list(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def run_serve(args: argparse.Namespace) -> None:
    resolve_model(args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CommandError(
            "--enable-auto-tool-choice needs --tool-call-parser NAME (how this model writes its calls: "
            f"{', '.join(TOOL_PARSERS.names())})"
        )
    _check_lora_flags(args)
    _check_cors_flags(args)
    if args.api_server_count > 1 and not args.engine_process:
        raise CommandError(
            f"--api-server-count {args.api_server_count} needs the engine core in its own process (shared by "
            "the API servers): drop --no-engine-process"
        )
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as error:
        raise CommandError(
            f"cannot listen on {args.host}:{args.port}: {error.strerror or error}"
        ) from error
    # After the port is ours (a port in use fails with one line) and before anything starts OpenMP.
    if openmp_threads_sleep_while_waiting():
        logger.info(
            "OpenMP threads sleep while they wait (OMP_WAIT_POLICY=PASSIVE): the API server shares the "
            "cores with the engine; set OMP_WAIT_POLICY=ACTIVE to have them spin"
        )
    try:
        config = _server_config(args)
        if args.api_server_count > 1:
            from kvflow.entrypoints.openai.api_servers import run_api_servers

            run_api_servers(args, config, sock)
        else:
            _serve_in_this_process(args, config, sock)
    finally:
        sock.close()


def resolve_model(args: argparse.Namespace) -> None:
    """Sets `args.model` from MODEL when given: CommandError if --model on the command line names another; a
    `model` from the --config file yields to MODEL, as in vLLM."""
    if args.model_tag is None:
        return
    model_from_file = "model" in getattr(args, CONFIG_FILE_DESTS, ())
    if args.model is not None and args.model != args.model_tag and not model_from_file:
        raise CommandError(
            f"MODEL {args.model_tag!r} and --model {args.model!r} disagree: give one"
        )
    args.model = args.model_tag


def _check_lora_flags(args: argparse.Namespace) -> None:
    """The server's LoRA flags need the engine's `--enable-lora`; runtime updating needs one API server process
    (each process keeps its own adapter names, so an adapter loaded through one would be unknown to the others).
    Sets `args.enable_runtime_lora_updating` when one of `RUNTIME_LORA_UPDATING_ENVS` turns it on."""
    try:
        modules = [parse_lora_module(text) for text in args.lora_modules or ()]
        from_env = runtime_lora_updating_from_env()
    except ValueError as error:
        raise CommandError(str(error)) from error
    args.lora_modules = modules
    if modules and not args.enable_lora:
        raise CommandError(
            "--lora-modules needs --enable-lora (the engine serves no adapters without it)"
        )
    what = "--enable-runtime-lora-updating"
    if not args.enable_runtime_lora_updating and from_env is not None:
        what = f"{from_env}={os.environ[from_env]}"
        args.enable_runtime_lora_updating = True
    if args.enable_runtime_lora_updating and not args.enable_lora:
        raise CommandError(f"{what} needs --enable-lora (the engine serves no adapters without it)")
    if args.enable_runtime_lora_updating and args.api_server_count > 1:
        raise CommandError(
            f"{what} needs a single API server process (--api-server-count {args.api_server_count}): each "
            "process keeps its own adapter names, so an adapter loaded through one would be unknown to the "
            "others; register adapters at startup with --lora-modules instead"
        )


def _check_cors_flags(args: argparse.Namespace) -> None:
    """The other CORS flags say what the origins of --allowed-origins may do: without it (CORS off, unlike vLLM
    whose default is any origin) they would silently do nothing."""
    if args.allowed_origins is not None:
        return
    given = [
        flag
        for flag, value in (
            ("--allowed-methods", args.allowed_methods),
            ("--allowed-headers", args.allowed_headers),
            ("--allow-credentials", args.allow_credentials or None),
        )
        if value is not None
    ]
    if given:
        raise CommandError(
            f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --allowed-origins: kvflow sends "
            "no CORS headers until it names the origins that may call (vLLM's default is '[\"*\"]': give "
            "--allowed-origins '[\"*\"]' for the same)"
        )


def _cors_config(args: argparse.Namespace) -> CORSConfig | None:
    if args.allowed_origins is None:
        return None
    return CORSConfig(
        allowed_origins=args.allowed_origins,
        allowed_methods=("*",) if args.allowed_methods is None else args.allowed_methods,
        allowed_headers=("*",) if args.allowed_headers is None else args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )


def _server_config(args: argparse.Namespace) -> ServerConfig:
    from kvflow.entrypoints.openai.serving_models import DEFAULT_MODEL_NAME

    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model or DEFAULT_MODEL_NAME,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        enable_admin_endpoints=args.enable_admin_endpoints,
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_stored_responses=args.max_stored_responses,
        limits=ServingLimits(**{name: getattr(args, name) for _, name, _ in _LIMIT_FLAGS}),
        lora_modules=tuple(args.lora_modules),
        enable_runtime_lora_updating=args.enable_runtime_lora_updating,
        timeout_keep_alive_s=args.timeout_keep_alive,
        uvicorn_log_level=args.uvicorn_log_level,
        cors=_cors_config(args),
    )


def _serve_in_this_process(
    args: argparse.Namespace, config: ServerConfig, sock: socket.socket
) -> None:
    """One API server: this process (the engine core in its own process unless --no-engine-process)."""
    # The server's modules import torch and FastAPI (seconds): only once the port is ours.
    from kvflow.entrypoints.openai.api_server import run_server
    from kvflow.entrypoints.openai.metrics import PrometheusStatLogger

    if (
        args.engine_process or args.data_parallel_size > 1
    ):  # data-parallel cores always run in processes
        import torch

        torch.set_num_threads(
            1
        )  # the API process runs no torch compute: leave the cores to the engine
    stat_logger = PrometheusStatLogger(
        config.served_model_name,
        num_engines=args.data_parallel_size,
        max_loras=args.max_loras if args.enable_lora else None,
    )
    engine = make_async_llm(args, stat_loggers=[stat_logger])
    try:
        config = dataclasses.replace(
            config, chat_template=load_server_chat_template(args.chat_template, engine)
        )
        run_server(engine, config, stat_logger, sock)
    finally:
        engine.shutdown()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (port 0: a free one) and listening, taken before anything loads so that a
    port in use fails at once. Listening now, not once the model has loaded, is what makes the port ours: on Linux
    two sockets with SO_REUSEADDR may both bind one port as long as neither listens, so two servers started at
    the same moment would both get past a bind. Connections made before the server is ready wait in the backlog.
    OSError if it cannot be bound."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock
