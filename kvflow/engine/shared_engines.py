"""Engine cores shared by several front-end processes (`kvflow serve --api-server-count N`).

    launcher (the `kvflow serve` process)
      SharedEngines.start ── spawns one engine-core process per data-parallel rank, each serving N clients, and
      │                      waits for each one's handshake on a socket of its own
      ├─ engine-core process r ── client i's sockets: ipc://<folder>/r<r>-c<i>-in / -out
      └─ API server process i ── attaches to every engine (an `EngineAttachment` per rank)

An attached front end (`MPEngineCoreClient` built with an `EngineAttachment`) binds its two sockets at the addresses
given and the engine connects to them (the engine connects to every client's addresses at startup; ZMQ queues what
it sends until the client binds, so the clients may attach in any order, after the engine is ready). It watches the
engine process, which is not its child, through a pidfd: an engine that exits is a dead engine there as anywhere.
It never stops the engine: shutting an attached client down detaches it; the launcher stops the engines (SIGTERM,
then SIGKILL) once every front end has stopped.

`attached_engines(attachments)` makes `kvflow.engine.builder.start_engine_core_client` attach to the given engines
instead of starting its own, for the engine built inside the `with` block (a context variable: nothing global).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from kvflow.engine.core_proc import (
    ENGINE_CORE_PROCESS_NAME,
    IPC_FOLDER_PREFIX,
    EngineCoreProcConfig,
    run_engine_core,
)
from kvflow.engine.messages import EngineReady, EngineStartupFailed, make_output_decoder
from kvflow.engine.placement import core_devices
from kvflow.engine.process_names import stop_processes

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from kvflow.config import EngineConfig
    from kvflow.model_info import ModelInfo

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0  # model loading included
STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class EngineAttachment:
    """How one front end reaches one running engine core: the engine's pid (watched, never signalled) and the
    addresses the front end binds (input: it sends there; output: it receives there)."""

    pid: int
    input_address: str
    output_address: str


_ATTACHMENTS: contextvars.ContextVar[tuple[EngineAttachment, ...] | None] = contextvars.ContextVar(
    "kvflow_engine_attachments", default=None
)


@contextlib.contextmanager
def attached_engines(attachments: list[EngineAttachment]) -> Iterator[None]:
    """Within the block, engines built by `start_engine_core_client` attach to these (one per data-parallel rank,
    in rank order) instead of starting engine-core processes of their own."""
    token = _ATTACHMENTS.set(tuple(attachments))
    try:
        yield
    finally:
        _ATTACHMENTS.reset(token)


def current_attachments() -> tuple[EngineAttachment, ...] | None:
    """The engines to attach to (see `attached_engines`), or None: start one's own."""
    return _ATTACHMENTS.get()


def client_addresses(ipc_dir: str, rank: int, client: int) -> tuple[str, str]:
    """The (input, output) addresses of front end `client` at engine `rank`."""
    stem = os.path.join(ipc_dir, f"r{rank}-c{client}")
    return f"ipc://{stem}-in", f"ipc://{stem}-out"


class SharedEngines:
    """The engine-core processes of a multi-front-end server, as the launcher holds them.

    Invariants: `processes[r]` is data-parallel rank r's engine, its own child, serving `num_clients` front ends;
    once `start` returned, every engine has answered its handshake and `attachments(i)` tells front end i how to
    reach them; `stop()` ends every engine and removes the ipc folder, once.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        model_info: ModelInfo | None,
        data_parallel_size: int,
        num_clients: int,
    ) -> None:
        self.num_clients = num_clients
        self.ipc_dir = tempfile.mkdtemp(prefix=IPC_FOLDER_PREFIX)
        self._context = zmq.Context()
        self._handshakes: list[zmq.Socket] = []
        self.processes: list[BaseProcess] = []
        self.num_kv_blocks: list[int] = []
        self._stopped = False
        devices = (
            core_devices(engine_config, data_parallel_size) if data_parallel_size > 1 else [None]
        )
        spawn = multiprocessing.get_context("spawn")
        for rank in range(data_parallel_size):
            handshake = self._context.socket(zmq.PULL)
            handshake.setsockopt(zmq.LINGER, 0)
            handshake_address = f"ipc://{os.path.join(self.ipc_dir, f'r{rank}-handshake')}"
            handshake.bind(handshake_address)
            self._handshakes.append(handshake)
            clients = [client_addresses(self.ipc_dir, rank, i) for i in range(num_clients)]
            config = EngineCoreProcConfig(
                engine_config,
                model_info,
                *clients[0],
                data_parallel_rank=rank,
                data_parallel_size=data_parallel_size,
                visible_devices=devices[rank],
                extra_clients=tuple(clients[1:]),
                handshake_address=handshake_address,
            )
            self.processes.append(
                spawn.Process(
                    target=run_engine_core,
                    args=(config,),
                    name=f"{ENGINE_CORE_PROCESS_NAME}-{rank}",
                )
            )

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes if process.pid is not None]

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Start every engine and wait for all their handshakes; on any failure, stop them all and raise (the
        engine's own error: a ValueError stays one; a RuntimeError for a process that exited or timed out)."""
        try:
            for process in self.processes:
                process.start()
                logger.info("started engine core process %d (%s)", process.pid, process.name)
            deadline = time.monotonic() + timeout_s
            for rank, process in enumerate(self.processes):
                self.num_kv_blocks.append(self._wait_until_ready(rank, process, deadline))
        except BaseException:
            self.stop()
            raise
        logger.info(
            "%d engine core(s) ready for %d API servers (pids %s; KV blocks %s)",
            len(self.processes),
            self.num_clients,
            self.pids,
            self.num_kv_blocks,
        )

    def _wait_until_ready(self, rank: int, process: BaseProcess, deadline: float) -> int:
        socket = self._handshakes[rank]
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(process.sentinel, zmq.POLLIN)
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(poller.poll(remaining_ms))
            if socket in events:
                event = make_output_decoder().decode(socket.recv())
                if isinstance(event, EngineReady):
                    return event.num_kv_blocks
                if isinstance(event, EngineStartupFailed):
                    error = event.error.to_exception()
                    if isinstance(error, Exception):
                        raise error
                    raise RuntimeError(f"engine core {rank} stopped during startup: {error!r}")
                raise RuntimeError(f"engine core {rank} sent {type(event).__name__} first")
            if process.sentinel in events:
                process.join(STOP_TIMEOUT_S)
                raise RuntimeError(
                    f"engine core process {process.pid} exited during startup (exit code "
                    f"{process.exitcode}); its log above says why"
                )
            if not events:
                raise RuntimeError(f"engine core {rank} was not ready in time")

    def attachments(self, client: int) -> list[EngineAttachment]:
        """How front end `client` reaches every engine, in rank order."""
        return [
            EngineAttachment(process.pid, *client_addresses(self.ipc_dir, rank, client))  # type: ignore[arg-type]
            for rank, process in enumerate(self.processes)
        ]

    def stop(self) -> None:
        """Stop every engine (SIGTERM: each stops after its running step; SIGKILL past `STOP_TIMEOUT_S`), then
        release the sockets and the ipc folder. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        stop_processes(self.processes, STOP_TIMEOUT_S, "engine core")
        for socket in self._handshakes:
            socket.close()
        self._context.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
