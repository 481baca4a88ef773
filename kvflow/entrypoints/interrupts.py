"""Ctrl-C at safe points: a SIGINT that arrives during an engine step is held back until the step is over."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


class DeferredInterrupt:
    """Inside this context a SIGINT only sets `pending`; `check()` raises the KeyboardInterrupt where the caller
    chose (between engine steps), so an interrupt never leaves the scheduler and the worker disagreeing about a
    half-run step.

    Invariants: active only in the main thread (the only one Python delivers signals to) and only while Python's
    default SIGINT handler is installed; anywhere else it changes nothing. On exit the previous handler is back, and
    an interrupt still pending is raised (unless an exception is already leaving the block).
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous_handler: signal.Handlers | None = None

    def __enter__(self) -> DeferredInterrupt:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            signal.signal(signal.SIGINT, self._hold)
            self._previous_handler = signal.default_int_handler  # type: ignore[assignment]
        return self

    def _hold(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True

    def check(self) -> None:
        """Raise the held KeyboardInterrupt, if there is one."""
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._previous_handler = None
        if exc_type is None:
            self.check()
