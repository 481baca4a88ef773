"""Completing and combining the `concurrent.futures.Future`s that engine-core calls return."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, TypeVar

_T = TypeVar("_T")


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
