"""OS-level names for kvflow's processes, so that `ps`, `top` and benchmarks can tell them apart, and the other
process-level helpers of a supervisor: dying with the parent, stopping a group of children.

`set_process_name("kvflow-api-0")` sets the calling thread's name (the main thread's is the process name shown in
`/proc/<pid>/comm` and by `ps -o comm`) with Linux's `prctl(PR_SET_NAME)`, through ctypes. The kernel keeps at most
15 bytes. On other systems, or if the call fails, nothing happens: a name is a convenience, never a requirement.

Names in use: `kvflow-engine-<data-parallel rank>` for an engine-core process, `kvflow-api-<index>` for each API
server process of `kvflow serve --api-server-count N` (N > 1).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_MAX_NAME_BYTES = 15


def _prctl(option: int, argument: int | bytes) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, argument, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_process_name(name: str) -> None:
    """Name this process (its main thread) `name`, cut to the kernel's 15 bytes."""
    encoded = name.encode()[:_MAX_NAME_BYTES]
    if not _prctl(_PR_SET_NAME, encoded):
        logger.debug("could not set the process name to %r", name)


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Have the kernel send `signum` to this process when its parent dies (`PR_SET_PDEATHSIG`), so that a process
    whose supervisor was killed does not outlive it."""
    if not _prctl(_PR_SET_PDEATHSIG, signum):
        logger.debug("could not ask for a signal on the parent's death")


def stop_processes(processes: Sequence[BaseProcess], timeout_s: float, what: str) -> None:
    """SIGTERM every started process still running, wait up to `timeout_s` for each, then SIGKILL (and reap) those
    still running; `what` names them in the warning about a kill."""
    started = [process for process in processes if process.pid is not None]
    for process in started:
        if process.exitcode is None:
            process.terminate()
    for process in started:
        process.join(timeout_s)
        if process.exitcode is None:
            logger.warning("%s process %d did not stop: killing it", what, process.pid)
            process.kill()
            process.join(timeout_s)
