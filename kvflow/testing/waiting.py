"""Waiting for a state, never for a time: the one polling helper the tests share."""

from __future__ import annotations

import time
from collections.abc import Callable

HANG_GUARD_S = 120.0


def wait_until(
    condition: Callable[[], bool],
    what: str,
    timeout_s: float = HANG_GUARD_S,
    interval_s: float = 0.01,
) -> None:
    """Poll `condition` every `interval_s` until it holds; an AssertionError naming `what` once `timeout_s` has
    passed (a hang guard: on a busy machine a state may take long, it must still come)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(interval_s)
