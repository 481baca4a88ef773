"""MultiprocExecutor (`mp`): one worker process per tensor-parallel rank on this machine.

    engine-core process                                    rank r worker process (python -m kvflow.executor.mp_worker)
    XPUB  ipc://<dir>/broadcast  ── one frame per call ──> SUB     every rank gets the same bytes
    PULL  ipc://<dir>/replies    <── answers ───────────── PUSH    rank 0 answers steps; every rank answers RPCs

The ranks join one torch.distributed group (gloo on CPU, NCCL on CUDA) over TCP on 127.0.0.1 for their collectives;
the executor itself never joins it. Each call is serialized once and published once, however many ranks there are
(`bytes_broadcast` counts what was sent). A reply thread completes the Futures of pending calls and watches the
worker processes: when one exits unasked, every pending and later call fails with an error naming its rank, and the
other workers are killed (they would wait forever in a collective).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import zmq

from kvflow.executor.broadcast import BroadcastExecutor, WorkerDeath, WorkerDiedError
from kvflow.executor.messages import (
    STARTUP_CALL_ID,
    ExecuteModel,
    RankStartup,
    RunMethod,
    SampleTokens,
    StopWorker,
    WorkerReady,
    WorkerReply,
    encode_broadcast,
)
from kvflow.executor.mp_worker import MultiprocWorkerArgs

if TYPE_CHECKING:
    from kvflow.config import EngineConfig
    from kvflow.core.sched.output import ModelRunnerOutput
    from kvflow.model_info import ModelInfo

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 600.0
_POLL_MS = 50
_STOP_TIMEOUT_S = 5.0
_DEATH_GRACE_S = 1.0  # after a rank's failure, how long to look for the rank whose death caused it


def available_cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Below the kernel's ephemeral range, where store ports are drawn from (Linux's default range starts at 32768).
_STORE_PORTS_FROM = 20000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_port_start() -> int:
    """The first port of the kernel's ephemeral range (from which bind(0) and outgoing connections take theirs)."""
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open(_EPHEMERAL_RANGE_FILE) as range_file,
    ):
        return int(range_file.read().split()[0])
    return 32768


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port on `host` free now, for rank 0's torch.distributed store, drawn at random from below the ephemeral
    range: a port bind(0) picked and released could be handed to any process's next outgoing connection before
    rank 0 binds it (EADDRINUSE under load), which a port outside that range never is. Falls back to bind(0)."""
    start = ephemeral_port_start()
    draw = random.SystemRandom()
    for _ in range(64):
        if start <= _STORE_PORTS_FROM:
            break
        port = draw.randrange(_STORE_PORTS_FROM, start)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def threads_per_rank(device_type: str, world_size: int) -> int:
    """Each rank's share (at least 1) of the intra-op threads this process was given on CPU, so ranks of several
    data-parallel engine cores (each given its share of the machine) do not oversubscribe it; 0 (PyTorch's
    default) on CUDA."""
    if device_type != "cpu":
        return 0
    return max(1, torch.get_num_threads() // world_size)


@dataclass
class _PendingCall:
    """A call waiting for `ranks`' answers: `results[rank]` and `failures[rank]` as they arrive. A step
    (`is_step`) that fails on any rank breaks the executor; a failed RPC only fails its call."""

    future: Future[Any]
    ranks: frozenset[int]
    is_step: bool
    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, BaseException] = field(default_factory=dict)


class MultiprocExecutor(BroadcastExecutor):
    """Runs `tensor_parallel_size` worker processes and drives them by broadcast (see the module docstring).

    Invariants: calls are published in the order they are made and every rank applies them in that order;
    `_pending` holds exactly the calls not yet answered (completed by the reply thread); once `death.error` is set
    every pending Future has failed with it and every later call raises it; `shutdown()` leaves no worker process.
    """

    name = "mp"

    def __init__(self, engine_config: EngineConfig, model_info: ModelInfo | None = None) -> None:
        from kvflow.utils import resolve_device

        parallel_config = engine_config.parallel_config
        self.world_size = parallel_config.tensor_parallel_size
        device_type = resolve_device(engine_config.model_config.device).type
        if device_type == "cuda":
            import torch

            if torch.cuda.device_count() < self.world_size:
                raise ValueError(
                    f"tensor_parallel_size={self.world_size} needs {self.world_size} CUDA devices on this "
                    f"machine, found {torch.cuda.device_count()}"
                )
        # Every frame published, in bytes: each counted once, however many ranks receive it.
        self.bytes_broadcast = 0
        self.num_broadcasts = 0
        self.last_broadcast_bytes = 0
        self._call_ids = itertools.count()
        self._pending: dict[int, _PendingCall] = {}
        self._lock = threading.Lock()
        self.death = WorkerDeath(self._lock)
        self._stop_event = threading.Event()  # set first by shutdown and by the finalizer
        self._ipc_dir = tempfile.mkdtemp(prefix="kvflow-mp-")
        self._context = zmq.Context()
        self._broadcast = self._context.socket(zmq.XPUB)
        self._broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank
        self._broadcast.setsockopt(zmq.SNDHWM, 0)
        self._broadcast.setsockopt(zmq.LINGER, 0)
        self._replies = self._context.socket(zmq.PULL)
        self._replies.setsockopt(zmq.RCVHWM, 0)
        self._replies.setsockopt(zmq.LINGER, 0)
        broadcast_address = f"ipc://{os.path.join(self._ipc_dir, 'broadcast')}"
        reply_address = f"ipc://{os.path.join(self._ipc_dir, 'replies')}"
        self._broadcast.bind(broadcast_address)
        self._replies.bind(reply_address)
        dist_init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        num_threads = threads_per_rank(device_type, self.world_size)
        self._procs: list[subprocess.Popen[bytes]] = []
        self._finalizer = weakref.finalize(
            self, _kill_processes, self._procs, self._ipc_dir, self._stop_event
        )
        try:
            startups = RankStartup.for_every_rank(
                engine_config, model_info, self.world_size, dist_init_method, num_threads
            )
            for startup in startups:
                args = MultiprocWorkerArgs(startup, broadcast_address, reply_address, os.getpid())
                self._procs.append(_start_worker_process(args))
            ready = self._wait_until_ready(_STARTUP_TIMEOUT_S)
        except BaseException:
            self._close(kill=True)
            raise
        self.pids = [ready[rank].pid for rank in range(self.world_size)]
        self.num_kv_blocks = min(message.num_kv_blocks for message in ready.values())
        logger.info(
            "mp executor: %d ranks (pids %s), %d threads each, %d KV blocks",
            self.world_size,
            ", ".join(map(str, self.pids)),
            num_threads,
            self.num_kv_blocks,
        )
        self._reply_thread = threading.Thread(
            target=self._receive_replies, name="kvflow-mp-replies", daemon=True
        )
        self._reply_thread.start()

    # ------------------------------------------------------------------------------------------------ start-up
    def _wait_until_ready(self, timeout_s: float) -> dict[int, WorkerReady]:
        """Every rank's `WorkerReady` once every rank has also subscribed to the broadcast; a rank's start-up
        error (raised as its own type, naming the rank), exit or silence past `timeout_s` raises."""
        poller = zmq.Poller()
        poller.register(self._broadcast, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        ready: dict[int, WorkerReady] = {}
        num_subscribed = 0
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.world_size or num_subscribed < self.world_size:
            events = dict(poller.poll(_POLL_MS))
            if self._broadcast in events and self._broadcast.recv()[:1] == b"\x01":
                num_subscribed += 1
            if self._replies in events:
                message = pickle.loads(self._replies.recv())
                if isinstance(message, WorkerReady):
                    ready[message.rank] = message
                elif isinstance(message, WorkerReply) and message.failure is not None:
                    assert message.call_id == STARTUP_CALL_ID
                    raise message.failure.to_exception(message.rank)
            for rank, proc in enumerate(self._procs):
                if proc.poll() is not None and rank not in ready:
                    raise WorkerDiedError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited during start-up "
                        f"({_exit_status(proc.returncode)}); its log above says why"
                    )
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.world_size)) - set(ready))
                raise WorkerDiedError(
                    f"tensor-parallel ranks {missing} were not ready within {timeout_s:.0f} s"
                )
        return ready

    # ------------------------------------------------------------------------------------------------ calls
    def _step(
        self, message: ExecuteModel | SampleTokens, non_block: bool
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """A step's message to every rank; rank 0's answer (or a Future of it)."""
        future = self._call(message, frozenset({0}))
        return _first_result(future) if non_block else future.result()[0]

    def _run_method(self, message: RunMethod) -> list[Any]:
        """Every rank's result, in rank order; the lowest failing rank's exception (naming it) if any failed."""
        return self._call(message, frozenset(range(self.world_size))).result()

    def _call(
        self, message: ExecuteModel | SampleTokens | RunMethod, ranks: frozenset[int]
    ) -> Future[list[Any]]:
        """Publish `message` once to every rank; a Future of the answering `ranks`' results in rank order."""
        call_id = next(self._call_ids)
        frame = encode_broadcast(call_id, message)
        future: Future[list[Any]] = Future()
        with self._lock:
            self.death.raise_if_dead_locked()
            if self._stop_event.is_set():
                raise RuntimeError("the mp executor is shut down")
            self._pending[call_id] = _PendingCall(
                future, ranks, isinstance(message, ExecuteModel | SampleTokens)
            )
            self._broadcast.send(frame, copy=False)
        self.num_broadcasts += 1
        self.last_broadcast_bytes = len(frame)
        self.bytes_broadcast += len(frame)
        return future

    # ------------------------------------------------------------------------------------------------ replies
    def _receive_replies(self) -> None:
        """The reply thread: complete pending calls from the replies, and watch the processes."""
        poller = zmq.Poller()
        poller.register(self._replies, zmq.POLLIN)
        while not self._stop_event.is_set():
            try:
                events = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError:
                return
            if self._replies in events:
                while True:
                    try:
                        frame = self._replies.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_reply(pickle.loads(frame))
            if self.death.error is None and not self._stop_event.is_set():
                dead = self._dead_ranks()
                if dead:
                    self._fail(self._death_message(dead))

    def _on_reply(self, reply: WorkerReply) -> None:
        with self._lock:
            pending = self._pending.get(reply.call_id)
        if pending is None:
            return
        if reply.failure is not None:
            error = reply.failure.to_exception(reply.rank)
            if pending.is_step:
                # The ranks are out of step now (the others may wait in a collective forever).
                self._fail_after_step_error(reply.rank, error)
                return
            pending.failures[reply.rank] = error
        else:
            pending.results[reply.rank] = reply.result
        if len(pending.results) + len(pending.failures) < len(pending.ranks):
            return
        with self._lock:
            self._pending.pop(reply.call_id, None)
        if pending.failures:
            pending.future.set_exception(pending.failures[min(pending.failures)])
        else:
            pending.future.set_result([pending.results[rank] for rank in sorted(pending.ranks)])

    def _fail_after_step_error(self, rank: int, error: BaseException) -> None:
        """A rank's step raised: name the rank that died, if one did (its death is the likelier cause: the others
        then fail in their collectives), else the rank and its error."""
        deadline = time.monotonic() + _DEATH_GRACE_S
        while time.monotonic() < deadline:
            dead = self._dead_ranks()
            if dead:
                self._fail(self._death_message(dead))
                return
            time.sleep(0.05)
        self._fail(f"tensor-parallel rank {rank} failed during a step: {error}")

    def _dead_ranks(self) -> list[int]:
        return [rank for rank, proc in enumerate(self._procs) if proc.poll() is not None]

    def _death_message(self, dead: list[int]) -> str:
        return (
            "; ".join(
                f"tensor-parallel worker rank {rank} (pid {self._procs[rank].pid}) died "
                f"({_exit_status(self._procs[rank].returncode)})"
                for rank in dead
            )
            + ": the engine cannot continue"
        )

    def _fail(self, message: str) -> None:
        """Mark the executor dead: kill the other workers, fail every pending call, refuse every later one."""
        self.death.publish(message, self._take_pending, partial(_kill_processes, self._procs))

    def _take_pending(self) -> list[Future[Any]]:
        """The Futures of every call not answered yet, no longer pending (under `_lock`)."""
        pending, self._pending = self._pending, {}
        return [call.future for call in pending.values()]

    # ------------------------------------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Ask every rank to stop, then terminate and kill whatever did not; idempotent."""
        self._close(kill=False)

    def _close(self, kill: bool) -> None:
        with self._lock:
            if self._stop_event.is_set():
                return
            self._stop_event.set()
            pending, self._pending = list(self._pending.values()), {}
        if not kill and self.death.error is None:
            with contextlib.suppress(zmq.ZMQError):
                self._broadcast.send(encode_broadcast(next(self._call_ids), StopWorker()))
            _wait_for_exit(self._procs, _STOP_TIMEOUT_S)
        thread = getattr(self, "_reply_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_TIMEOUT_S)
        self._finalizer()  # kills what is left, removes the ipc folder
        for call in pending:
            if not call.future.done():
                call.future.set_exception(RuntimeError("the mp executor was shut down"))
        self._broadcast.close()
        self._replies.close()
        self._context.term()


def _first_result(future: Future[list[Any]]) -> Future[Any]:
    """A Future of the first element of `future`'s list result (rank 0's answer)."""
    first: Future[Any] = Future()

    def copy(done: Future[list[Any]]) -> None:
        error = done.exception()
        if error is not None:
            first.set_exception(error)
        else:
            first.set_result(done.result()[0])

    future.add_done_callback(copy)
    return first


def _start_worker_process(args: MultiprocWorkerArgs) -> subprocess.Popen[bytes]:
    """`python -m kvflow.executor.mp_worker` with `args` on its stdin; kvflow importable as it is here."""
    import kvflow

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(kvflow.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        path for path in (package_root, env.get("PYTHONPATH", "")) if path
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.executor.mp_worker"], stdin=subprocess.PIPE, env=env
    )
    assert proc.stdin is not None
    proc.stdin.write(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
    proc.stdin.close()
    return proc


def _wait_for_exit(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))


def _kill_processes(
    procs: list[subprocess.Popen[bytes]],
    ipc_dir: str | None = None,
    stop_event: threading.Event | None = None,
) -> None:
    """Terminate, then kill, every worker still running, and reap them all (also the finalizer at exit, which
    first sets `stop_event`, so the reply thread does not report the exits it causes)."""
    if stop_event is not None:
        stop_event.set()
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    _wait_for_exit(procs, 2.0)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if ipc_dir is not None:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _exit_status(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
