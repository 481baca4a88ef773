"""Engine construction for the commands: startup failures become `CommandError`s (one line, exit 2)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from kvflow.engine.arg_utils import EngineArgs
    from kvflow.engine.async_llm import AsyncLLM
    from kvflow.engine.stats import StatLogger
    from kvflow.entrypoints.llm import LLM

logger = logging.getLogger(__name__)

_E = TypeVar("_E")


class CommandError(Exception):
    """A mistake the user can fix (a flag, a file, the environment): printed as one line, exit status 2."""


def make_llm(args: argparse.Namespace) -> LLM:
    """The offline engine the flags describe."""
    from kvflow.entrypoints.llm import LLM

    return _start(LLM.from_engine_args, args)


def make_async_llm(args: argparse.Namespace, stat_loggers: Sequence[StatLogger] = ()) -> AsyncLLM:
    """The asyncio engine the flags describe, feeding `stat_loggers` (metrics backends) after every step."""
    from kvflow.engine.async_llm import AsyncLLM

    def factory(engine_args: EngineArgs) -> AsyncLLM:
        return AsyncLLM(stat_loggers=stat_loggers, **dataclasses.asdict(engine_args))

    return _start(factory, args)


def _start(factory: Callable[..., _E], args: argparse.Namespace) -> _E:
    """Build the engine. ValueError and OSError pass through (the caller prints them as one line); a RuntimeError
    or MemoryError while starting is the environment refusing the configuration (torch cannot allocate the KV
    cache, a device is unusable), so it becomes a CommandError too, with the traceback logged at DEBUG. After
    startup, a RuntimeError is a bug and keeps its traceback."""
    from kvflow.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    try:
        return factory(engine_args)
    except (RuntimeError, MemoryError) as error:
        logger.debug("engine startup failed", exc_info=True)
        raise CommandError(
            f"could not start the engine: {error} (KVFLOW_LOGGING_LEVEL=DEBUG shows the traceback)"
        ) from error
