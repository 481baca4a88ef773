"""Engine-core clients: how a front end drives an `EngineCore` that it does not step itself.

`EngineCoreClient` is the interface `AsyncLLM` is written against. `InprocEngineCoreClient` runs the core on a
thread of this process; a multiprocess client (ZMQ + msgspec to an engine-core process) implements the same
interface. Every call is a message carrying plain data, so nothing here assumes the core shares this memory,
except `run`, which ships a callable (for inspection and tests).
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
class _Utility:
    """Run `fn(engine_core)` and complete `done` with its result."""

    fn: Callable[[EngineCore], Any]
    done: Future[Any]


@dataclass
class _Pause:
    mode: str
    clear_cache: bool
    done: Future[None]


@dataclass
class _Shutdown:
    pass


_Message = _Utility | _Pause | _Shutdown


class InprocEngineCoreClient(EngineCoreClient):
    """Runs the core on one dedicated thread of this process (the engine loop), the only thread that touches it.

    The loop applies queued messages, steps the core whenever `can_make_progress()`, waits on the message queue
    (briefly) when idle or paused, and calls the output handler after each step that produced outputs. A message
    that fails fails its caller only; an error anywhere else stops the loop and is the engine's `dead_error` cause.
    """

    def __init__(
        self,
        engine_core: EngineCore,
        output_handler: OutputHandler,
        dead_handler: Callable[[EngineDeadError], None],
    ) -> None:
        self._engine_core = engine_core  # touched by the engine loop only, once it runs
        self._output_handler = output_handler
        self._dead_handler = dead_handler
        self._pause_waiters: list[Future[None]] = []
        self._current_message: _Message | None = None
        self._running = True
        self._lock = threading.Lock()  # guards the two below
        self._messages: queue.SimpleQueue[_Message] = queue.SimpleQueue()
        self._dead_error: EngineDeadError | None = None
        self._thread = threading.Thread(
            target=self._run_engine_loop, name="kvflow-engine-core", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------------------------------------ callers
    def call_utility(self, method: str, *args: Any) -> Future[Any]:
        return self.run(lambda core: getattr(core, method)(*args))

    def pause_generation(self, mode: str, clear_cache: bool) -> Future[None]:
        done: Future[None] = Future()
        self._send(_Pause(mode, clear_cache, done))
        return done

    def run(self, fn: Callable[[EngineCore], _T]) -> Future[_T]:
        done: Future[_T] = Future()
        self._send(_Utility(fn, done))
        return done

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def shutdown(self) -> None:
        with self._lock:
            if self._dead_error is None:
                self._dead_error = EngineDeadError("the engine core is shut down")
                self._messages.put(_Shutdown())
        if threading.current_thread() is not self._thread:
            self._thread.join(_SHUTDOWN_JOIN_S)
            if self._thread.is_alive():
                logger.warning("the engine loop did not stop within %.0f s", _SHUTDOWN_JOIN_S)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _send(self, message: _Message) -> None:
        with self._lock:
            if self._dead_error is not None:
                raise fresh_dead_error(self._dead_error)
            self._messages.put(message)

    # ------------------------------------------------------------------------------------------------ engine loop
    def _run_engine_loop(self) -> None:
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
        self._stop(error)

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

    def _apply(self, message: _Message) -> None:
        if isinstance(message, _Utility):
            try:
                result = message.fn(self._engine_core)
            except Exception as exc:
                complete(message.done, error=exc)
                return
            complete(message.done, result)
        elif isinstance(message, _Pause):
            try:
                outputs = self._engine_core.pause_generation(message.mode, message.clear_cache)
            except Exception as exc:
                complete(message.done, error=exc)
                return
            self._deliver(outputs)
            self._pause_waiters.append(message.done)
        elif isinstance(message, _Shutdown):
            self._running = False

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            self._output_handler(outputs, self._engine_core.make_stats())

    def _release_pause_waiters(self) -> None:
        core = self._engine_core
        if self._pause_waiters and (not core.is_paused() or core.pause_effective()):
            waiters, self._pause_waiters = self._pause_waiters, []
            for waiter in waiters:
                complete(waiter)

    # ------------------------------------------------------------------------------------------------ stop
    def _stop(self, error: BaseException | None) -> None:
        """Leave nobody waiting: fail pending and queued messages, tell the front end, release the core."""
        with self._lock:
            if error is not None:
                dead = EngineDeadError(f"the engine core failed: {error!r}")
                dead.__cause__ = error
                self._dead_error = dead
            elif self._dead_error is None:
                self._dead_error = EngineDeadError("the engine core is shut down")
            dead_error = self._dead_error
        unfinished: list[_Message] = [self._current_message] if self._current_message else []
        while True:  # messages queued before the error was published; nothing can be added after it
            try:
                unfinished.append(self._messages.get_nowait())
            except queue.Empty:
                break
        waiters = [message.done for message in unfinished if not isinstance(message, _Shutdown)]
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
