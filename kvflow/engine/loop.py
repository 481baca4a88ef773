"""The engine loop and its messages: the only code that touches an `EngineCore` once it runs.

`InprocEngineCoreClient` (and so `LLM` and the in-process `AsyncLLM`) runs the loop on a thread of the front end's
process; the engine-core process (`kvflow.engine.core_proc`) runs it on its main thread, turning the messages it
receives into `put` calls.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvflow.engine.death import EngineDeadError, EngineDeath, dead_error_for, fresh_dead_error
from kvflow.engine.futures import complete

if TYPE_CHECKING:
    from kvflow.core.sched.output import EngineCoreOutput, SchedulerStats
    from kvflow.engine.core import EngineCore

logger = logging.getLogger(__name__)

# Called with one step's outputs and the scheduler's stats after that step.
OutputHandler = Callable[[list["EngineCoreOutput"], "SchedulerStats"], None]
# How long an idle or paused engine loop waits for a message before looking again.
_IDLE_WAIT_S = 0.05


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
        death: EngineDeath,
        messages: queue.SimpleQueue[LoopMessage] | None = None,
    ) -> None:
        """`death`: the owner's; the loop publishes its end there and reports it (pending calls fail, the dead
        handler is called). `messages`: the queue to read (one filled before the loop existed), else a new one."""
        self._engine_core = engine_core
        self._output_handler = output_handler
        self._death = death
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

    def run(self) -> None:
        """Run until a `LoopShutdown` message or an error. Then the engine is dead for new callers (published on
        `death` before the queue is drained: nothing can be queued after), and everything pending fails."""
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
        self._stop(self._death.publish(dead_error_for(error), replace_clean=True))

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
        waiters += self._pause_waiters
        self._pause_waiters = []
        if not self._death.report(lambda: waiters):
            for waiter in waiters:  # the owner reported the death already (it began a shutdown)
                complete(waiter, error=fresh_dead_error(dead_error))
        try:
            self._engine_core.shutdown()
        except Exception:
            logger.exception("engine core shutdown failed")
        logger.info("engine loop stopped")
