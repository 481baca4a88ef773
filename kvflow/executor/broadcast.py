"""The half shared by the executors whose ranks run elsewhere (`mp`: worker processes, `ray`: actors): each call
becomes one message for every rank, and a rank's death is owned in one place (`WorkerDeath`)."""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from kvflow.executor.base import Executor
from kvflow.executor.messages import ExecuteModel, SampleTokens

if TYPE_CHECKING:
    from kvflow.core.sched.output import GrammarOutput, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker failed or exited; the engine cannot go on."""


def _nothing_pending() -> Iterable[Future[Any]]:
    return ()


class WorkerDeath:
    """Whether an executor's ranks are dead, and failing what waits on them once they are (the executors' side of
    what `kvflow.engine.death.EngineDeath` is to the engine).

    Invariants:
      * `lock` is the executor's own lock: "check the ranks are alive, then submit" is one step under it, and
        `publish` takes the same lock, so no call is submitted after `publish` took the pending ones;
      * `error` is None while every rank runs; the first `publish` sets it (and logs it) and it never changes;
      * `publish` stops the ranks left alive before it fails the pending Futures, each with `error`.
    """

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.error: WorkerDiedError | None = None

    def raise_if_dead_locked(self) -> None:
        """The death's error once a rank has died; for a caller that holds `lock`."""
        if self.error is not None:
            raise self.error

    def publish(
        self,
        message: str,
        take_pending: Callable[[], Iterable[Future[Any]]] = _nothing_pending,
        stop_ranks: Callable[[], None] | None = None,
    ) -> bool:
        """Make the executor dead with `WorkerDiedError(message)` unless it already is: take the pending Futures
        (`take_pending()`, under `lock`), `stop_ranks()` (the ranks left would wait forever in a collective),
        then fail each Future not done yet. Returns whether this call made it dead. The caller must not hold
        `lock`."""
        with self.lock:
            if self.error is not None:
                return False
            error = self.error = WorkerDiedError(message)
            pending = list(take_pending())
        logger.error("%s", message)
        if stop_ranks is not None:
            stop_ranks()
        for future in pending:
            if not future.done():
                future.set_exception(error)
        return True


class BroadcastExecutor(Executor):
    """An executor that sends each call to its ranks as one message (`ExecuteModel`, `SampleTokens`,
    `RunMethod`, see `kvflow.executor.messages`), serialized once for all of them.

    Invariants a subclass keeps: `_step` answers with rank 0's output (or a Future of it) and `_run_method` with
    every rank's result in rank order; both raise `death.error` once a rank has died.
    """

    death: WorkerDeath

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        return self._step(ExecuteModel(scheduler_output), non_block)

    def sample_tokens(
        self, grammar_output: GrammarOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        return self._step(SampleTokens(grammar_output), non_block)

    @abstractmethod
    def _step(
        self, message: ExecuteModel | SampleTokens, non_block: bool
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """A step's message to every rank; rank 0's answer (or a Future of it)."""
