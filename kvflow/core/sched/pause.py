"""What the scheduler may do while the engine is paused (the engine core decides when: `pause_generation`)."""

from __future__ import annotations

import enum


class PauseState(enum.Enum):
    """What `schedule()` may do while the engine is paused. Requests that arrive meanwhile still queue."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"  # running requests continue; nothing is admitted
    PAUSED_ALL = "paused_all"  # nothing is scheduled
