"""Engine-core clients: how a front end drives an `EngineCore` that it does not step itself.

`EngineCoreClient` is the interface `AsyncLLM` is written against. `InprocEngineCoreClient` runs the core's
`EngineLoop` on a thread of this process; `kvflow.engine.mp_client.MPEngineCoreClient` talks (ZMQ + msgspec) to an
engine-core process that runs the same `EngineLoop` on its main thread; `kvflow.engine.dp_client.DPEngineCoreClient`
drives several such processes as one (data parallelism). Every call is a message carrying plain data, so nothing
here assumes the core shares this memory, except `run`, which ships a callable (for inspection and tests; across
processes it travels with cloudpickle).
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput, SchedulerStats
    from kvflow.engine.core import EngineCore
    from kvflow.request import Request

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
# Called with one step's outputs and the scheduler's stats after that step.
OutputHandler = Callable[[list["EngineCoreOutput"], "SchedulerStats"], None]
_IDLE_WAIT_S = (
    0.05  # how long an idle or paused engine loop waits for a message before looking again
)
_SHUTDOWN_JOIN_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine core has stopped (shut down, or failed: then `__cause__` is the error); nothing more is served."""


def fresh_dead_error(error: EngineDeadError) -> EngineDeadError:
    """A copy of the engine's closing error for one more caller (a traceback belongs to one raise)."""
    copy = EngineDeadError(*error.args)
    copy.__cause__ = error.__cause__
    return copy


class EngineCoreClient(ABC):
    """The front end's handle on one engine core.

    Invariants every implementation keeps:
      * messages are applied in the order sent, each between two engine steps; each returns a Future;
      * the core's outputs reach the `output_handler` given at construction, one step's outputs (with the
        scheduler's stats after that step) per call, in step order, from one thread at a time; all outputs produced
        before a message was applied are handled before that message's Future completes;
      * once the core stops (`shutdown`, or an error: `dead_error.__cause__`), `dead_handler` is called once,
        every pending Future fails with `EngineDeadError`, and every later call raises it.
    """

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        """Run `EngineCore.<method>(*args)` between steps; the Future holds its result or exception."""

    @abstractmethod
    def pause_generation(self, mode: str, clear_cache: bool) -> Future[None]:
        """Pause the core (semantics: `kvflow.engine.core.Pause`); completes once the pause is in effect or a
        later `resume_generation` released it. Mode "abort"'s outputs reach the output handler first."""

    @abstractmethod
    def run(self, fn: Callable[[EngineCore], _T]) -> Future[_T]:
        """Run `fn(engine_core)` between steps (inspection, administration and tests)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the core (idempotent; returns once it has stopped)."""

    @property
    @abstractmethod
    def dead_error(self) -> EngineDeadError | None:
        """The error every call raises once the core has stopped; None while it runs."""

    # ------------------------------------------------------------------------------------------------ utilities
    def add_requests(self, requests: list[Request]) -> Future[None]:
        """Queue a prompt's requests, or a streaming session's next chunk; all or nothing (ValueError)."""
        return self.call_utility("add_requests", requests)

    def abort_requests(self, request_ids: list[str]) -> Future[None]:
        return self.call_utility("abort_requests", request_ids)

    def close_session(self, request_id: str) -> Future[bool]:
        """True: the session ended at once, and no output will report it (see `EngineCore.close_session`)."""
        return self.call_utility("close_session", request_id)

    def resume_generation(self) -> Future[None]:
        return self.call_utility("resume_generation")

    def is_paused(self) -> Future[bool]:
        return self.call_utility("is_paused")

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> Future[bool]:
        return self.call_utility("reset_prefix_cache", reset_running_requests)

    def update_weights(self, weights: Any) -> Future[int]:
        return self.call_utility("update_weights", weights)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Future[list[Any]]:
        """`EngineCore.collective_rpc`: a worker method by name, or a callable taking the worker first, on every
        rank; the Future holds the results in rank order."""
        return self.call_utility("collective_rpc", method, tuple(args), dict(kwargs or {}))

    def is_alive(self) -> bool:
        """Whether the engine loop (thread or process) still runs."""
        return self.dead_error is None

    @property
    def num_engines(self) -> int:
        """How many engine cores this client drives (data parallelism: more than one)."""
        return 1

    def run_each(self, fn: Callable[[EngineCore], _T]) -> Future[list[_T]]:
        """`run(fn)` on every engine core; the Future holds the results in core order."""
        return gather([self.run(fn)], lambda results: results)


def gather(
    futures: list[Future[Any]],
    combine: Callable[[list[Any]], _T],
    translate_error: Callable[[BaseException], BaseException] = lambda error: error,
) -> Future[_T]:
    """A Future that completes once every one of `futures` has: with `combine(their results)` (in the order given),
    or with the first of their errors in that order (passed through `translate_error`)."""
    gathered: Future[_T] = Future()
    lock = threading.Lock()
    remaining = [len(futures)]

    def on_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        errors = [error for each in futures if (error := each.exception()) is not None]
        if errors:
            complete(gathered, error=translate_error(errors[0]))
            return
        try:
            result = combine([each.result() for each in futures])
        except Exception as exc:
            complete(gathered, error=exc)
            return
        complete(gathered, result)

    if not futures:
        complete(gathered, combine([]))
    for each in futures:
        each.add_done_callback(on_done)
    return gathered


def complete(
    future: Future[Any] | None, result: Any = None, error: BaseException | None = None
) -> None:
    """Complete a caller's future unless the caller gave up on it (cancelled)."""
    if future is None:
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


@dataclass
class LoopCall:
    """An engine-loop message: run `fn(engine_core)` and complete `done` with its result."""

    fn: Callable[[EngineCore], Any]
    done: Future[Any]


@dataclass
class LoopPause:
    """An engine-loop message: pause; `done` completes once the pause is in effect or released by a resume."""

    mode: str
    clear_cache: bool
    done: Future[None]


@dataclass
class LoopShutdown:
    """An engine-loop message: stop after the messages before it; with `error`, fail with it (the engine dies of
    it, as of an error in a step)."""

    error: BaseException | None = None


@dataclass
class LoopBatch:
    """Engine-loop messages applied together, with no step between them: what a front end in another process sent
    while handling one step's outputs (an in-process front end's handler runs on the loop's own thread, so what it
    queues is applied before the next step anyway)."""

    messages: list[LoopCall | LoopPause | LoopShutdown]


LoopMessage = LoopCall | LoopPause | LoopShutdown | LoopBatch


class EngineLoop:
    """The engine loop: the only code that touches the core once it runs, on whichever thread calls `run()`.

    `InprocEngineCoreClient` runs it on a thread of the front end's process; the engine-core process
    (`kvflow.engine.core_proc`) runs it on its main thread, turning the messages it receives into `put` calls.
    The loop applies queued messages in order between steps, steps the core whenever `can_make_progress()`, waits on
    the message queue (briefly) when idle or paused, and calls the output handler after each step that produced
    outputs. A pause's Future completes once the pause is in effect or a resume released it. A message that fails
    fails its caller only; an error anywhere else stops the loop: every pending Future fails with `EngineDeadError`
    (its `__cause__` the error), `dead_handler` is called once, and the core is shut down.

    Invariant: a bad request fails only itself, never the engine. It is refused when it is added (its call fails
    with a ValueError naming the field: `EngineCore.add_requests` checks it against `RequestLimits`, and
    `SamplingParams.validate` bounds every number to the type the engine stores it in), and a fault inside a step
    that belongs to one request (its sampling, or applying its output) ends that request with finish_reason
    "error" while the step's other requests go on (`ModelRunnerOutput.failed_req_ids`,
    `Scheduler._fail_request`). Only a fault no request can be blamed for stops the loop.
    """

    def __init__(
        self,
        engine_core: EngineCore,
        output_handler: OutputHandler,
        dead_handler: Callable[[EngineDeadError], None],
        messages: queue.SimpleQueue[LoopMessage] | None = None,
    ) -> None:
        """`messages`: the queue to read (one filled before the loop existed), else a new one."""
        self._engine_core = engine_core
        self._output_handler = output_handler
        self._dead_handler = dead_handler
        self._pause_waiters: list[Future[None]] = []
        self._current_message: LoopMessage | None = None
        self._running = True
        self._messages: queue.SimpleQueue[LoopMessage] = (
            messages if messages is not None else queue.SimpleQueue()
        )

    def put(self, message: LoopMessage) -> None:
        """Queue a message (reentrant: safe from a signal handler)."""
        self._messages.put(message)

    def drain_queue(self) -> list[LoopMessage]:
        """Take every queued message (only once nothing can be added any more)."""
        unfinished: list[LoopMessage] = []
        while True:
            try:
                unfinished.append(self._messages.get_nowait())
            except queue.Empty:
                return unfinished

    def run(self, publish_error: Callable[[BaseException | None], EngineDeadError]) -> None:
        """Run until a `LoopShutdown` message or an error. `publish_error(error)` makes the engine dead for new callers
        (error None: a clean shutdown) and returns the error pending ones get; it runs before the queue is drained."""
        core = self._engine_core
        error: BaseException | None = None
        try:
            while self._running:
                self._apply_messages(block=not core.can_make_progress())
                if not self._running:
                    break
                if core.can_make_progress():
                    self._deliver(core.step())
                self._release_pause_waiters()
        except BaseException as exc:  # the loop must never leave a caller waiting
            logger.exception("the engine loop failed")
            error = exc
        self._stop(publish_error(error))

    def _apply_messages(self, block: bool) -> None:
        try:
            message = (
                self._messages.get(timeout=_IDLE_WAIT_S) if block else self._messages.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._current_message = message  # failed with the others if applying it kills the loop
            self._apply(message)
            self._current_message = None
            if not self._running:
                return
            try:
                message = self._messages.get_nowait()
            except queue.Empty:
                return

    def _apply(self, message: LoopMessage) -> None:
        if isinstance(message, LoopCall):
            try:
                result = message.fn(self._engine_core)
            except Exception as exc:
                complete(message.done, error=exc)
                return
            complete(message.done, result)
        elif isinstance(message, LoopPause):
            try:
                outputs = self._engine_core.pause_generation(message.mode, message.clear_cache)
            except Exception as exc:
                complete(message.done, error=exc)
                return
            self._deliver(outputs)
            self._pause_waiters.append(message.done)
        elif isinstance(message, LoopShutdown):
            if message.error is not None:
                raise message.error
            self._running = False
        elif isinstance(message, LoopBatch):
            for each in message.messages:
                self._apply(each)
                if not self._running:
                    return

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            self._output_handler(outputs, self._engine_core.make_stats())

    def _release_pause_waiters(self) -> None:
        core = self._engine_core
        if self._pause_waiters and (not core.is_paused() or core.pause_effective()):
            waiters, self._pause_waiters = self._pause_waiters, []
            for waiter in waiters:
                complete(waiter)

    def _stop(self, dead_error: EngineDeadError) -> None:
        """Leave nobody waiting: fail pending and queued messages, tell the front end, release the core."""
        unfinished: list[LoopMessage] = [self._current_message] if self._current_message else []
        unfinished += (
            self.drain_queue()
        )  # queued before the error was published; nothing can follow it
        flat = [
            each
            for message in unfinished
            for each in (message.messages if isinstance(message, LoopBatch) else [message])
        ]
        waiters = [message.done for message in flat if not isinstance(message, LoopShutdown)]
        for waiter in [*self._pause_waiters, *waiters]:
            complete(waiter, error=fresh_dead_error(dead_error))
        self._pause_waiters.clear()
        try:
            self._dead_handler(dead_error)
        except Exception:
            logger.exception("the front end's dead handler failed")
        try:
            self._engine_core.shutdown()
        except Exception:
            logger.exception("engine core shutdown failed")
        logger.info("engine loop stopped")


def dead_error_for(error: BaseException | None) -> EngineDeadError:
    """The `EngineDeadError` of a loop that stopped with `error` (None: shut down)."""
    if error is None:
        return EngineDeadError("the engine core is shut down")
    dead = EngineDeadError(f"the engine core failed: {error!r}")
    dead.__cause__ = error
    return dead


class InprocEngineCoreClient(EngineCoreClient):
    """Runs the core's `EngineLoop` on one dedicated thread of this process, the only thread that touches it.

    `_lock` makes "the engine is dead" and "the message is queued" one step, so no message is queued after the
    loop drained its queue.
    """

    def __init__(
        self,
        engine_core: EngineCore,
        output_handler: OutputHandler,
        dead_handler: Callable[[EngineDeadError], None],
    ) -> None:
        self._loop = EngineLoop(engine_core, output_handler, dead_handler)
        self._lock = threading.Lock()  # guards the dead error and queuing
        self._dead_error: EngineDeadError | None = None
        self._thread = threading.Thread(
            target=self._loop.run, args=(self._publish,), name="kvflow-engine-core", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------------------------ callers
    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        return self.run(lambda core: getattr(core, method)(*args))

    def pause_generation(self, mode: str, clear_cache: bool) -> Future[None]:
        done: Future[None] = Future()
        self._send(LoopPause(mode, clear_cache, done))
        return done

    def run(self, fn: Callable[[EngineCore], _T]) -> Future[_T]:
        done: Future[_T] = Future()
        self._send(LoopCall(fn, done))
        return done

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def shutdown(self) -> None:
        with self._lock:
            if self._dead_error is None:
                self._dead_error = dead_error_for(None)
                self._loop.put(LoopShutdown())
        if threading.current_thread() is not self._thread:
            self._thread.join(_SHUTDOWN_JOIN_S)
            if self._thread.is_alive():
                logger.warning("the engine loop did not stop within %.0f s", _SHUTDOWN_JOIN_S)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, message: LoopMessage) -> None:
        with self._lock:
            if self._dead_error is not None:
                raise fresh_dead_error(self._dead_error)
            self._loop.put(message)

    def _publish(self, error: BaseException | None) -> EngineDeadError:
        with self._lock:
            if error is not None or self._dead_error is None:
                self._dead_error = dead_error_for(error)
            return self._dead_error
