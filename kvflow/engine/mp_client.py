"""MPEngineCoreClient: the engine core in its own process, driven over ZMQ with msgspec messages.

    front end process                                   engine-core process (spawned)
    callers ── encode + send (under a lock) ── PUSH ──>  PULL ── input thread ──> engine loop (main thread)
    output thread <── decode <── PULL <──────────────── PUSH <── output thread <── outputs, results
      │ calls the output handler in order, completes Futures by call id
      └ watches the process sentinel: a dead process is a dead engine

Both sockets are bound here on ipc paths in a private temporary folder; the process connects. The handshake is the
first message on the output socket: `EngineReady` (the KV cache size), or `EngineStartupFailed` (its error, raised
here: a ValueError in the core stays a ValueError with the same message); a process that exits before either is a
RuntimeError naming it and its exit code.

The front end (this process) runs no torch compute: the model, the sampler and the KV cache live in the engine-core
process, the input and output processors work on Python lists. It does import torch (`EngineArgs` resolves the
device with it), so a process that only serves, like `kvflow serve`, should call `torch.set_num_threads(1)`; a library
object leaves that process-wide setting to its owner.

Attached (`attachment=`, `kvflow serve --api-server-count N`, see `kvflow.engine.shared_engines`): the core already
runs, started by another process and shared with other front ends. The client binds the addresses it is given, waits
for the same handshake, and watches the engine process through a pidfd (it is not this process's child); its
shutdown only detaches (the launcher stops the engine), and its death is the engine process's exit as above.

Payloads that are not typed messages (utility arguments and results, `run` and `collective_rpc` callables) travel
with cloudpickle: this is a channel between a front end and the process it started, never a network endpoint.
`update_weights` therefore takes a checkpoint folder only; a state dict of tensors is for in-process engines.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import os
import select
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import zmq

from kvflow.engine.core_client import EngineCoreClient
from kvflow.engine.core_proc import (
    ENGINE_CORE_PROCESS_NAME,
    IPC_FOLDER_PREFIX,
    EngineCoreProcConfig,
    run_engine_core,
)
from kvflow.engine.death import DeadHandler, EngineDeadError, EngineDeath, dead_error_for
from kvflow.engine.futures import complete
from kvflow.engine.loop import OutputHandler
from kvflow.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreFailed,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStartupFailed,
    OutputMessage,
    PauseGeneration,
    RunCallable,
    Shutdown,
    UtilityCall,
    UtilityResult,
    dumps,
    loads,
    make_output_decoder,
)
from kvflow.engine.shared_engines import EngineAttachment

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from kvflow.config import EngineConfig
    from kvflow.engine.core import EngineCore
    from kvflow.model_info import ModelInfo
    from kvflow.request import Request

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
STARTUP_TIMEOUT_S = 600.0  # model loading included
_STOP_TIMEOUT_S = (
    10.0  # how long a stopping engine process may take before it is terminated, then killed
)
_DRAIN_POLL_MS = (
    100  # after the process exited: how long to wait for more of what it sent before it did
)


class EngineProcessExitedError(RuntimeError):
    """The engine-core process exited without being asked to (killed, crashed, or stopped by a signal)."""


class MPEngineCoreClient(EngineCoreClient):
    """An `EngineCoreClient` whose core runs in a spawned engine-core process (`kvflow.engine.core_proc`).

    Invariants:
      * `_lock` makes "check the engine is alive, register the call's Future, send" one step, so messages reach the
        core in the order of these steps, and no Future is registered after the pending ones were failed;
      * only the output thread reads the output socket and calls the output handler, in the order the core sent;
        a call's Future completes on that thread after every output the core produced before applying it;
      * the calls the output handler makes go out together when it returns, as one batch the core applies with no
        step in between (as an in-process handler's calls, queued while the loop waits for it);
      * the engine is dead once `shutdown` begins, the process exits, it reports `EngineCoreFailed`, or the output
        handler raises; then, once, every pending Future fails with `EngineDeadError` and `dead_handler` is called;
        every later call raises it;
      * `shutdown()` stops the process (asks, then terminates, then kills), joins the output thread, closes the
        sockets and removes the ipc folder (attached: it only detaches: wakes the output thread, closes its
        sockets). A client never shut down does the same at interpreter exit (an atexit hook, which runs before
        multiprocessing's own, which would wait for the process), or once collected after
        its engine died (a live output thread keeps it referenced); and the engine process exits by itself when
        this process dies.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        model_info: ModelInfo | None,
        output_handler: OutputHandler,
        dead_handler: DeadHandler,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        visible_devices: str | None = None,
        attachment: EngineAttachment | None = None,
    ) -> None:
        """`data_parallel_rank` / `data_parallel_size`: this core's place among the engine cores of one front end
        (`kvflow.engine.dp_client`); the core takes its share of the CPU threads. `visible_devices`: the
        process's `CUDA_VISIBLE_DEVICES` (None: this process's). `attachment`: attach to that running core
        instead of starting one (the other options are then the running core's business)."""
        self._output_handler = output_handler
        self._death = EngineDeath(dead_handler)
        self._lock = self._death.lock
        self._pending: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        self._handler_calls: list[bytes] | None = None  # calls made by the running output handler
        self._output_thread: threading.Thread | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._resources: _ProcessResources | _AttachedResources = (
            _ProcessResources(
                engine_config, model_info, data_parallel_rank, data_parallel_size, visible_devices
            )
            if attachment is None
            else _AttachedResources(attachment)
        )
        self._finalizer = weakref.finalize(self, self._resources.close)
        self._finalizer.atexit = False  # the resources register their own atexit hook
        try:
            self._resources.start()
            ready = self._resources.wait_until_ready(startup_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        self.pid = ready.pid
        self.num_kv_blocks = ready.num_kv_blocks
        self._output_thread = threading.Thread(
            target=self._receive_events, name="kvflow-engine-core-client", daemon=True
        )
        self._resources.output_thread = self._output_thread
        self._output_thread.start()

    # ------------------------------------------------------------------------------------------------ callers
    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        return self._call(lambda call_id: UtilityCall(call_id, method, dumps(args)))

    def add_requests(self, requests: list[Request]) -> Future[None]:
        core_requests = [EngineCoreRequest.from_request(request) for request in requests]
        return self._call(lambda call_id: AddRequests(call_id, core_requests))

    def abort_requests(self, request_ids: list[str]) -> Future[None]:
        return self._call(lambda call_id: AbortRequests(call_id, list(request_ids)))

    def pause_generation(self, mode: str, clear_cache: bool) -> Future[None]:
        return self._call(lambda call_id: PauseGeneration(call_id, mode, clear_cache))

    def run(self, fn: Callable[[EngineCore], _T]) -> Future[_T]:
        """Ship `fn` with cloudpickle (a closure travels by value, a module-level function by reference: its module
        must import in the engine process) and run it there; its result comes back pickled."""
        payload = dumps(fn)
        return self._call(lambda call_id: RunCallable(call_id, payload))

    def update_weights(self, weights: Any) -> Future[int]:
        """Reload weights from a checkpoint folder (str or path). A state dict of tensors is for in-process
        engines only: save it as a checkpoint folder first."""
        if not isinstance(weights, str | os.PathLike):
            failed: Future[int] = Future()
            failed.set_exception(
                ValueError(
                    "update_weights with the engine core in its own process takes a checkpoint folder; a state "
                    f"dict of tensors ({type(weights).__name__}) is for in-process engines only: save it as a "
                    "checkpoint folder (safetensors) and pass that folder"
                )
            )
            return failed
        return self.call_utility("update_weights", os.fspath(weights))

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._death.error

    def is_alive(self) -> bool:
        """Whether the engine-core process runs."""
        return self._resources.engine_alive()

    def shutdown(self) -> None:
        """Stop the engine process and release everything (idempotent; returns once the process is gone). Calls
        still pending fail with EngineDeadError ("shut down")."""
        self._death.publish()
        self._finalizer()
        self._report_dead()  # when the output thread could not (it never ran, or this is it)

    def _call(self, make_message: Callable[[int], Any]) -> Future[Any]:
        call_id = next(self._call_ids)
        done: Future[Any] = Future()
        in_handler = threading.current_thread() is self._output_thread
        with self._lock:
            self._death.raise_if_dead()
            frame = self._encoder.encode(make_message(call_id))
            self._pending[call_id] = done
            if in_handler and self._handler_calls is not None:
                self._handler_calls.append(frame)  # sent as one batch when the handler returns
            else:
                self._send([frame])
        return done

    def _send(self, frames: list[bytes]) -> None:
        """Send frames as one message (a batch when several); caller holds `_lock`."""
        if not self._resources.send(frames):
            logger.warning(
                "the engine core process is not connected; its death fails the calls sent"
            )

    # ------------------------------------------------------------------------------------------------ output thread
    def _receive_events(self) -> None:
        socket = self._resources.output_socket
        sentinel = self._resources.sentinel
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(sentinel, zmq.POLLIN)
        wake = self._resources.wake_fd  # attached: written when the client detaches
        if wake is not None:
            poller.register(wake, zmq.POLLIN)
        decoder = make_output_decoder()
        cause: BaseException | None = None
        try:
            while cause is None:
                events = dict(poller.poll())
                if wake is not None and wake in events:
                    break  # detached (shutdown): nothing more to receive
                if socket in events:
                    cause = self._handle_available(socket, decoder)
                if cause is None and sentinel in events:  # what it sent before it exited, then why
                    while (
                        cause is None
                        and self._death.error is None  # not shutting down: its last words matter
                        and socket.poll(_DRAIN_POLL_MS, zmq.POLLIN)
                    ):
                        cause = self._handle_available(socket, decoder)
                    if cause is None:
                        cause = self._exit_cause()
                    break
        except Exception as exc:  # the output handler failed: the front end cannot go on
            logger.exception("the engine core client's output thread failed")
            cause = exc
        self._die(cause)

    def _handle_available(
        self, socket: zmq.Socket, decoder: msgspec.msgpack.Decoder[OutputMessage]
    ) -> BaseException | None:
        """Handle every event received so far; returns the engine's error if it reported one."""
        while True:
            try:
                frame = socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            event = decoder.decode(frame.buffer)
            if isinstance(event, EngineCoreOutputs):
                self._handle_outputs(event)
            elif isinstance(event, UtilityResult):
                self._complete(event)
            elif isinstance(event, EngineCoreFailed):
                return event.error.to_exception()
            else:
                logger.warning(
                    "ignoring an unexpected %s from the engine core", type(event).__name__
                )

    def _handle_outputs(self, event: EngineCoreOutputs) -> None:
        """Call the output handler; the calls it makes (aborts for stop strings, a session's next chunk and its
        end) go to the core as one batch, applied with no step in between, as an in-process handler's would be."""
        self._handler_calls = []
        try:
            self._output_handler(event.outputs, event.scheduler_stats)
        finally:
            with self._lock:
                frames, self._handler_calls = self._handler_calls, None
                if frames and self._death.error is None:
                    self._send(frames)

    def _complete(self, result: UtilityResult) -> None:
        with self._lock:
            done = self._pending.pop(result.call_id, None)
        if result.error is not None:
            complete(done, error=result.error.to_exception())
            return
        try:
            value = None if result.result is None else loads(result.result)
        except Exception as exc:
            complete(done, error=exc)
            return
        complete(done, value)

    def _exit_cause(self) -> BaseException | None:
        """Why the process exited: None when we asked it to (shutdown), else an error naming it."""
        status = self._resources.reap()
        if self._death.error is not None:
            return None
        return EngineProcessExitedError(
            f"{self._resources.describe()} exited unexpectedly ({status})"
        )

    def _die(self, cause: BaseException | None) -> None:
        """The engine is dead: publish the error, stop a process that still runs, fail pending calls, tell the
        front end."""
        message = str(cause) if isinstance(cause, EngineProcessExitedError) else None
        self._death.publish(
            dead_error_for(cause, message) if cause is not None else None, replace_clean=True
        )
        if cause is not None:
            self._resources.request_stop()
        self._report_dead()

    def _report_dead(self) -> None:
        def take_pending() -> list[Future[Any]]:
            pending, self._pending = list(self._pending.values()), {}
            return pending

        self._death.report(take_pending)


class _ProcessResources:
    """The engine process, the ZMQ context and sockets, and the ipc folder of one client; `close()` releases them
    all, once. Holds no reference to the client, so that a finalizer can call `close()` after the client is gone.

    Invariant: `send_lock` serializes the input socket (sends, and closing it)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        model_info: ModelInfo | None,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        visible_devices: str | None = None,
    ) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix=IPC_FOLDER_PREFIX)
        self.context = zmq.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_thread: threading.Thread | None = None
        self.wake_fd: int | None = None  # the process's exit (sentinel) ends the output thread
        self.send_lock = threading.Lock()
        self._input_open = True
        self._closed = False
        self._close_lock = threading.Lock()
        for socket in (self.input_socket, self.output_socket):
            socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)  # calls never block on a busy engine
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        input_address = f"ipc://{os.path.join(self.ipc_dir, 'input')}"
        output_address = f"ipc://{os.path.join(self.ipc_dir, 'output')}"
        self.input_socket.bind(input_address)
        self.output_socket.bind(output_address)
        config = EngineCoreProcConfig(
            engine_config,
            model_info,
            input_address,
            output_address,
            data_parallel_rank,
            data_parallel_size,
            visible_devices,
        )
        self.process: BaseProcess = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config,), name=ENGINE_CORE_PROCESS_NAME
        )
        self._started = False
        atexit.register(self.close)  # before the process exists: no way to leave it behind

    @property
    def sentinel(self) -> int:
        """A file descriptor that turns readable once the engine process has exited."""
        return self.process.sentinel

    def engine_alive(self) -> bool:
        return self.process.is_alive()

    def describe(self) -> str:
        return _describe(self.process)

    def reap(self) -> str:
        """Once the sentinel fired: collect the process and say how it ended."""
        self.process.join(_STOP_TIMEOUT_S)  # the sentinel fired: reaping is immediate
        return _exit_status(self.process)

    def start(self) -> None:
        self.process.start()
        self._started = True
        logger.info("started %s", _describe(self.process))

    def wait_until_ready(self, timeout_s: float) -> EngineReady:
        """The handshake: the core's `EngineReady`, or its startup error raised here."""
        return _wait_until_ready(
            self, timeout_s, lambda failed: _startup_error(failed, self.process)
        )

    def send(self, frames: list[bytes]) -> bool:
        return _send(self, frames)

    def request_stop(self) -> None:
        """Ask the engine loop to stop after what is queued (no wait)."""
        self.send([msgspec.msgpack.encode(Shutdown())])

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self._started:
            self.request_stop()
            self._stop_process()
        with self.send_lock:
            self._input_open = False
            self.input_socket.close()
        thread = self.output_thread
        if thread is threading.current_thread():
            return  # closed from an output or dead handler: the thread still owns its socket
        if thread is not None:
            thread.join(_STOP_TIMEOUT_S)
            if thread.is_alive():
                logger.warning("the engine core client's output thread did not stop")
                return  # it still uses the output socket and the context: leave them to the exit
        self.output_socket.close()
        self.context.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    def _stop_process(self) -> None:
        """Join the process: it was asked to stop; terminate it after a while, kill it after another."""
        process = self.process
        process.join(_STOP_TIMEOUT_S)
        for stop in (process.terminate, process.kill):
            if process.exitcode is not None:
                break
            logger.warning("%s did not stop: %s", _describe(process), stop.__name__)
            stop()
            process.join(_STOP_TIMEOUT_S)


class _AttachedResources:
    """The sockets of a client attached to a running engine core it did not start (`EngineAttachment`), and a pidfd
    on that engine's process; `close()` releases them, once, and leaves the engine (and the ipc folder, which is
    its launcher's) alone. Same interface as `_ProcessResources` for the client.

    Invariant: `send_lock` serializes the input socket (sends, and closing it)."""

    def __init__(self, attachment: EngineAttachment) -> None:
        self.pid = attachment.pid
        try:
            self._pidfd = os.pidfd_open(attachment.pid)
        except (AttributeError, OSError) as error:
            raise RuntimeError(
                f"cannot watch the engine core process {attachment.pid} (os.pidfd_open: {error}); "
                "attaching to a shared engine needs Linux 5.3 or later"
            ) from error
        self.context = zmq.Context()
        self.input_socket = self.context.socket(zmq.PUSH)
        self.output_socket = self.context.socket(zmq.PULL)
        self.output_thread: threading.Thread | None = None
        self.send_lock = threading.Lock()
        self._input_open = True
        self._closed = False
        self._close_lock = threading.Lock()
        self.wake_fd, self._wake_writer = os.pipe()  # written once: the output thread stops
        for socket in (self.input_socket, self.output_socket):
            socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.input_socket.bind(attachment.input_address)
        self.output_socket.bind(attachment.output_address)
        atexit.register(self.close)

    @property
    def sentinel(self) -> int:
        return self._pidfd

    def engine_alive(self) -> bool:
        with self._close_lock:
            if self._closed:
                return False
            readable, _, _ = select.select([self._pidfd], [], [], 0)
        return not readable

    def describe(self) -> str:
        return f"the engine core process (pid {self.pid})"

    def reap(self) -> str:
        return "its exit status is its launcher's to collect"

    def start(self) -> None:
        logger.info("attaching to %s", self.describe())

    def wait_until_ready(self, timeout_s: float) -> EngineReady:
        """The handshake, then the engine's connection to the input socket: the engine connected to both
        addresses before this client bound them, and retries the input one on its own schedule; until it has, a
        send would find no peer (and fail)."""
        deadline = time.monotonic() + timeout_s
        ready = _wait_until_ready(self, timeout_s, lambda failed: failed.error.to_exception())
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLOUT)
        poller.register(self.sentinel, zmq.POLLIN)
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            events = dict(poller.poll(remaining_ms))
            if self.input_socket in events:
                return ready
            if self.sentinel in events:
                raise RuntimeError(f"{self.describe()} exited while this client attached")
            if not events:
                raise RuntimeError(f"{self.describe()} did not connect within {timeout_s:.0f} s")

    def send(self, frames: list[bytes]) -> bool:
        return _send(self, frames)

    def request_stop(self) -> None:
        """Nothing: the engine is shared; its launcher stops it."""

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        with self.send_lock:
            self._input_open = False
            self.input_socket.close()
        os.write(self._wake_writer, b"x")
        thread = self.output_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_TIMEOUT_S)
            if (
                thread.is_alive()
            ):  # it waits on a socket the engine still serves: leave it to the exit
                logger.warning("the engine core client's output thread did not stop")
                return
        elif thread is threading.current_thread():
            return
        self.output_socket.close()
        self.context.term()
        for fd in (self._pidfd, self.wake_fd, self._wake_writer):
            os.close(fd)


def _wait_until_ready(
    resources: _ProcessResources | _AttachedResources,
    timeout_s: float,
    startup_error: Callable[[EngineStartupFailed], BaseException],
) -> EngineReady:
    """The handshake on `resources`' output socket: the core's `EngineReady`, or its startup error raised here."""
    poller = zmq.Poller()
    poller.register(resources.output_socket, zmq.POLLIN)
    poller.register(resources.sentinel, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        events = dict(poller.poll(remaining_ms))
        if resources.output_socket in events:
            event = make_output_decoder().decode(resources.output_socket.recv())
            if isinstance(event, EngineReady):
                logger.info("%s is ready: %d KV blocks", resources.describe(), event.num_kv_blocks)
                return event
            if isinstance(event, EngineStartupFailed):
                raise startup_error(event)
            raise RuntimeError(f"{resources.describe()} sent {type(event).__name__} first")
        if resources.sentinel in events:
            raise RuntimeError(
                f"{resources.describe()} exited during startup ({resources.reap()}); "
                "its log above says why"
            )
        if not events:
            raise RuntimeError(f"{resources.describe()} was not ready within {timeout_s:.0f} s")


def _send(resources: _ProcessResources | _AttachedResources, frames: list[bytes]) -> bool:
    """Send one message (multipart: a batch) without blocking; False when the process is not connected (dead or
    dying)."""
    with resources.send_lock:
        if not resources._input_open:
            return False
        try:
            resources.input_socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
    return True


def _startup_error(failed: EngineStartupFailed, process: BaseProcess) -> Exception:
    """The core's startup error as the caller's exception: the same exception (ValueError stays ValueError), or a
    RuntimeError for an interrupt."""
    error = failed.error.to_exception()
    process.join(_STOP_TIMEOUT_S)
    if isinstance(error, Exception):
        return error
    return RuntimeError(f"{_describe(process)} stopped during startup: {error!r}")


def _describe(process: BaseProcess) -> str:
    return f"the engine core process (pid {process.pid})"


def _exit_status(process: BaseProcess) -> str:
    exitcode = process.exitcode
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"exit code {exitcode}: killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"
