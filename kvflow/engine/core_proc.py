"""The engine-core process: an `EngineCore` and its `EngineLoop`, driven over ZMQ by `MPEngineCoreClient`.

`MPEngineCoreClient` starts it with the `spawn` multiprocessing context (`run_engine_core` is the target) after
binding two ipc sockets in a private folder; this process connects to both:

    input   client PUSH -> PULL here   the input thread receives and decodes `InputMessage`s and queues them
                                        as engine-loop messages (a multipart message as one batch, applied with
                                        no step in between)
    output  PUSH here -> client PULL   the output thread encodes and sends `OutputMessage`s in the order the main
                                        thread queued them

The main thread builds the core, answers the handshake (`EngineReady` with the KV cache size, or
`EngineStartupFailed` with the error), then runs the same `EngineLoop` as the in-process client: messages applied in
order between steps, one step's outputs and the `SchedulerStats` after it sent as one `EngineCoreOutputs`, a call's
`UtilityResult` queued when it completes (so after every output produced before it was applied), pause answers once
the pause is in effect or a resume released it.

Shared engines (`kvflow serve --api-server-count N`, see `kvflow.engine.shared_engines`): one process serves several
front ends (clients), each with its own pair of sockets (`EngineCoreProcConfig.client_addresses`, client 0 first).
A call's `UtilityResult` goes back to the client that sent the call; a step's outputs go to the clients that added
their requests (the owner of each request id is recorded when its `AddRequests` is applied, and forgotten with its
finished output or its abort), each with the step's `SchedulerStats`; client 0 gets every step's stats, with no
outputs when it owns none of them, so one front end sees every snapshot. The handshake goes to every client and to
the launcher's `handshake_address`. `abort_everywhere` (a `UtilityCall`) aborts requests whichever client owns them:
each owner gets their "abort" outputs, as a pause in mode "abort" does.

The process exits (after the running step) on a `Shutdown` message, when its parent process dies (the input thread
watches the parent's sentinel and pid), and on the first SIGTERM / SIGINT; the first signal also restores the
previous handlers, so a second one acts as usual (terminates, or KeyboardInterrupt). A signal during startup aborts
startup at once. If the engine loop fails, `EngineCoreFailed` is the last message, and the exit code is 1.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvflow.core.sched.output import EngineCoreOutput
from kvflow.engine.core_builder import build_engine_core
from kvflow.engine.death import EngineDeadError, EngineDeath
from kvflow.engine.loop import (
    EngineLoop,
    LoopBatch,
    LoopCall,
    LoopMessage,
    LoopPause,
    LoopShutdown,
)
from kvflow.engine.messages import (
    AbortRequests,
    AddRequests,
    EngineCoreFailed,
    EngineCoreOutputs,
    EngineReady,
    EngineStartupFailed,
    InputMessage,
    PauseGeneration,
    RemoteError,
    RunCallable,
    Shutdown,
    UtilityCall,
    UtilityResult,
    dumps,
    loads,
    make_input_decoder,
)
from kvflow.engine.process_names import set_process_name

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import SchedulerStats
    from kvflow.engine.core import EngineCore
    from kvflow.model_info import ModelInfo

logger = logging.getLogger(__name__)

ENGINE_CORE_PROCESS_NAME = "kvflow-engine-core"
IPC_FOLDER_PREFIX = "kvflow-engine-"  # the client's private folder of ipc sockets
_POLL_MS = 200  # how often the input thread looks at the parent's pid and its own stop flag
_FLUSH_LINGER_MS = 5000  # how long closing the output socket may wait to deliver the last messages
_THREAD_JOIN_S = 10.0
_Outgoing = EngineReady | EngineStartupFailed | EngineCoreOutputs | UtilityResult | EngineCoreFailed
# A utility handled by the engine-core process itself (it needs the request owners), not by `EngineCore`.
ABORT_EVERYWHERE = "abort_everywhere"
_EVERY_CLIENT = (
    -1
)  # an outgoing message's target: every client (and the launcher, for the handshake)


@dataclass(frozen=True)
class EngineCoreProcConfig:
    """What the spawned process gets (pickled by `spawn`): the core's config, the addresses to connect to, and its
    place among the data-parallel engine cores of one front end (`data_parallel_rank` < `data_parallel_size`) with
    the GPUs it may see."""

    engine_config: EngineConfig
    model_info: ModelInfo | None
    input_address: str
    output_address: str
    data_parallel_rank: int = 0
    data_parallel_size: int = 1
    visible_devices: str | None = None  # this process's CUDA_VISIBLE_DEVICES (None: the parent's)
    # Shared engines: the (input, output) addresses of clients 1, 2, ... (client 0's are the two above), and the
    # launcher's socket for the handshake (None: the only client is the launcher).
    extra_clients: tuple[tuple[str, str], ...] = ()
    handshake_address: str | None = None

    @property
    def client_addresses(self) -> tuple[tuple[str, str], ...]:
        """The (input, output) addresses of every client, client 0 first."""
        return ((self.input_address, self.output_address), *self.extra_clients)


def run_engine_core(config: EngineCoreProcConfig) -> None:
    """The process target: serve until told to stop; the exit code is 0 after a clean stop, 1 after a failure.

    Once `EngineCoreProc.run` has released everything it holds (core, threads, sockets), the process ends with
    `os._exit`: the interpreter's teardown of torch's modules would only slow every shutdown down, with nothing
    left to release.
    """
    if config.visible_devices is not None:  # before anything initializes CUDA in this process
        os.environ["CUDA_VISIBLE_DEVICES"] = config.visible_devices
    set_process_name(f"kvflow-engine-{config.data_parallel_rank}")
    logger.info(
        "engine core process %d (data-parallel rank %d) starting",
        os.getpid(),
        config.data_parallel_rank,
    )
    exit_code = EngineCoreProc(config).run()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(exit_code)


class EngineCoreProc:
    """One engine core served over ZMQ (see the module docstring for the threads, sockets and exit rules).

    Invariants: only the main thread touches the core (through the `EngineLoop`) and `_owners`; only the input
    thread touches the input sockets and only the output thread the output sockets; every message the loop
    completes queues exactly one `UtilityResult`, for the client that sent it, except those failed because the
    engine died (the client fails those itself). With one client nothing tracks owners: every output is its.
    """

    def __init__(self, config: EngineCoreProcConfig) -> None:
        self._config = config
        self._context = zmq.Context()
        self._inbox: queue.SimpleQueue[LoopMessage] = queue.SimpleQueue()
        # (client index or _EVERY_CLIENT, message); None stops the output thread
        self._outbox: queue.SimpleQueue[tuple[int, _Outgoing] | None] = queue.SimpleQueue()
        self._num_clients = len(config.client_addresses)
        self._owners: dict[
            str, int
        ] = {}  # live request id -> the client that added it (several clients only)
        self._input_stop = threading.Event()
        self._wake_input, self._wake_input_writer = (
            os.pipe()
        )  # written once: the input thread stops
        self._loop_started = False
        self._failed = False
        self._parent_died = False
        self._parent_pid = os.getppid()
        self._input_thread = threading.Thread(
            target=self._receive_messages, name="kvflow-core-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._send_events, name="kvflow-core-output", daemon=True
        )

    # ------------------------------------------------------------------------------------------------ main thread
    def run(self) -> int:
        """Build the core, answer the handshake, run the engine loop; returns the exit code."""
        self._install_signal_handlers()
        self._output_thread.start()
        self._input_thread.start()
        try:
            engine_core = self._build()
            if engine_core is not None:
                self._serve(engine_core)
        finally:
            self._close()
        return 1 if self._failed else 0

    def _build(self) -> EngineCore | None:
        try:
            share_the_cores_between_engine_cores(
                self._config.engine_config.model_config.device, self._config.data_parallel_size
            )
            engine_core = build_engine_core(self._config.engine_config, self._config.model_info)
        except (
            BaseException
        ) as exc:  # a signal during startup, too: the client is waiting for an answer
            logger.error("engine core startup failed: %r", exc)
            self._failed = True
            self._post(EngineStartupFailed(RemoteError.from_exception(exc)))
            return None
        self._post(EngineReady(os.getpid(), engine_core.executor.num_kv_blocks))
        return engine_core

    def _serve(self, engine_core: EngineCore) -> None:
        loop = EngineLoop(engine_core, self._send_outputs, EngineDeath(self._on_dead), self._inbox)
        self._loop_started = True
        logger.info("engine core process %d serving", os.getpid())
        loop.run()

    def _post(self, event: _Outgoing, client: int = _EVERY_CLIENT) -> None:
        self._outbox.put((client, event))

    def _send_outputs(self, outputs: list[EngineCoreOutput], stats: SchedulerStats) -> None:
        """One step's outputs: all to the only client, or each to the client that owns its request (loop thread)."""
        if self._num_clients == 1:
            self._post(EngineCoreOutputs(outputs, stats), 0)
            return
        by_client: dict[int, list[EngineCoreOutput]] = {0: []}  # client 0 sees every snapshot
        owners = self._owners
        for output in outputs:
            client = owners.pop(output.request_id, None) if output.finished else None
            if client is None:
                client = owners.get(output.request_id)
            if client is None:
                continue  # aborted by its client: nobody waits for it
            by_client.setdefault(client, []).append(output)
        for client, client_outputs in by_client.items():
            self._post(EngineCoreOutputs(client_outputs, stats), client)

    def _on_dead(self, dead_error: EngineDeadError) -> None:
        cause = dead_error.__cause__
        if cause is not None:
            self._failed = True
            self._post(EngineCoreFailed(RemoteError.from_exception(cause)))

    def _install_signal_handlers(self) -> None:
        """The first SIGTERM / SIGINT stops the loop after its running step (or aborts startup); it also puts the
        previous handlers back, so a second signal is not swallowed."""
        signals = (signal.SIGTERM, signal.SIGINT)
        previous = {signum: signal.getsignal(signum) for signum in signals}

        def handle(signum: int, frame: object) -> None:
            for each, handler in previous.items():
                signal.signal(each, handler)
            if not self._loop_started:
                raise SystemExit(
                    f"engine core startup interrupted by {signal.Signals(signum).name}"
                )
            self._inbox.put(LoopShutdown())  # SimpleQueue.put is reentrant: safe in a handler

        for signum in signals:
            signal.signal(signum, handle)

    def _close(self) -> None:
        """Stop both threads (the output thread first delivers what is queued), then the ZMQ context."""
        self._input_stop.set()
        os.write(self._wake_input_writer, b"x")
        self._outbox.put(None)
        self._input_thread.join(_THREAD_JOIN_S)
        self._output_thread.join(_THREAD_JOIN_S)
        if self._parent_died:
            self._remove_orphaned_ipc_folder()
        if self._input_thread.is_alive() or self._output_thread.is_alive():
            logger.warning("engine core I/O threads did not stop; exiting without flushing")
            return
        self._context.term()

    def _remove_orphaned_ipc_folder(self) -> None:
        """The dead parent cannot remove the folder of its ipc sockets: do it for it."""
        for address in (self._config.input_address, self._config.output_address):
            folder = os.path.dirname(address.removeprefix("ipc://"))
            if os.path.basename(folder).startswith(IPC_FOLDER_PREFIX):
                shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ input thread
    def _receive_messages(self) -> None:
        sockets: list[zmq.Socket] = []
        poller = zmq.Poller()
        for (
            input_address,
            _,
        ) in self._config.client_addresses:  # the index of a socket is its client's
            socket = self._context.socket(zmq.PULL)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(input_address)
            poller.register(socket, zmq.POLLIN)
            sockets.append(socket)
        poller.register(self._wake_input, zmq.POLLIN)
        parent = multiprocessing.parent_process()
        if parent is not None:
            poller.register(parent.sentinel, zmq.POLLIN)
        decoder = make_input_decoder()
        try:
            while not self._input_stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                for client, socket in enumerate(sockets):
                    if socket in events:
                        self._queue_received(socket, decoder, client)
                parent_died = (parent is not None and parent.sentinel in events) or (
                    os.getppid() != self._parent_pid
                )
                if parent_died:
                    logger.warning("the engine core's parent process died: shutting down")
                    self._parent_died = True
                    self._inbox.put(LoopShutdown())
                    return
        except Exception as exc:  # e.g. an undecodable frame: the protocol is broken, stop serving
            logger.exception("the engine core's input thread failed")
            self._inbox.put(LoopShutdown(error=exc))
        finally:
            for socket in sockets:
                socket.close()

    def _queue_received(
        self, socket: zmq.Socket, decoder: msgspec.msgpack.Decoder[InputMessage], client: int
    ) -> None:
        while True:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            decoded = [self._decode(decoder, frame.buffer, client) for frame in frames]
            messages = [message for message in decoded if message is not None]
            if not messages:
                continue
            # A multipart message is a batch: applied together, with no engine step in between.
            self._inbox.put(messages[0] if len(messages) == 1 else LoopBatch(messages))  # type: ignore[arg-type]

    def _decode(
        self, decoder: msgspec.msgpack.Decoder[InputMessage], buffer: memoryview, client: int
    ) -> LoopMessage | None:
        """One frame as an engine-loop message. A call whose content fails validation (e.g. SamplingParams a
        front end of another version let through) fails alone: its caller gets the ValueError and the engine goes
        on (None). Anything else undecodable means the protocol is broken: raised."""
        try:
            return self._to_loop_message(decoder.decode(buffer), client)
        except msgspec.ValidationError as error:
            call_id = _call_id_of(buffer)
            if call_id is None:
                raise
            refused = ValueError(str(error))
            self._post(UtilityResult(call_id, error=RemoteError.from_exception(refused)), client)
            return None

    def _to_loop_message(self, message: InputMessage, client: int = 0) -> LoopMessage:
        if isinstance(message, Shutdown):
            return LoopShutdown()
        done: Future[Any] = Future()
        done.add_done_callback(partial(self._send_result, client, message.call_id))
        if isinstance(message, PauseGeneration):
            return LoopPause(message.mode, message.clear_cache, done)
        if isinstance(message, UtilityCall) and message.method == ABORT_EVERYWHERE:
            return LoopCall(partial(self._abort_everywhere, message.args), done)
        call = _core_call(message)
        if self._num_clients > 1 and isinstance(message, AddRequests | AbortRequests):
            call = partial(self._track_owners, client, message, call)
        return LoopCall(call, done)

    def _track_owners(
        self,
        client: int,
        message: AddRequests | AbortRequests,
        call: Callable[[EngineCore], Any],
        core: EngineCore,
    ) -> Any:
        """Record who owns the requests a client adds, forget those it aborts (loop thread), then apply."""
        if isinstance(message, AddRequests):
            for request in message.requests:
                self._owners[request.request_id] = client
        else:
            for request_id in message.request_ids:
                self._owners.pop(request_id, None)
        return call(core)

    def _abort_everywhere(self, args: bytes, core: EngineCore) -> list[str]:
        """Abort `request_ids` (None: every unfinished request) whichever client owns them, each owner getting
        the "abort" outputs (loop thread). Returns the ids that matched a request: the given ones, or for None the
        engine ids aborted. See `matching_request_ids` for how a given id matches."""
        (request_ids,) = loads(args)
        live = [
            request_id
            for request_id, request in core.scheduler.requests.items()
            if not request.is_finished()
        ]
        if request_ids is None:
            targets, answer = live, list(live)
        else:
            targets, answer = matching_request_ids(request_ids, live)
        if targets:
            core.abort_requests(targets)
            outputs = [
                EngineCoreOutput(
                    request_id, [], finish_reason="abort", weight_version=core.weight_version
                )
                for request_id in targets
            ]
            self._send_outputs(outputs, core.make_stats())
        return answer

    def _send_result(self, client: int, call_id: int, done: Future[Any]) -> None:
        """A call's answer for the client that sent it, queued on the loop's thread as the call completes."""
        error = done.exception()
        if isinstance(error, EngineDeadError):
            return  # the engine died: the client fails its pending calls itself
        if error is not None:
            self._post(UtilityResult(call_id, error=RemoteError.from_exception(error)), client)
            return
        result = done.result()
        try:
            payload = None if result is None else dumps(result)
        except Exception as exc:
            error = TypeError(f"the result ({type(result).__name__}) could not be pickled: {exc}")
            self._post(UtilityResult(call_id, error=RemoteError.from_exception(error)), client)
            return
        self._post(UtilityResult(call_id, result=payload), client)

    # ------------------------------------------------------------------------------------------------ output thread
    def _send_events(self) -> None:
        sockets = [self._connect_output(output) for _, output in self._config.client_addresses]
        handshake = (
            None
            if self._config.handshake_address is None
            else self._connect_output(self._config.handshake_address)
        )
        encoder = msgspec.msgpack.Encoder()
        try:
            while (item := self._outbox.get()) is not None:
                client, event = item
                try:
                    frame = encoder.encode(event)
                except Exception as exc:  # a bug: the engine dies of it rather than lose a message
                    logger.exception("could not encode %s", type(event).__name__)
                    self._inbox.put(LoopShutdown(error=exc))
                    continue
                targets = sockets if client == _EVERY_CLIENT else [sockets[client]]
                if handshake is not None and isinstance(event, EngineReady | EngineStartupFailed):
                    targets = [*targets, handshake]
                for socket in targets:
                    if not self._send_frame(socket, frame):
                        return
        finally:
            linger = 0 if self._parent_died else _FLUSH_LINGER_MS
            for socket in [*sockets, *([handshake] if handshake is not None else [])]:
                socket.close(linger=linger)

    def _connect_output(self, address: str) -> zmq.Socket:
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)  # never block the engine on a slow front end
        socket.connect(address)
        return socket

    def _send_frame(self, socket: zmq.Socket, frame: bytes) -> bool:
        """Send once the socket can take it; False when the process is stopping before it could."""
        while not socket.poll(_POLL_MS, zmq.POLLOUT):  # not connected (yet, or any more)
            if self._input_stop.is_set():
                return False
        socket.send(frame, copy=False)
        return True


def share_the_cores_between_engine_cores(device: str, num_engine_cores: int = 1) -> None:
    """On CPU, run torch on every core this process may use, shared out between the `num_engine_cores`
    data-parallel engine cores (each gets its share, at least one thread), so that two OpenMP teams never compete
    for one core (each would stall at every barrier whenever one of its threads is descheduled). No core is kept
    back for the front end, whose CPU per streamed token is small next to what a core held back would cost the
    engine (benchmarks/RESULTS.md, "The serving hot path"); instead `kvflow serve` has the team's threads sleep
    while they wait (`kvflow.utils.openmp_threads_sleep_while_waiting`), so that a busy API process does not stall
    it. An explicit OMP_NUM_THREADS is left alone."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    from kvflow.utils import resolve_device

    if resolve_device(device).type != "cpu":
        return
    import torch

    num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    num_threads = max(1, (num_cores or 1) // num_engine_cores)
    torch.set_num_threads(num_threads)
    logger.info(
        "engine core process: %d torch threads (%d cores shared by %d engine cores)",
        num_threads,
        num_cores,
        num_engine_cores,
    )


def matching_request_ids(request_ids: list[str], live: list[str]) -> tuple[list[str], list[str]]:
    """The engine ids among `live` that the ids a user gave name, and which of those given ids named any.

    A given id `u` (or `u` without a response prefix `cmpl-` / `chatcmpl-`) names the engine id `u`, the engine ids
    `u-<i>` of a request with several prompts, and the samples `<k>_<e>` (`kvflow.utils.child_request_id`) of
    each of those (n > 1): the server's id conventions (`serving_engine.OpenAIServing.run_each`)."""
    by_base: dict[str, list[str]] = {}
    for engine_id in live:
        for base in _id_bases(engine_id):
            by_base.setdefault(base, []).append(engine_id)
    targets: dict[str, None] = {}
    matched: list[str] = []
    for given in request_ids:
        candidates = [given] + [
            given[len(prefix) :] for prefix in ("cmpl-", "chatcmpl-") if given.startswith(prefix)
        ]
        found = [engine_id for each in candidates for engine_id in by_base.get(each, [])]
        if found:
            matched.append(given)
            targets.update(dict.fromkeys(found))
    return list(targets), matched


def _id_bases(engine_id: str) -> set[str]:
    """The user ids an engine id may belong to: itself, without a sample prefix `<k>_`, without a `-<i>` suffix."""
    bases = {engine_id}
    head, underscore, tail = engine_id.partition("_")
    if underscore and head.isdigit():
        bases.add(tail)
    for each in list(bases):
        stem, dash, index = each.rpartition("-")
        if dash and index.isdigit():
            bases.add(stem)
    return bases


def _call_id_of(buffer: memoryview) -> int | None:
    """The `call_id` of an encoded call message (`[tag, call_id, ...]`, see `messages`), read without its types;
    None when the frame is not one."""
    try:
        fields = msgspec.msgpack.decode(buffer)
    except msgspec.DecodeError:
        return None
    if isinstance(fields, list) and len(fields) > 1 and type(fields[1]) is int:
        return fields[1]
    return None


def _core_call(message: AddRequests | AbortRequests | UtilityCall | RunCallable) -> Any:
    """The function of the core that a call message runs on the engine loop."""
    if isinstance(message, AddRequests):
        requests = [request.to_request() for request in message.requests]
        return lambda core: core.add_requests(requests)
    if isinstance(message, AbortRequests):
        return lambda core: core.abort_requests(message.request_ids)
    if isinstance(message, RunCallable):
        return lambda core: loads(message.fn)(core)
    return partial(_call_method, message.method, message.args)


def _call_method(method: str, args: bytes, core: EngineCore) -> Any:
    function = None if method.startswith("_") else getattr(core, method, None)
    if not callable(function):
        raise AttributeError(f"the engine core has no public method {method!r}")
    return function(*loads(args))
