"""`kvflow serve --api-server-count N` (N > 1): N API server processes in front of shared engine cores.

    kvflow serve (the launcher: binds the port, starts and supervises everything, serves nothing itself)
      ├─ engine-core process per data-parallel rank (kvflow-engine-<rank>), each serving the N API servers
      └─ API server process i (kvflow-api-<i>), i < N: the whole FastAPI app with its own AsyncLLM front end
         (tokenizer, input and output processors, streams) attached to every engine core; it accepts connections
         on the launcher's listening socket, inherited, so the kernel hands each connection to one of them

Each request is served by the API process that accepted its connection: the engine cores send its outputs there
only, and every call's answer to the process that called (`kvflow.engine.core_proc`). With several engine cores,
each API process balances its own requests over them by least load. Pause, resume, is_paused,
reset_prefix_cache, update_weights and collective_rpc act on the shared cores, so every process's requests and
answers agree; `/abort_requests` aborts what any process runs (`rl.RLControl`). `/metrics` from any process shows
every process's samples (prometheus_client's multiprocess mode in a private folder, see `metrics.py`).
LoRA adapters given with `--lora-modules` are registered by every API process under the same names and ids (1, 2,
... in the order given), so any process resolves a request's `model` to the same adapter; runtime loading
(`--enable-runtime-lora-updating`) is refused with several API processes (`kvflow serve` says so at startup): each
process keeps its own adapter names, and an adapter loaded through one would be unknown to the others.

Lifecycle: the launcher starts the engine cores and waits for their handshakes, then the API processes, and
announces the address once every one serves. SIGINT or SIGTERM to the launcher stop the API processes (their
requests in flight end with finish_reason "abort"), then the engine cores; it exits with status 0. An API process
that exits on its own makes the launcher stop everything and exit non-zero. An engine core that exits on its own is
a dead engine for every API process, as with one API process: `/health` answers 503, streams in flight get the
error event, new requests 503; the launcher stops the other engine cores and keeps the API processes answering
until it is stopped. API processes and engine cores get SIGTERM from the kernel if the launcher dies
(`PR_SET_PDEATHSIG`; the engine cores also watch their parent), so none outlives it.

The launcher logs every process's pid, and each process names itself (`/proc/<pid>/comm`): a benchmark can sum
the CPU time of the processes named `kvflow-api-*` among the launcher's children.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from kvflow.engine.process_names import die_with_parent, set_process_name, stop_processes
from kvflow.entrypoints.cli.engine import CommandError
from kvflow.entrypoints.openai.server_chat_template import load_server_chat_template

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from kvflow.engine.shared_engines import EngineAttachment, SharedEngines
    from kvflow.entrypoints.openai.server_config import ServerConfig

logger = logging.getLogger(__name__)

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# How long an API process may take to end its responses after SIGTERM before it is killed.
API_SERVER_STOP_TIMEOUT_S = 20.0
_READY = "ready"
# An API process that exits on its own this soon before the launcher's own stop signal was stopped by it too
# (Ctrl-C signals the whole process group).
_STOP_SIGNAL_GRACE_S = 1.0


def run_api_servers(args: argparse.Namespace, config: ServerConfig, sock: socket.socket) -> None:
    """Serve with `args.api_server_count` API processes on `sock` (bound and listening) until SIGINT / SIGTERM;
    CommandError if an API process exits on its own or cannot start (everything is stopped first)."""
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.engine.builder import resolve_engine_config
    from kvflow.engine.shared_engines import SharedEngines

    num_api_servers = args.api_server_count
    metrics_dir = tempfile.mkdtemp(prefix="kvflow-metrics-")
    os.environ[METRICS_DIR_ENV] = metrics_dir  # inherited by the API processes, read as they import
    stop_reader, stop_writer = os.pipe()
    previous = _catch_stop_signals(stop_writer)
    engines: SharedEngines | None = None
    api_servers: list[BaseProcess] = []
    try:
        model_info, engine_config = resolve_engine_config(EngineArgs.from_cli_args(args))
        engines = SharedEngines(engine_config, model_info, args.data_parallel_size, num_api_servers)
        engines.start()
        context = multiprocessing.get_context("spawn")
        readers: list[Connection] = []
        for index in range(num_api_servers):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(
                target=serve_api_process,
                args=(index, args, config, sock, engines.attachments(index), writer),
                name=f"kvflow-api-{index}",
            )
            process.start()
            writer.close()
            readers.append(reader)
            api_servers.append(process)
            logger.info("started API server %d: pid %d", index, process.pid)
        if not _wait_until_serving(api_servers, readers, stop_reader):
            return
        logger.info(
            "kvflow serve: model %r at http://%s (OpenAI API under /v1; %d API servers, pids %s; engine "
            "cores, pids %s)",
            config.served_model_name,
            _display_address(config.host, sock.getsockname()[1]),
            num_api_servers,
            [process.pid for process in api_servers],
            engines.pids,
        )
        _supervise(api_servers, engines, stop_reader)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop_api_servers(api_servers)
        if engines is not None:
            engines.stop()
        os.environ.pop(METRICS_DIR_ENV, None)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        os.close(stop_reader)
        os.close(stop_writer)
        logger.info("kvflow serve stopped")


def _catch_stop_signals(stop_writer: int) -> dict[int, object]:
    """SIGINT / SIGTERM write to the stop pipe (the launcher then stops everything); returns the previous
    handlers."""
    previous: dict[int, object] = {}

    def handle(signum: int, frame: object) -> None:
        os.write(stop_writer, b"x")

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handle)
    return previous


def _wait_until_serving(
    api_servers: list[BaseProcess], readers: list[Connection], stop_reader: int
) -> bool:
    """Wait until every API process serves; False when asked to stop first. CommandError if one exits."""
    waiting = dict(zip(readers, api_servers, strict=True))
    sentinels = {process.sentinel: process for process in api_servers}
    while waiting:
        ready = wait([*waiting, *sentinels, stop_reader])
        if stop_reader in ready:
            return False
        for each in ready:
            if each in waiting:
                with contextlib.suppress(EOFError):
                    each.recv()  # EOFError: it exited before saying so; its sentinel tells
                    del waiting[each]  # type: ignore[arg-type]
            elif each in sentinels:
                raise _exited(sentinels[each], "while starting")
    return True


def _supervise(api_servers: list[BaseProcess], engines: SharedEngines, stop_reader: int) -> None:
    """Serve until SIGINT / SIGTERM; CommandError once an API process exits on its own. An engine core that
    exits on its own: the others are stopped, the API processes answer 503 until the launcher is stopped."""
    api_sentinels = {process.sentinel: process for process in api_servers}
    engine_sentinels = {process.sentinel: process for process in engines.processes}
    while True:
        ready = wait([stop_reader, *api_sentinels, *engine_sentinels])
        if stop_reader in ready:
            return
        for each in ready:
            if each in api_sentinels:
                if wait([stop_reader], _STOP_SIGNAL_GRACE_S):  # Ctrl-C reached the whole group
                    return
                raise _exited(api_sentinels[each], "while serving")
            if each in engine_sentinels:
                process = engine_sentinels.pop(each)  # type: ignore[arg-type]
                process.join()
                logger.error(
                    "engine core process %d exited on its own (exit code %s): the API servers answer 503; "
                    "stopping the other engine cores",
                    process.pid,
                    process.exitcode,
                )
                engines.stop()
                engine_sentinels.clear()


def _exited(process: BaseProcess, when: str) -> CommandError:
    process.join()
    return CommandError(
        f"API server process {process.pid} ({process.name}) exited {when} (exit code "
        f"{process.exitcode}); stopped the server (its log above says why)"
    )


def _stop_api_servers(api_servers: list[BaseProcess]) -> None:
    """SIGTERM every API process (each ends its requests in flight and detaches from the engine cores), then
    SIGKILL those still running past `API_SERVER_STOP_TIMEOUT_S`."""
    stop_processes(api_servers, API_SERVER_STOP_TIMEOUT_S, "API server")


def _display_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------------------------------------- API process
def serve_api_process(
    index: int,
    args: argparse.Namespace,
    config: ServerConfig,
    sock: socket.socket,
    attachments: list[EngineAttachment],
    ready: Connection,
) -> None:
    """The target of API server process `index`: the app of `kvflow serve` on the inherited `sock`, its front
    end attached to the shared engine cores; says `ready` once it serves. Exits with status 2 (and one logged
    line) when it cannot start for a reason the user can fix."""
    set_process_name(f"kvflow-api-{index}")
    die_with_parent()
    logger.info("API server %d: pid %d", index, os.getpid())
    try:
        _serve(index, args, config, sock, attachments, ready)
    except (CommandError, ValueError, OSError) as error:
        logger.error("API server %d could not serve: %s", index, error)
        raise SystemExit(2) from None


def _serve(
    index: int,
    args: argparse.Namespace,
    config: ServerConfig,
    sock: socket.socket,
    attachments: list[EngineAttachment],
    ready: Connection,
) -> None:
    import torch

    from kvflow.engine.shared_engines import attached_engines
    from kvflow.entrypoints.cli.engine import make_async_llm
    from kvflow.entrypoints.openai.api_server import run_server
    from kvflow.entrypoints.openai.metrics import PrometheusStatLogger

    torch.set_num_threads(1)  # the API process runs no torch compute: leave the cores to the engine
    stat_logger = PrometheusStatLogger(
        config.served_model_name,
        num_engines=args.data_parallel_size,
        multiprocess=True,
        counts_scheduler_totals=index == 0,
        max_loras=args.max_loras if args.enable_lora else None,
    )
    with attached_engines(attachments):
        engine = make_async_llm(args, stat_loggers=[stat_logger])
    try:
        config = dataclasses.replace(
            config, chat_template=load_server_chat_template(args.chat_template, engine)
        )

        def on_started() -> None:
            logger.info("API server %d (pid %d) serving", index, os.getpid())
            ready.send(_READY)
            ready.close()

        run_server(engine, config, stat_logger, sock, api_server_index=index, on_started=on_started)
    finally:
        engine.shutdown()
        sock.close()
