"""Engine death, owned in one place: the error every later call raises, published once; every pending call failed
once; the front end's dead handler called once. The in-process, multiprocess and data-parallel clients and the
engine loop itself all use `EngineDeath`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

from kvflow.engine.futures import complete

logger = logging.getLogger(__name__)

DeadHandler = Callable[["EngineDeadError"], None]


class EngineDeadError(RuntimeError):
    """The engine core has stopped (shut down, or failed: then `__cause__` is the error); nothing more is served."""


def fresh_dead_error(error: EngineDeadError) -> EngineDeadError:
    """A copy of the engine's closing error for one more caller (a traceback belongs to one raise)."""
    copy = EngineDeadError(*error.args)
    copy.__cause__ = error.__cause__
    return copy


def dead_error_for(error: BaseException | None, message: str | None = None) -> EngineDeadError:
    """The `EngineDeadError` of an engine that stopped with `error` (None: shut down); `message` replaces the
    default text ("the engine core failed: <error>")."""
    if error is None:
        return EngineDeadError(message or "the engine core is shut down")
    dead = EngineDeadError(message or f"the engine core failed: {error!r}")
    dead.__cause__ = error
    return dead


class EngineDeath:
    """Whether one engine (as one client sees it) is dead, and telling everyone once it is.

    Invariants:
      * `lock` is the owner's lock: "check the engine is alive, then register or queue a call" is one step under it,
        and `publish` takes the same lock, so no call is registered after `report` took the pending ones;
      * `error` is None while the engine runs; once set it stays set, except that a failure may replace a clean
        shutdown's error when published with `replace_clean` (a process that crashes while being stopped);
      * `report` runs its effects once: every pending Future fails with a fresh copy of `error`, then the dead
        handler is called (its exception is logged, never raised).
    """

    def __init__(
        self, dead_handler: DeadHandler, lock: AbstractContextManager[Any] | None = None
    ) -> None:
        """`lock`: the owner's lock (a Lock or an RLock), else a new Lock."""
        self.lock: AbstractContextManager[Any] = lock if lock is not None else threading.Lock()
        self.error: EngineDeadError | None = None
        self._dead_handler = dead_handler
        self._reported = False

    @property
    def is_dead(self) -> bool:
        return self.error is not None

    def raise_if_dead(self) -> None:
        """EngineDeadError (a fresh copy) once the engine is dead."""
        error = self.error
        if error is not None:
            raise fresh_dead_error(error)

    def publish(
        self, dead: EngineDeadError | None = None, replace_clean: bool = False
    ) -> EngineDeadError:
        """Make the engine dead for new callers with `dead` (None: a clean shutdown) unless it already is; returns
        the error in force. Takes `lock`: the caller must not hold it."""
        with self.lock:
            return self.publish_locked(dead, replace_clean)

    def publish_locked(
        self, dead: EngineDeadError | None = None, replace_clean: bool = False
    ) -> EngineDeadError:
        """`publish`, for a caller that holds `lock`."""
        if dead is None:
            dead = dead_error_for(None)
        clean = self.error is not None and self.error.__cause__ is None
        if self.error is None or (replace_clean and clean and dead.__cause__ is not None):
            self.error = dead
        return self.error

    def report(self, take_pending: Callable[[], Iterable[Future[Any]]] = tuple) -> bool:
        """Once the engine is dead, and only the first time: fail what `take_pending()` returns (called under
        `lock`), then call the dead handler. Returns whether this call reported."""
        with self.lock:
            if self._reported or self.error is None:
                return False
            self._reported = True
            error = self.error
            pending = list(take_pending())
        for done in pending:
            complete(done, error=fresh_dead_error(error))
        try:
            self._dead_handler(error)
        except Exception:
            logger.exception("the front end's dead handler failed")
        return True

    def mark_reported(self) -> None:
        """Report nothing, ever (a client whose front end never had an engine to lose: its startup failed)."""
        with self.lock:
            self._reported = True
